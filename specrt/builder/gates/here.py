"""A built CPU folder's exactness gates, measured again on this machine (`specrt retime`).

Each guarantee of a folder is a property of the kernels that compute it, measured by its
build: the target's verify rows equal its decode rows (builder/gates/identity.py), a batched
row gives the same bits whatever the rows beside it and whatever cache length it reads
(gates/batch.py invariance), a position the same in any window a speculating batch runs
(window_invariance, at the folder's min_tokens), a prompt the same in any cache row
(gates/chunks.py prompt_invariance). ONNX Runtime picks its CPU kernels by instruction set
(AVX2, AVX-512, VNNI, AMX) and changes them between versions; another kernel may sum in
another order. So the manifest records the kernels the gates held on (device.gated_on:
runtime/backends/ort_cpu.py kernel_fingerprint), the runtime refuses a folder on kernels it
was not measured on (manifest_device.check_gated), and `specrt retime` measures the gates here, over
the folder's own files and the build's calibration prompts, with the folder's own settings
(its padding of odd calls, its windows' min_tokens): where one fails the folder cannot serve
here (ParityError naming the gate; rebuild on this machine, where the build chooses settings
the kernels allow), and nothing is written.

The prompt chunks' gate (chunk_invariance) chooses a setting rather than passing or failing:
retime measures it here and the folder takes the larger chunk only where every machine it is
gated on gave the same bits (tools/retime.py).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

from specrt import manifest as mf
from specrt.errors import ParityError

log = logging.getLogger(__name__)


def one_row_part(entry: mf.ModelEntry) -> tuple[str, dict]:
    """(subfolder, the build's part dict: graphs with files relative to it, dims) of a one-row model."""
    sub = Path(entry.weights["file"]).parent
    graphs = {g: {"file": str(Path(e.file).relative_to(sub)), "tokens": e.tokens} for g, e in entry.graphs.items()}
    return str(sub), {"graphs": graphs, "dims": entry.dims}


def recheck(root: Path, man: mf.Manifest, prompts: list[list[int]],
            out: Callable[[str], None] = print) -> dict:
    """Measure the folder's gates on this machine: {gate: {"equal", "max_abs_logit_delta", ...}}.
    Raises ParityError naming each gate that does not hold here as it held for the build."""
    from specrt.builder.gates import batch, chunks, identity
    shapes, records, failed = man.shapes, {}, []
    built = man.target.parity.get("identity")
    if built is not None and set(man.target.graphs) >= {"prefill", "decode", "verify"}:
        out("retime: gate 1: the target's verify rows against its decode rows")
        sub, part = one_row_part(man.target)
        r = identity.decode_verify_agreement(root / sub, part, shapes, prompts)
        bitwise = bool(built.get("bitwise_equal"))
        records["identity"] = {"equal": r["bitwise_equal"] if bitwise else r["argmax_flips"] == 0,
                               "rows": r["rows"], "argmax_flips": r["argmax_flips"],
                               "max_abs_logit_delta": r["max_abs_logit_delta"]}
        if not records["identity"]["equal"]:
            failed.append(f"the target's verify rows against its decode rows ({r['argmax_flips']} argmax flips, "
                          f"{r['rows'] - r['bitwise_equal_rows']} of {r['rows']} rows not bit for bit; the build: "
                          + ("bit for bit)" if bitwise else "no argmax flip)"))
    entry = man.batch
    if entry is not None:
        out("retime: gate 2: batched rows alone against together, and over any cache length")
        inv = batch.invariance(root, entry, shapes, prompts)
        records["batch_invariance"] = {k: inv[k] for k in ("equal", "rows", "steps", "max_abs_logit_delta")}
        if not inv["equal"]:
            failed.append(f"a batched row alone against among others (max |delta logit| "
                          f"{inv['max_abs_logit_delta']:.3g}"
                          + (f", over another cache length {inv['kv_len']['max_abs_logit_delta']:.3g}"
                             if "kv_len" in inv else "") + ")")
        windows = entry.parity.get("window_invariance") or {}
        if windows.get("equal") is True:        # the folder speculates inside a batch
            m = int(windows.get("min_tokens", batch.MIN_TOKENS))
            out(f"retime: gate 3: a position in {m}-token steps against verify windows")
            w = batch.window_invariance(root, entry, shapes, prompts, min_tokens=m)
            records["window_invariance"] = {k: w[k] for k in ("equal", "min_tokens", "max_abs_logit_delta")}
            if not w["equal"]:
                failed.append(f"a position in {m}-token steps against verify windows (max |delta logit| "
                              f"{w['max_abs_logit_delta']:.3g})")
        if (entry.parity.get("prompt_invariance") or {}).get("equal") is True:
            out("retime: gate 4: a prompt in any cache row and length")
            p = chunks.prompt_invariance(root, entry, shapes, prompts)
            records["prompt_invariance"] = {k: p.get(k) for k in ("equal", "max_abs_logit_delta", "max_abs_kv_delta")}
            if not p["equal"]:
                failed.append(f"a prompt in another cache row or length (max |delta| logits "
                              f"{p['max_abs_logit_delta']:.3g}, K/V {p['max_abs_kv_delta']:.3g})")
    if failed:
        raise ParityError(
            f"{root}: on this machine's kernels the folder's guarantees do not hold as its build measured them: "
            + "; ".join(failed) + ". It cannot serve here (its answers would differ from plain decoding or depend "
            "on the batch); rebuild the engines on this machine (`specrt build ...` with the same options: the build "
            "chooses what these kernels allow). Nothing was written")
    return records


__all__ = ["one_row_part", "recheck"]
