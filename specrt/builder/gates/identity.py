"""Do a model's decode (T=1) and verify (T=k+1) graphs give the same rows?

Greedy speculative output equals plain greedy output only if the verify pass picks, at
every position, the token the one-token graph would have picked. Kernels that quantize
activations (MatMulNBits accuracy_level 4, `quantize_dynamic`) may round a row
differently when it is computed alone (T=1) or among k+1 rows, and a flipped argmax
changes the whole continuation after it (onnxruntime-genai's own speculation on its
int4 model differs from its plain output on 4-7 of 12 prompts).

The check replays the same greedy continuation of real prompts along three paths, each
with its own cache (as the runtime would build it):

    decode path : prefill(prompt) -> decode x n                        (plain decoding)
    verify path : prefill(prompt) -> verify windows of k+1 at P, P+k+1, ...
    phase path  : prefill(prompt) -> a padded window of 2 -> windows of k+1
    pair path   : prefill(prompt) -> one decode step -> two-token decode windows (only for a
                  two-row decode graph: the windows a pair round runs)
                  (the same positions land in other rows, and padding is exercised)

and compares every row's logits with the decode path's: max |delta logit|, argmax
flips, and whether they are bit for bit equal.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt import manifest as mf
from specrt.driver import GraphSet, greedy, kl_rows


def _windows(first: int, total: int, width: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    if first:
        out.append((0, min(first, total)))
        pos = first
    while pos < total:
        out.append((pos, min(pos + width, total)))
        pos += width
    return out


def decode_verify_agreement(model_dir: Path, part: dict, shapes: mf.Shapes, token_lists: list[list[int]],
                            n_new: int = 24) -> dict:
    """Compare verify rows with decode rows over greedy continuations of `token_lists`."""
    graphs = {g: part["graphs"][g] for g in ("prefill", "decode", "verify")}
    width = shapes.k + 1
    flips = rows = bitwise = 0
    max_delta = 0.0
    gs = GraphSet(model_dir, graphs, part["dims"], shapes.kv_capacity)
    for ids in token_lists:
        ids = ids[: shapes.prefill_chunk]
        P = len(ids)
        n = min(n_new, shapes.max_context - P - width)
        if n < 1:
            continue
        gs.reset()
        plain = greedy(gs, ids, n + 1, keep_rows=True)       # plain decoding: the reference rows
        seq, ref = plain.tokens, np.stack(plain.rows[1:])    # [n + 1], [n, V]: the decode steps' rows
        # verify windows at two phases; a two-row decode graph also replays pairs (pair rounds)
        paths = [("verify", first, width) for first in (0, 2)] + \
            [("decode", 1, pair) for pair in (graphs["decode"]["tokens"],) if pair > 1]
        for graph, first, w in paths:
            gs.reset()
            gs.step("prefill", ids, 0)
            for lo, hi in _windows(first, n, w):
                got = gs.step(graph, seq[lo:hi], P + lo)     # [hi-lo, V]
                want = ref[lo:hi]
                d = np.abs(got - want)
                max_delta = max(max_delta, float(d.max()))
                flips += int((got.argmax(-1) != want.argmax(-1)).sum())
                bitwise += int((d.max(-1) == 0).sum())
                rows += hi - lo
    return {"rows": rows, "argmax_flips": flips, "bitwise_equal_rows": bitwise,
            "bitwise_equal": bitwise == rows, "max_abs_logit_delta": max_delta,
            "prompts": len(token_lists), "new_tokens_per_prompt": n_new,
            "how": "greedy continuation replayed by decode steps and by verify windows (two phases)"
                   + (", and by two-token windows of the decode graph (pair rounds)" if graphs["decode"]["tokens"] > 1
                      else "")}


def fp32_reference(reference_dir: Path, reference: dict, shapes: mf.Shapes, token_lists: list[list[int]],
                   n_new: int = 24) -> list[dict]:
    """The fp32 export's greedy continuation of each prompt (its first prefill chunk) and the
    rows that chose it: [{"ids", "tokens": n+1, "rows": [n+1, V]}], row i the logits at
    position P-1+i. The reference of target_agreement and of requests_agreement."""
    C = shapes.prefill_chunk
    ref_gs = GraphSet(reference_dir, {g: reference["graphs"][g] for g in ("prefill", "decode")},
                      reference["dims"], shapes.kv_capacity)
    out = []
    for ids in token_lists:
        ids = list(ids[:C])
        n = max(0, min(n_new, shapes.max_context - len(ids) - 1))
        ref_gs.reset()
        run = greedy(ref_gs, ids, n + 1, keep_rows=True)
        out.append({"ids": ids, "tokens": list(run.tokens[:n + 1]), "rows": np.stack(run.rows)})
    return out


REFERENCE = "the fp32 export, teacher-forced on its own greedy continuations"


def _agreement(refs: list[dict], got: list[np.ndarray]) -> dict:
    agree = total = 0
    kl_sum, max_delta = 0.0, 0.0
    for r, rows in zip(refs, got):
        ref = r["rows"]
        agree += int((rows.argmax(-1) == ref.argmax(-1)).sum())
        total += len(ref)
        max_delta = max(max_delta, float(np.abs(rows - ref).max()))
        kl_sum += float(kl_rows(ref, rows).sum())
    return {"top1_agreement": agree / total if total else 0.0, "positions": total,
            "mean_kl": kl_sum / total if total else 0.0, "max_abs_logit_delta": max_delta, "reference": REFERENCE}


def target_agreement(refs: list[dict], model_dir: Path, part: dict, shapes: mf.Shapes) -> dict:
    """Teacher-forced agreement of a quantized target's one-row graphs with the fp32 one on the
    fp32 greedy continuation of each prompt (fp32_reference): top-1 agreement, mean KL(fp32 ||
    variant), max |delta logit|."""
    gs = GraphSet(model_dir, {g: part["graphs"][g] for g in ("prefill", "decode")}, part["dims"],
                  shapes.kv_capacity)
    got = []
    for r in refs:
        ids, P = r["ids"], len(r["ids"])
        seq = ids + r["tokens"]
        gs.reset()
        rows = [gs.step("prefill", ids, 0)[P - 1].copy()]
        for i in range(len(r["tokens"]) - 1):
            rows.append(gs.step("decode", seq[P + i:P + i + 1], P + i)[0].copy())
        got.append(np.stack(rows))
    return _agreement(refs, got)


def requests_agreement(folder: Path, refs: list[dict], threads: int) -> dict:
    """The same agreement measured on what a built folder's requests run (a `--batch` folder's
    batched model, through the engine's own calls: runtime/batch/forced.py), where the one-row
    graphs' figure (target_agreement) describes graphs no request runs."""
    from specrt.runtime import SpeculativeGenerator
    gen = SpeculativeGenerator(folder, methods=("plain",), threads=threads)
    if gen.one.one_row:
        raise ValueError(f"{folder}: its requests run its one-row graphs, which target_agreement measures")
    got = [gen.teacher_forced(r["ids"], r["tokens"]) for r in refs]
    attention = gen.manifest.batch.source.get("attention", "?")
    return {**_agreement(refs, got),
            "model": f"the batched model ({attention}), in the calls a request alone makes (runtime/batch/forced.py): "
                     "what every request on this folder runs"}
