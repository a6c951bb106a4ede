"""A vocabulary-trimmed draft LM head: the draft scores only N of the V tokens.

The LM head is [C, V] (SmolLM2: 576 x 49152, ~1/5 of the draft's weights); keeping N
columns shrinks the draft step. Lossless: the target verifies every token, and a token
the draft cannot propose is still emitted through the target (greedy: the recovered
argmax; sampling: the residual norm(max(0, p - q)) with q = 0 there). What it costs is
acceptance: a target token outside the kept set is never drafted, so acceptance drops by
about the coverage loss (`coverage`, measured on held-out text).

Kept ids (`choose_ids`): the special ids (EOS, BOS, chat markers) always; then every id
seen in calibration text, most frequent first (the calibration prompts, chat template
applied, and the fp32 target's greedy generations on them, run through the runtime's
ONNX Runtime backend on the just-exported graphs); then the lowest ids not yet taken (a
BPE id is its merge rank, which follows corpus frequency). Counts are fixed numbers of
prompts and tokens (not a timer), so the same build picks the same ids.

The draft's interface stays [1, T, V] logits (`trim_lm_head`); the runtime does not know.
The fill is -inf: `runtime.sampling.probs_from_logits` maps it to probability 0 on every
path (greedy argmax; exp(-inf - max) = 0 under any temperature, then top-k / top-p only
zero more entries), with no overflow warning, which the dtype's lowest finite value
divided by a temperature < 1 would raise.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specrt import manifest as mf
from specrt.driver import GraphSet, encode_prompts, greedy

FILL = float("-inf")
CALIB_PROMPTS = 24        # calibration prompts generated from (all of them are also counted as text)
EVAL_PROMPTS = 12         # held-out prompts the coverage is measured on
NEW_TOKENS = 48           # greedy tokens per prompt (fewer when the context is short)
SECONDS = 240.0           # a guard, not the budget: stop generating after this (recorded)
HOW = ("special ids; then ids seen in the calibration prompts and in the fp32 target's greedy generations on "
       "them, most frequent first; then the lowest remaining ids (BPE merge rank)")


def choose_ids(counts: np.ndarray, n: int, always: Iterable[int]) -> np.ndarray:
    """counts: [V] occurrences in calibration text -> the n kept ids, sorted, int64 [n]:
    `always` first, then by count (ties: lower id), then the lowest ids."""
    v = counts.size
    if not 0 < n <= v:
        raise ValueError(f"n={n} kept tokens must lie in [1, {v}]")
    order = np.lexsort((np.arange(v), -counts))        # count descending, then id ascending
    ranked = [*always, *order[counts[order] > 0].tolist(), *range(v)]
    kept = list(dict.fromkeys(int(i) for i in ranked))[:n]
    return np.array(sorted(kept), np.int64)


def trim_lm_head(model: onnx.ModelProto, ids: np.ndarray) -> onnx.ModelProto:
    """Make the graph's LM head score only `ids` and scatter the result back to [1, T, V].
    `model` must hold its weights (loaded with external data); it is edited and returned.

        h [1,T,C] --MatMul(W[:, ids] : [C,N])--> logits_kept [1,T,N] ------------.
        ConstantOfShape([1,T,V], -inf) --> fill [1,T,V] --.                      |
        kept_ids [1,T,N] (constant) -----------------------+--> ScatterElements(axis=2)
                                                                      |
                                                              logits [1,T,V]: logits_kept at
                                                              ids, -inf everywhere else
    """
    g = model.graph
    name = mf.IO_NAMES["logits"]
    head = [n for n in g.node if n.op_type == "MatMul" and name in n.output]
    inits = {i.name: i for i in g.initializer}
    if len(head) != 1 or head[0].input[1] not in inits:
        raise ValueError(f"no MatMul with a constant weight writes {name!r}: not an exported LM graph")
    head = head[0]
    w = numpy_helper.to_array(inits[head.input[1]])                    # [C, V]
    out = next(o for o in g.output if o.name == name)
    dims = [d.dim_value for d in out.type.tensor_type.shape.dim]       # [1, T, V], static
    if len(dims) != 3 or dims[2] != w.shape[1] or not all(dims):
        raise ValueError(f"{name} has shape {dims}; expected a static [1, T, {w.shape[1]}]")
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 1 or not ids.size or ids.min() < 0 or ids.max() >= w.shape[1] or np.unique(ids).size != ids.size:
        raise ValueError(f"kept ids must be distinct and in [0, {w.shape[1]})")
    t, n = dims[1], ids.size
    g.initializer.extend([
        numpy_helper.from_array(np.ascontiguousarray(w[:, ids]), "lm_head_kept"),                   # [C, N]
        numpy_helper.from_array(np.ascontiguousarray(np.broadcast_to(ids, (1, t, n))), "lm_head_kept_ids"),
        numpy_helper.from_array(np.array(dims, np.int64), "logits_shape")])
    head.input[1], head.output[0] = "lm_head_kept", "logits_kept"
    g.node.extend([
        helper.make_node("ConstantOfShape", ["logits_shape"], ["logits_fill"], name="vocab_fill",
                         value=numpy_helper.from_array(np.array([FILL], np.float32))),
        helper.make_node("ScatterElements", ["logits_fill", "lm_head_kept_ids", "logits_kept"], [name],
                         name="vocab_scatter", axis=2)])
    _drop_unused(g)   # the full [C, V] table stays only if something else reads it (a tied embedding)
    return model


def kept_ids(model: onnx.ModelProto) -> np.ndarray | None:
    """The ids a trimmed graph scores (int64 [N]), or None for a full LM head."""
    for i in model.graph.initializer:
        if i.name == "lm_head_kept_ids":
            return numpy_helper.to_array(i).reshape(-1, i.dims[-1])[0].copy()
    return None


def _drop_unused(g: onnx.GraphProto) -> None:
    used = {x for n in g.node for x in n.input}
    keep = [i for i in g.initializer if i.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)


def greedy_texts(model_dir: Path, export: dict, shapes: mf.Shapes, prompts: list[list[int]], eos: set[int],
                 deadline: float) -> tuple[list[list[int]], bool]:
    """The exported model's greedy continuation of each prompt (prefill + decode graphs,
    through the runtime's backend); (generations, cut short by the deadline)."""
    gs = GraphSet(model_dir, {g: export["graphs"][g] for g in ("prefill", "decode")}, export["dims"],
                  shapes.kv_capacity)
    new = min(NEW_TOKENS, shapes.max_context // 2)
    outs = []
    for ids in prompts:
        if time.monotonic() > deadline:
            return outs, True
        ids = ids[-(shapes.max_context - new):]       # the tail: the generation prompt stays
        outs.append(greedy(gs, ids, new, eos=eos).tokens)
    return outs, False


def plan(fp32_dir: Path, fp32: dict, shapes: mf.Shapes, tokenizer, n: int, special: Iterable[int],
         eos: Iterable[int]) -> tuple[np.ndarray, dict]:
    """The n kept ids for this model and what the manifest records about them (coverage of
    the fp32 target's greedy generations on held-out prompts, never seen in the choice).
    tokenizer: the runtime's, over the build's tokenizer.json (driver.encode_prompts)."""
    from specrt.calibration import dataset
    vocab = int(fp32["dims"]["vocab"])
    calib, held = dataset.split(dataset.load_prompts())
    calib_ids = encode_prompts(tokenizer, [p.text for p in calib])
    eval_ids = encode_prompts(tokenizer, [p.text for p in held[:EVAL_PROMPTS]])
    t0 = time.monotonic()
    deadline = t0 + SECONDS
    gens, cut = greedy_texts(fp32_dir, fp32, shapes, calib_ids[:CALIB_PROMPTS], set(eos), deadline)
    counts = np.zeros(vocab, np.int64)
    for seq in (*calib_ids, *gens):
        np.add.at(counts, np.asarray(seq, np.int64), 1)
    ids = choose_ids(counts, n, special)
    held_gens, cut_held = greedy_texts(fp32_dir, fp32, shapes, eval_ids, set(eos), deadline)
    report = {"kept": n, "of": vocab, "fill": "-inf", "chosen_by": HOW,
              "calibration": {"prompts": len(calib_ids), "generated_from": len(gens),
                              "prompt_tokens": sum(map(len, calib_ids)), "generated_tokens": sum(map(len, gens)),
                              "distinct_ids_seen": int((counts > 0).sum())},
              "held_out_coverage": coverage(ids, held_gens),
              "held_out": {"prompts": len(held_gens), "generated_tokens": sum(map(len, held_gens)),
                           "text": "the fp32 target's greedy generations on held-out prompts (dataset.split)"},
              "seconds": round(time.monotonic() - t0, 1), "cut_short_by_time_guard": cut or cut_held,
              "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest()}
    return ids, report


def coverage(ids: np.ndarray, texts: Iterable[Sequence[int]]) -> float | None:
    """Share of the tokens of `texts` that lie in the kept set (None without tokens)."""
    toks = np.fromiter((t for s in texts for t in s), np.int64)
    return round(float(np.isin(toks, ids).mean()), 4) if toks.size else None


def draftable_agreement(target_dir: Path, target: dict, draft_dir: Path, draft: dict, shapes: mf.Shapes,
                        token_lists: list[list[int]], ids: np.ndarray) -> dict:
    """Top-1 agreement of a trimmed shared-cache draft with the target at the positions
    whose target choice lies in the kept set: the quantization's own error, which the
    build's gate checks (the other positions are the coverage loss, recorded apart);
    the largest logit difference over the kept ids (elsewhere the draft's logits are -inf).
    The regime of measure.draft_agreement: the draft reads the target's cache."""
    kept = np.zeros(int(target["dims"]["vocab"]), bool)
    kept[ids] = True
    agree = total = positions = 0
    max_delta = 0.0
    for seq in token_lists:
        seq = seq[: shapes.prefill_chunk]
        t = GraphSet(target_dir, {"prefill": target["graphs"]["prefill"]}, target["dims"], shapes.kv_capacity)
        logits = t.step("prefill", seq, 0)                                  # [n, V]
        ref = logits.argmax(-1)                                             # [n]
        d = GraphSet(draft_dir, {"decode": draft["graphs"]["decode"]}, draft["dims"], shapes.kv_capacity)
        for c, tc in zip(d.cache, t.cache):
            c[...] = tc
        for i in range(len(seq)):
            row = d.step("decode", seq[i:i + 1], i)[0]                     # [V], -inf off the kept ids
            got = int(row.argmax())
            max_delta = max(max_delta, float(np.abs(row[ids] - logits[i, ids]).max()))
            for c, tc in zip(d.cache, t.cache):                            # undo the draft's own row i
                c[:, :, i] = tc[:, :, i]
            positions += 1
            if kept[ref[i]]:
                total += 1
                agree += int(got == ref[i])
    return {"top1_agreement": agree / total if total else 0.0, "positions": total, "of_positions": positions,
            "max_abs_logit_delta": max_delta}
