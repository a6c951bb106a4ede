"""Does the batched model's prompt graph give the same bits whatever the chunk a prompt is fed in?

The engine feeds a prompt in chunks of the folder's prefill chunk (64 tokens by default), one
row a call, so a request's tokens depend on its prompt alone. When no other row is decoding
(a request alone: the single stream, the first request of a quiet server) nothing waits on
the step, and a larger chunk costs less per token: on SmolLM2 int4 (rows graph, int8 row-wise
prompt graph, AVX2 EPYC, 2026-12-07) a 930-token prompt took x0.94-0.95 of its time in chunks
of 256 (docs/benchmarks.md). That is lossless only if the graph computes each position the same
way whatever the chunk around it: per-row activation scales, attention per query row over the
positions before it. This gate measures it: one prompt of LONE_CHUNKS x chunk + chunk + 3
tokens fed in chunks of the folder's size and a last one of 1 token then 2 (a prompt one token
past a multiple of the chunk ends in a one-token call, which kernels may run another way), and
again as one chunk of that size, one of LONE_CHUNKS times it (starting off its own multiple, as
when the rows beside a prompt finish half-way through it) and an odd remainder of 3 (a model
that pads odd calls pads it), and compares the last logits and every layer's K/V of the
prompt's positions bit for bit. The runtime uses the larger chunk only when this says equal
(runtime/backends/batch_calls.py lone_prefill_tokens); a graph that rounds otherwise keeps the
folder's chunk. (The one-token call found one: ONNX Runtime's GroupQueryAttention runs one
token a row through another path, ~4e-6 apart in a K/V, ~1.4 in a logit after SmolLM2 int4's
int8 row scales; the runtime now runs a one-token prompt chunk through it as two tokens,
runtime/backends/ort_batch.py, and the gate holds.)

A prompt graph that attends otherwise than the step graph (--batch-prefill rowwise-gqa:
GroupQueryAttention beside a "rows" step graph) reads each row's own length from past_len, not
from the cache it is bound to, whose length the other rows set (a growing cache; a prompt
chunk beside longer rows runs over a cache of its own, runtime/backends/ort_batch.py). A
request's tokens would depend on its batch if its prompt's numbers depended on that length or
on its cache row: `prompt_invariance` feeds one prompt into the only row of a one-row model,
into the last row of a model whose first row holds a prompt near the maximum context, and into
a middle row bound over the whole capacity, and compares the last logits and its K/V bit for
bit. The build refuses a graph that fails (ParityError naming --batch-prefill rowwise).
Before quantization, `prompt_agreement` checks that such a graph computes what the step graph
computes: one prompt through each fp32 graph, the last logits and every K/V within fp32
rounding of each other (another kernel, the same arithmetic: a rotary or window convention
apart would be O(1) off, and decode steps read what the prompt graph wrote).

Prompts of several requests in one call (runtime/batch/admission.py _prefill_group: requests
admitted together, each call as many tokens of every row) are lossless only if a row's prompt
gives the same bits among others as alone: per-row activation scales, a kernel that sums a row
the same way whatever the rows beside it, chunk boundaries that change nothing. `prompt_rows`
measures it: GROUP prompts of different lengths (a short one, one ending in a one-token chunk,
one chunk exactly, several chunks; an odd number of rows, which a model that pads odd calls
pads) fed together as the engine feeds them (each call as many tokens of every row as the
shortest has left, at most a chunk), once into a fresh model and once beside a row
that holds a long prompt (the cache bound that much longer), each row's last logits and K/V
against the same prompt alone, bit for bit. The engine puts several prompts in one call only
where this says equal (runtime/backends/batch_calls.py prompt_rows); a prompt graph that runs
one row a call (GroupQueryAttention: ONNX Runtime refuses several rows of several tokens over a
filled cache) or has a static T is recorded as not checked, and keeps one row a call.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from specrt.errors import ParityError

log = logging.getLogger(__name__)
LONE_CHUNKS = 4        # the larger chunk: this many of the folder's
GROUP = 5              # prompts in one call in the prompt_rows gate (odd: a model that pads odd calls pads it)


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
    rem = n % C                                        # 3 (for C > 3): a one-token call, then two
    small = [C] * (n // C) + ([1, rem - 1] if rem >= 2 else [rem] if rem else [])
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
    row 0 of a fresh one-row model (_feed)."""
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    graphs = tuple(g for g in ("step", "prefill") if g in entry.graphs)
    assert sum(sizes) == len(ids) and all(c >= 1 for c in sizes), sizes
    return _feed(OrtBatchModel(root, entry, shapes, rows=1, threads=2, graphs=graphs, call_tokens=call_tokens),
                 0, ids, sizes)


def prompt_invariance(tmp: Path, part: dict, shapes, prompts) -> dict:
    """The gate at build time (module docstring): {"equal", "tokens", "rows", "lengths",
    "max_abs_logit_delta", "max_abs_kv_delta"}; equal None (with "why") where the context is
    too short for a prompt beside a longer one."""
    from specrt.builder.manifest_writer import as_entry
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    entry = as_entry("batch", part, "batch")
    C, M = shapes.prefill_chunk, shapes.max_context
    ids = [int(t) for p in prompts for t in p]
    n, far = min(2 * C + 5, M // 3), M - 2        # the prompt (several chunks, a short last one); the long row
    if not ids or n < 2:
        return {"equal": None, "why": "no calibration prompt" if not ids else f"max_context {M} is too short"}
    ids = ids * (far // len(ids) + 1)
    prompt, other = ids[:n], ids[n:n + far]
    graphs = tuple(g for g in ("step", "prefill") if g in entry.graphs)

    def model(rows):
        return OrtBatchModel(tmp, entry, shapes, rows=rows, threads=2, graphs=graphs)

    alone, shared = model(1), model(3)
    runs = [_feed(alone, 0, prompt, C)]
    _feed(shared, 0, other, C)                                     # the cache grows to the long row's length
    runs.append(_feed(shared, 2, prompt, C))                       # beside it: the chunk's own short cache
    lengths = [alone.max_kv_len, shared.kv_len]
    runs.append(_feed(shared, 1, prompt, C, kv_len=shapes.kv_capacity))   # bound over the whole capacity
    lengths.append(shapes.kv_capacity)
    logit_delta = max(float(np.max(np.abs(runs[0][0] - r[0]))) for r in runs[1:])
    kv_delta = max(float(np.max(np.abs(a - b))) for r in runs[1:] for a, b in zip(runs[0][1], r[1]))
    equal = all(np.array_equal(runs[0][0], r[0]) and all(np.array_equal(a, b) for a, b in zip(runs[0][1], r[1]))
                for r in runs[1:])
    log.info("prompt graph: a %d-token prompt in rows 0, 2 and 1 over caches of %s positions: %s (max |delta| "
             "logits %.3g, K/V %.3g)", n, lengths, "the same bits" if equal else "other numbers", logit_delta, kv_delta)
    return {"equal": equal, "tokens": n, "rows": [0, 2, 1], "lengths": lengths,
            "max_abs_logit_delta": logit_delta, "max_abs_kv_delta": kv_delta}


def prompt_rows_gate(tmp: Path, part: dict, shapes, prompts) -> dict:
    """prompt_rows at build time, over the batched model's part in the build's folder."""
    from specrt.builder.manifest_writer import model_entry
    return prompt_rows(tmp, model_entry("batch", part, "batch"), shapes, prompts)


def prompt_rows(root: Path, entry, shapes, prompts) -> dict:
    """Prompts of several requests in one call against each alone (module docstring): {"equal",
    "rows", "lengths", "max_abs_logit_delta", "max_abs_kv_delta"}; equal None (with "why") where
    the prompt graph runs one row a call, has a static T, or the context is too short. Also
    `specrt retime`'s, over a built folder's models.batch."""
    from specrt.runtime.backends.batch_calls import min_tokens
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    graphs = tuple(g for g in ("step", "prefill") if g in entry.graphs)
    prompt_graph = "prefill" if "prefill" in graphs else "step"
    C, M = shapes.prefill_chunk, shapes.max_context
    lengths = sorted({2, C // 2 + 1, C, C + 1, 2 * C + 3})[:GROUP]
    record = {"rows": len(lengths), "lengths": lengths}
    if OrtBatchModel._attention(root, entry, (prompt_graph,)) == "gqa":
        return {**record, "equal": None, "why": "the prompt graph attends with GroupQueryAttention: one row a call"}
    if not getattr(entry.graphs[prompt_graph], "dynamic_tokens", False):
        return {**record, "equal": None, "why": "the prompt graph takes a static number of tokens"}
    ids = [int(t) for p in prompts for t in p]
    far = M - 2                                     # the row beside them: a prompt near the maximum context
    if not ids or lengths[-1] >= M:
        return {**record, "equal": None, "why": "no calibration prompt" if not ids else f"max_context {M} is too short"}
    ids = ids * ((far + sum(lengths)) // len(ids) + 2)
    group = [ids[7 * i + 1:7 * i + 1 + n] for i, n in enumerate(lengths)]     # different prompts
    other = ids[:far]

    def model(rows):
        return OrtBatchModel(root, entry, shapes, rows=rows, threads=2, graphs=graphs)

    alone = model(1)
    ref = [_feed(alone, 0, p, C) for p in group]
    fresh, beside = model(len(group)), model(len(group) + 1)
    m = min_tokens(entry, shapes.k)        # as the engine pads a call (a one-token chunk: m tokens)
    runs = [_feed_group(fresh, 0, group, C, m)]
    _feed(beside, 0, other, C)
    runs.append(_feed_group(beside, 1, group, C, m))
    logit_delta = max(float(np.max(np.abs(a[0] - b[0]))) for r in runs for a, b in zip(ref, r))
    kv_delta = max(float(np.max(np.abs(x - y))) for r in runs for a, b in zip(ref, r) for x, y in zip(a[1], b[1]))
    equal = all(np.array_equal(a[0], b[0]) and all(np.array_equal(x, y) for x, y in zip(a[1], b[1]))
                for r in runs for a, b in zip(ref, r))
    log.info("prompts of %d requests (%s tokens) in one call, alone and beside a %d-token row: %s (max |delta| "
             "logits %.3g, K/V %.3g)", len(group), lengths, far,
             "the same bits as each alone" if equal else "other numbers: one row a call", logit_delta, kv_delta)
    return {**record, "equal": equal, "max_abs_logit_delta": logit_delta, "max_abs_kv_delta": kv_delta}


def _feed_group(model, first_row: int, prompts: list[list[int]], C: int, min_tokens: int = 1) -> list:
    """`prompts` (shortest first) into cache rows first_row.. together, as the engine feeds
    requests admitted together (runtime/batch/admission.py _prefill_group: one call a chunk, the
    rows whose prompt ended leaving the front of the group); each one's last logits and K/V.
    (The engine may also cut a call shorter to keep it within a step's budget: other chunk
    boundaries, which change nothing where this gate holds, as it compares against chunks of C.)"""
    from specrt.runtime.backends.batch_calls import prompt_call
    P = max(model.min_rows, 1)
    fed, lasts = [0] * len(prompts), [None] * len(prompts)
    while fed[-1] < len(prompts[-1]):
        act = [i for i, p in enumerate(prompts) if fed[i] < len(p)]
        T = min(C, min(len(prompts[i]) - fed[i] for i in act))
        chunks = [prompts[i][fed[i]:fed[i] + T] for i in act]
        T, lows = prompt_call([len(c) for c in chunks], P, min_tokens, model.min_rows)
        toks = np.zeros((len(act), T), np.int64)
        pos = np.zeros((len(act), P), np.int64)
        for j, c in enumerate(chunks):
            toks[j, :len(c)] = c
            pos[j] = np.arange(P) + lows[j]
        out = model.step("prefill", toks, np.array([fed[i] for i in act], np.int64), first_row + act[0], pos,
                         pad_start=0)
        for j, (i, c) in enumerate(zip(act, chunks)):
            fed[i] += len(c)
            if fed[i] == len(prompts[i]):
                lasts[i] = out[j, len(c) - 1 - lows[j]].copy()
    return [(lasts[i], [a[first_row + i, :, :len(p)].copy() for a in model.cache.keys + model.cache.values])
            for i, p in enumerate(prompts)]


AGREE_LOGIT, AGREE_KV = 1e-2, 1e-4      # fp32 graphs: max |delta logit|, max relative K/V error (norms)


def prompt_agreement(root: Path, entry, shapes, prompts) -> dict:
    """The fp32 prompt graph of its own attention against the fp32 step graph (`entry`: the
    unquantized export, files relative to `root`): {"agrees", "tokens", "max_abs_logit_delta",
    "max_rel_kv_delta"}."""
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    ids = [int(t) for p in prompts for t in p]
    n = min(2 * shapes.prefill_chunk + 5, shapes.max_context // 3)
    if not ids or n < 2:
        return {"agrees": None, "why": "no calibration prompt" if not ids else "max_context is too short"}
    ids = (ids * (n // len(ids) + 1))[:n]
    (la, kva), (lb, kvb) = (_feed(OrtBatchModel(root, entry, shapes, rows=1, threads=2, graphs=g), 0, ids,
                                  shapes.prefill_chunk) for g in (("step", "prefill"), ("step",)))
    logit = float(np.max(np.abs(la - lb)))
    kv = max(float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)) for a, b in zip(kva, kvb))
    agrees = logit <= AGREE_LOGIT and kv <= AGREE_KV
    log.info("prompt graph against the step graph (fp32, %d tokens): max |delta logit| %.3g, K/V %.3g relative: %s",
             n, logit, kv, "agree" if agrees else "DISAGREE")
    return {"agrees": agrees, "tokens": n, "max_abs_logit_delta": logit, "max_rel_kv_delta": kv}


def fp32_agreement(src: Path, part: dict, target_part: dict, cache_length: dict, shapes, prompts) -> dict:
    """prompt_agreement over the batched model's fp32 export in `src` (its part before
    quantization; cache_length: gates/batch.cache_length of the step graph's attention)."""
    from specrt.builder.manifest_writer import model_entry
    fp32 = {**part, "family": target_part["family"], "precision": "fp32", "source": {},
            "kv": {**target_part["kv"], "dtype": part["kv_dtype"], "update": part["kv_update"], **cache_length}}
    return prompt_agreement(src.parent, model_entry("batch", fp32, src.name), shapes, prompts)


def refuse_prompt_graph(parity: dict) -> None:
    """A ParityError naming --batch-prefill rowwise where a prompt graph of its own attention
    failed prompt_agreement_fp32 or prompt_invariance."""
    pa, pi = parity.get("prompt_agreement_fp32"), parity.get("prompt_invariance")
    fix = "Build with --batch-prefill rowwise (the prompt graph attending as the step graph does)"
    if pa is not None and pa["agrees"] is False:
        raise ParityError(
            f"the batched model's GroupQueryAttention prompt graph does not compute what its step graph computes (fp32: "
            f"max |delta logit| {pa['max_abs_logit_delta']:.3g}, K/V {pa['max_rel_kv_delta']:.3g} relative): decode "
            f"steps would read a cache written another way. {fix}")
    if pi is not None and pi["equal"] is False:
        raise ParityError(
            f"the batched model's GroupQueryAttention prompt graph computes a prompt differently in another cache row "
            f"or over a cache of another length (max |delta| logits {pi['max_abs_logit_delta']:.3g}, K/V "
            f"{pi['max_abs_kv_delta']:.3g}): a request's tokens would depend on the requests beside it. {fix}")


def _feed(model, row: int, ids: list[int], chunks: int | list[int], kv_len: int | None = None):
    """`ids` into cache row `row` in chunks of `chunks` tokens (or of the sizes it lists), as the
    engine feeds a prompt (runtime/batch/engine.py _prefill_chunk: each chunk unpadded, logits
    of its last min_rows positions); its last logits and its positions' K/V per layer."""
    P = max(model.min_rows, 1)
    sizes = chunks if isinstance(chunks, list) else [min(chunks, len(ids) - s) for s in range(0, len(ids), chunks)]
    last, s = None, 0
    for c in sizes:
        piece = ids[s:s + c]
        T = max(len(piece), P)
        toks = np.zeros((1, T), np.int64)
        toks[0, :len(piece)] = piece
        pos = (np.arange(P, dtype=np.int64) + max(len(piece) - P, 0))[None, :]
        last = model.step("prefill", toks, np.array([s], np.int64), row, pos, pad_start=0, kv_len=kv_len)[0, -1].copy()
        s += c
    return last, [a[row, :, :len(ids)].copy() for a in model.cache.keys + model.cache.values]
