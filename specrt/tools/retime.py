"""`specrt retime FOLDER`: time a built folder's steps again, on this machine as it is now, and
write the costs into its manifest (`build.speculation`), with the kernel table (`build.kernels`,
builder/gates/kernels.py).

Speculation is chosen by measured cost: adaptive k on the one-row graphs starts from
`costs_ms`, and the batched engine's policy (runtime/batch/policy.py) picks plain, pair, lookup
or draft rounds for every step from `batch_costs_ms`. The build times them where it runs. On a
machine busy with other work, or on another machine than the one that serves, they mislead:
an int4 build timed beside a test run (2026-12-04) recorded its batched int8 draft step at x1.77
a target step at one row, x1.36 when retimed on the quiet machine, and every step 1.6-2.5x
slower than it is. Retime where the folder serves, when it is quiet.

- Only folders that run on ONNX Runtime's CPU backend: a GPU folder's costs are its GPU's,
  timed by its build there (docs/gpu.md); it is refused with a ConfigError.
- Every file's sha256 is checked first: a damaged folder is refused, not retimed. The graphs,
  weights and hashes are untouched; only manifest.json is replaced (atomically). The costs it
  replaces are kept under `build.speculation.retimed.previous`, and `specrt inspect` shows when
  and by what the costs were measured.
- The plan (`chosen`, `predicted`) is recomputed from the new costs and the acceptance the
  build measured (its draft's agreement with the target), as the build computes it.
- First, the folder's exactness gates are measured again on this machine's kernels
  (builder/gates/here.py: the target's verify rows against its decode rows, batched rows alone
  against together, windows, a prompt in any cache row). Each is a property of the kernels,
  which ONNX Runtime picks by instruction set and version; the runtime refuses a folder on
  kernels its gates were not measured on (manifest_device.check_gated, `device.gated_on`). Where they
  hold, this machine's kernels join `device.gated_on`; where one fails, a ParityError says which
  and nothing is written (rebuild on this machine).
- A batched model's prompt chunks are checked again (`models.batch.parity.chunk_invariance`,
  builder/gates/chunks.py): whether a request alone may prefill in larger chunks with the same
  bits on this machine's kernels; the folder takes them only where every machine in
  `device.gated_on` gave the same bits. Folders built before that check get it here. So are
  prompts of several requests in one call (`models.batch.parity.prompt_rows`, the same rule).
"""
from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path
from typing import Callable

from specrt import __version__
from specrt import manifest as mf
from specrt.errors import ConfigError


def retime(engines: str | Path, *, out: Callable[[str], None] = print, gates_only: bool = False) -> dict:
    """Measure the folder's gates and step costs again and write them into its manifest; returns
    the new `build.speculation`. gates_only: the gates and the prompt chunks' check only, the
    costs and the kernel table kept (a folder that serves on several kinds of CPU: one manifest
    holds one cost table, that of the machine that serves most, retimed there; the others are
    added with gates_only)."""
    from specrt.builder.gates import here, quiet
    from specrt.builder.steps import prompt_ids
    from specrt.runtime.backends.ort_cpu import gate_record
    from specrt.runtime.tokenizer import Tokenizer
    root = Path(engines)
    man = mf.load(root)
    if man.device.get("kind") != "cpu" or man.engines is not None:
        raise ConfigError(f"{root} was built for {man.device.get('kind')} ({man.device.get('backend')}): its step "
                          "costs are its GPU's and only its build there measures them; retime runs ONNX Runtime CPU "
                          "folders. Rebuild it on the GPU that serves it to measure them again")
    out(f"retime: checking every file of {root} (sha256)")
    mf.check_files(man, root, hashes=True)
    prompts = prompt_ids(Tokenizer(root, man.tokenizer), int(man.target.dims["vocab"]))
    record = gate_record(f"specrt {__version__} retime") or {}
    out(f"retime: the exactness gates on this machine's kernels ({record.get('kernels', 'unknown')})")
    record["gates"] = here.recheck(root, man, prompts, out)       # or a ParityError: nothing written
    if gates_only:
        spec, build = dict(man.build.get("speculation") or {}), man.build
    else:
        threads = int((man.build.get("config") or {}).get("threads") or 2)
        with quiet.cpu_share(threads, f"specrt {__version__} retime") as timed:     # was the machine free?
            spec, kernels = _timings(root, man, out)
        spec["conditions"] = timed
        if quiet.warning(timed):
            out(f"retime: {quiet.warning(timed)}")
        build = {**man.build, "speculation": spec, **kernels}
    models, gated = dict(man.models), _gated_on(man, record)
    if man.batch is not None:
        models["batch"] = dataclasses.replace(man.batch, parity={
            **man.batch.parity, "chunk_invariance": _chunks(root, man, prompts, record, gated, out),
            "prompt_rows": _prompt_rows(root, man, prompts, record, gated, out)})
    device = {**man.device, **({"gated_on": gated} if gated is not None else {})}
    dataclasses.replace(man, build=build, models=models, device=device).save(root)
    if not gates_only:
        out(f"retime: {summary(spec['retimed']['previous'])} -> {summary(spec)}")
    fields = ([] if gates_only else ["build.speculation", "build.kernels"]) + \
        (["models.batch.parity.chunk_invariance", "models.batch.parity.prompt_rows"] if man.batch is not None else []) + \
        (["device.gated_on: the gates hold on this machine's kernels"] if gated is not None else [])
    out(f"retime: written to {root / mf.FILENAME} ({', '.join(fields)}"
        + ("; the costs and the kernel table kept)" if gates_only else ")"))
    return spec


def _timings(root: Path, man: mf.Manifest, out: Callable[[str], None]) -> tuple[dict, dict]:
    """(the new build.speculation, {"kernels": the kernel table} or {} where it failed)."""
    from specrt.builder.gates import batch_costs, here, kernels, plan
    old = dict(man.build.get("speculation") or {})
    previous = {k: old[k] for k in ("costs_ms", "batch_costs_ms") if k in old}
    was = old.get("retimed")
    previous["measured_by"] = was.get("by") if isinstance(was, dict) else "specrt build"
    out("retime: timing the one-row graphs (target decode, verify, draft decode)")
    t_sub, t_part = here.one_row_part(man.target)
    d_sub, d_part = here.one_row_part(man.draft) if man.draft is not None else (None, None)
    costs = plan.step_costs(root / t_sub, t_part, root / d_sub if d_sub else None, d_part, man.shapes)
    acceptance = plan.draft_acceptance({"parity": man.draft.parity, "source": man.draft.source}
                                       if man.draft is not None else None)
    spec = plan.plan(costs, acceptance, man.shapes.k)
    if man.batch is not None:
        out("retime: timing the batched model (rows x tokens per step)")
        spec["batch_costs_ms"] = batch_costs.entry_costs(root, man.batch, man.shapes, draft_entry=man.batch_draft)
    spec["retimed"] = {"by": f"specrt {__version__} retime",
                       "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "previous": previous}
    out("retime: the kernel table (each kernel family at the shapes the runtime runs)")
    try:
        return spec, {"kernels": kernels.measure(root, man, measured_by=spec["retimed"]["by"])}
    except Exception as e:      # the step costs above are written all the same
        out(f"retime: the kernel table could not be measured ({type(e).__name__}: {e}); the folder keeps "
            "the one it had")
        return spec, {}


def _chunks(root: Path, man: mf.Manifest, prompts, record: dict, gated: list | None,
            out: Callable[[str], None]) -> dict:
    """models.batch.parity.chunk_invariance: whether a request alone may prefill in larger chunks
    (the same bits on this machine's kernels: builder/gates/chunks.py; folders built before the
    check get it here), and only where every machine the folder is gated on gave the same bits."""
    from specrt.builder.gates import chunks
    out("retime: prompt chunks of a request alone (the same bits in larger chunks?)")
    rec = chunks.measure(root, man.batch, man.shapes, prompts)
    return _everywhere(rec, man.batch.parity.get("chunk_invariance"), record, gated)


def _prompt_rows(root: Path, man: mf.Manifest, prompts, record: dict, gated: list | None,
                 out: Callable[[str], None]) -> dict:
    """models.batch.parity.prompt_rows: whether requests admitted together may share prompt
    calls (builder/gates/chunks.py prompt_rows), as _chunks decides."""
    from specrt.builder.gates import chunks
    out("retime: prompts of several requests in one call (the same bits as each alone?)")
    rec = chunks.prompt_rows(root, man.batch, man.shapes, prompts)
    return _everywhere(rec, man.batch.parity.get("prompt_rows"), record, gated)


def _everywhere(rec: dict, old: dict | None, record: dict, gated: list | None) -> dict:
    """A setting's record measured here, equal only where the machines it was measured on
    before (device.gated_on's other kernels) gave the same bits too."""
    old = old if isinstance(old, dict) else {}
    others = [g for g in gated or [] if g.get("kernels") != record.get("kernels")]
    if others and rec.get("equal") and not old.get("equal"):
        rec = {**rec, "equal": old.get("equal"), "equal_here": True,
               "why": f"the same bits here, not where measured before ({len(others)} other kernel set(s))"}
    return rec


def _gated_on(man: mf.Manifest, record: dict) -> list[dict] | None:
    """device.gated_on with this machine's record (replacing an earlier one of the same kernels);
    a folder built before specrt recorded it: this machine's alone (where else it holds is unknown)."""
    if not record.get("kernels"):
        return man.device.get("gated_on")
    gated = man.device.get("gated_on")
    kept = [g for g in gated if isinstance(g, dict) and g.get("kernels") != record["kernels"]] if gated else []
    return kept + [record]


def summary(spec: dict) -> str:
    """One line of the costs that choose the rounds: decode / verify / draft ms at one row."""
    c = spec.get("costs_ms") or {}
    parts = [f"{k} {c[k]:.1f}" for k in ("target_decode", "target_verify", "draft_decode") if k in c]
    b = spec.get("batch_costs_ms") or {}
    one = {T: rows.get("1") for T, rows in (b.get("target") or {}).items()}
    if one:
        parts.append("batch 1 row T=" + ", ".join(f"{T}: {v:.1f}" for T, v in sorted(one.items(), key=lambda x: int(x[0]))
                                                 if v is not None))
    if (b.get("draft") or {}).get("1") is not None:
        parts.append(f"batch draft {b['draft']['1']:.1f}")
    return "ms " + "; ".join(parts) if parts else "no costs"
