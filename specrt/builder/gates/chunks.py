"""Does the batched model's prompt graph give the same bits whatever the chunk a prompt is fed in?

The engine feeds a prompt in chunks of the folder's prefill chunk (64 tokens by default), one
row a call, so a request's tokens depend on its prompt alone. When no other row is decoding
(a request alone: the single stream, the first request of a quiet server) nothing waits on
the step, and a larger chunk costs less per token: on SmolLM2 int4 (rows graph, int8 row-wise
prompt graph, AVX2 EPYC, 2026-12-07) a 930-token prompt took x0.94-0.95 of its time in chunks
of 256 (docs/benchmarks.md). That is lossless only if the graph computes each position the same
way whatever the chunk around it: per-row activation scales, attention per query row over the
positions before it. This gate measures it: one prompt of LONE_CHUNKS x chunk + chunk + 3
tokens fed in chunks of the folder's size, and again as one chunk of that size, one of
LONE_CHUNKS times it (starting off its own multiple, as when the rows beside a prompt finish
half-way through it) and an odd remainder (a model that pads odd calls pads it), and compares
the last logits and every layer's K/V of the prompt's positions bit for bit. The runtime uses the larger chunk
only when this says equal (runtime/backends/batch_calls.py lone_prefill_tokens); a graph that
rounds otherwise (ONNX Runtime's GroupQueryAttention takes another path for several tokens)
keeps the folder's chunk.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)
LONE_CHUNKS = 4        # the larger chunk: this many of the folder's


def chunk_invariance(tmp: Path, part: dict, shapes, prompts) -> dict:
    """The gate at build time, over the batched model's part in the build's folder."""
    from specrt.builder.manifest_writer import model_entry
    return measure(tmp, model_entry("batch", part, "batch"), shapes, prompts)


def measure(root: Path, entry, shapes, prompts) -> dict:
    """{"equal", "chunks": [C, LONE_CHUNKS * C], "tokens", "max_abs_logit_delta",
    "max_abs_kv_delta"}; equal None (with "why") when the context is too short to check. Also
    `specrt retime`'s, over a built folder's models.batch (where it serves)."""
    C = shapes.prefill_chunk
    big = LONE_CHUNKS * C
    n = big + C + 3
    record = {"chunks": [C, big], "tokens": n}
    if n >= shapes.max_context:
        return {**record, "equal": None, "why": f"a {n}-token prompt does not fit max_context {shapes.max_context}"}
    ids = [int(t) for p in prompts for t in p]
    if not ids:
        return {**record, "equal": None, "why": "no calibration prompt"}
    ids = (ids * (n // len(ids) + 1))[:n]
    small = [C] * (n // C) + ([n % C] if n % C else [])
    mixed = [C, big, n - C - big]
    (la, kva), (lb, kvb) = _fed(root, entry, shapes, ids, small, big), _fed(root, entry, shapes, ids, mixed, big)
    logit_delta = float(np.max(np.abs(la - lb)))
    kv_delta = max(float(np.max(np.abs(a - b))) for a, b in zip(kva, kvb))
    equal = bool(np.array_equal(la, lb) and all(np.array_equal(a, b) for a, b in zip(kva, kvb)))
    log.info("prompt chunks of %d and %d tokens: %s (max |delta| logits %.3g, K/V %.3g)", C, big,
             "the same bits" if equal else "other numbers: a request alone keeps the folder's chunk",
             logit_delta, kv_delta)
    return {**record, "equal": equal, "max_abs_logit_delta": logit_delta, "max_abs_kv_delta": kv_delta}


def _fed(root: Path, entry, shapes, ids: list[int], sizes: list[int], call_tokens: int):
    """The prompt's last logits and its positions' K/V per layer, fed in chunks of `sizes` into
    row 0 of a fresh one-row model, as the engine feeds a prompt (runtime/batch/engine.py
    _prefill_chunk: the chunk unpadded, logits of its last min_rows positions)."""
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    graphs = tuple(g for g in ("step", "prefill") if g in entry.graphs)
    model = OrtBatchModel(root, entry, shapes, rows=1, threads=2, graphs=graphs, call_tokens=call_tokens)
    P = max(model.min_rows, 1)
    last, s = None, 0
    assert sum(sizes) == len(ids) and all(c >= 1 for c in sizes), sizes
    for c in sizes:
        piece = ids[s:s + c]
        T = max(len(piece), P)
        toks = np.zeros((1, T), np.int64)
        toks[0, :len(piece)] = piece
        pos = (np.arange(P, dtype=np.int64) + max(len(piece) - P, 0))[None, :]
        last = model.step("prefill", toks, np.array([s], np.int64), 0, pos, pad_start=0)[0, -1].copy()
        s += c
    kv = [a[0, :, :len(ids)].copy() for a in model.cache.keys + model.cache.values]
    return last, kv
