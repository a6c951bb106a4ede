"""The batched target (`specrt build --batch`): export, quantize as the target, and measure
whether a row's logits depend on the other rows of the call.

The batched engine (runtime/batch/) promises that a request's tokens do not depend on what
else is in the batch. That holds only if every kernel computes a row the same way whatever
the number of rows: this gate runs real prompts through the built graph one row per call
and then all rows in one call, and compares the logits bit for bit, step after step. It
also runs the rows' prefill and decode through the one-row target graphs and records how
often their greedy choices agree (the batched graph is a different ONNX graph: the same
arithmetic in exact terms, not always the same rounding).

    rows 0..n-1 prefilled one at a time (T = prefill chunk, one row per call)
    for each step:  logits of row r alone (n=1 at first_row=r)  vs  all rows (n rows)
                    -> equal bit for bit?  max |delta|

Speculation inside a batch needs one more property: a position's logits must not depend on
the window it is computed in (a plain step, a pair round, a verify pass of k+1), or a row's
tokens would change with the step kind the batch chose. `window_invariance` replays the
rows' greedy two-token steps as (k+1)-token windows, all rows in one call, and compares bit
for bit; the runtime speculates inside a batch only when it holds and gates/batch_costs.py measured each
(T, rows) step (manifest `build.speculation.batch_costs_ms`, what runtime/batch/policy.py
chooses from). ONNX Runtime's CPU GroupQueryAttention cannot run it (several tokens in
several rows are refused; its one- and several-token paths also round differently, SmolLM2
int4 ~0.3 in a logit), so `gqa` batches on the CPU run plain one-token steps.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np

from specrt.builder.gates.chunks import (chunk_invariance, fp32_agreement, prompt_invariance, prompt_rows_gate,
                                         refuse_prompt_graph)
from specrt.errors import ConfigError, ParityError

log = logging.getLogger(__name__)
STEPS = 8          # decode steps compared per row
MIN_TOKENS = 2     # tokens a row of every target pass of a batch that speculates (window_invariance)


def export(cfg, tgt, tmp: Path, target_part: dict, prompts) -> dict:
    """Export the batched target into tmp/batch (quantized as the target is), check it, and
    return its manifest part (role "batch")."""
    from specrt.calibration import quantize
    from specrt.export import onnx_export
    shapes = cfg.shapes
    rowwise = cfg.batch_prefill_graph in ("rowwise", "rowwise-gqa")
    attention = batch_attention(cfg, target_part)
    prefill_att = prefill_attention(cfg, attention)
    draft = draft_spec(cfg, attention)
    draft_attention = draft_graph_attention(cfg, attention, target_part) if draft is not None else None
    own = {**({"prefill": prefill_att} if prefill_att else {}), **({"draft": draft_attention} if draft_attention else {})}
    src = tmp / ("batch" if cfg.precision == "fp32" and not rowwise and draft is None else "_batch_fp32")
    part = onnx_export.export_model(tgt, shapes, src, attention=attention, batch="dynamic",
                                    tokens={"step": "dynamic", **({"prefill": "dynamic"} if prefill_att else {}),
                                            **({"draft": 1} if draft_attention else {})},
                                    hidden_layers=tuple(cfg.hidden_layers), graph_attention=own or None)
    agreement_fp32 = fp32_agreement(src, part, target_part, cache_length(attention, shapes), shapes, prompts) \
        if prefill_att else None
    if cfg.precision != "fp32" or rowwise or draft is not None:
        # "step" quantized as the target (fp32: as exported); with rowwise prefill, the same fp32
        # graph once more as "prefill", int8 per channel (rowwise-gqa: its own export, attending
        # with GroupQueryAttention); with an int8 self-draft, once more as
        # "draft", quantized as the one-row draft: all in one weights file
        specs = {"step": quantize.QuantSpec(**cfg.batch_quantization) if cfg.precision != "fp32" else None,
                 **({"prefill": quantize.QuantSpec("rowwise")} if rowwise else {}),
                 **({"draft": draft} if draft is not None else {})}
        q = quantize.quantize_graphs(src, part, tmp / "batch", tuple(specs), specs,
                                     source={g: g if g in part["graphs"] else "step" for g in specs})
        part = {**part, **{k: q[k] for k in ("graphs", "weights")}}
        if quantize.odd_rows_round_apart(cfg.batch_quantization):
            part["row_multiple"] = 2
        shutil.rmtree(src)
    source = {**target_part["source"], "derived": "the target with a batch dimension (export/batch.py)",
              "attention": attention}
    if cfg.batch_block_size is not None:     # quantized otherwise than the target: say how
        source["quantization"] = {**quantize.QuantSpec(**cfg.batch_quantization).describe(),
                                  "rows_per_call": "even (io row_multiple 2)" if part.get("row_multiple") else "any"}
    if rowwise:     # what `specrt inspect` shows of the second graph
        source["prefill_graph"] = {"runs": "prefill chunks (decode and verify steps run step)",
                                   **quantize.QuantSpec("rowwise").describe(), "attention": prefill_att or attention,
                                   **({"tokens": "one row a call (GroupQueryAttention); its cache is the step "
                                                 "graph's"} if prefill_att else {})}
    if draft is not None:
        source["draft_graph"] = {"runs": "the int8 self-draft's steps inside a batch (shared cache: the verify "
                                         "pass overwrites what it writes)", **draft.describe(),
                                 "attention": draft_attention or attention,
                                 **({"tokens": "one a row (GroupQueryAttention; what a draft proposes never changes "
                                               "a row's tokens, runtime/choice.py)"} if draft_attention else {})}
    part.update(subdir="batch", family=target_part["family"], precision=target_part["precision"], source=source,
                kv={**target_part["kv"], "update": part["kv_update"], **cache_length(attention, shapes)})
    inv = invariance(tmp, part, shapes, prompts)
    if not inv["equal"] and cfg.precision != "fp32" and not part.get("row_multiple"):
        inv = _never_one_row(tmp, part, shapes, prompts, inv)
    part["parity"] = {"batch_invariance": inv,
                      "window_invariance": window_invariance(tmp, part, shapes, prompts),
                      "greedy_agreement_with_target": agreement(tmp, part, target_part, shapes, prompts),
                      "chunk_invariance": chunk_invariance(tmp, part, shapes, prompts)}
    # (after the windows' record: its calls take the folder's min_tokens a row, as the engine's)
    part["parity"]["prompt_rows"] = prompt_rows_gate(tmp, part, shapes, prompts)
    if prefill_att:     # a prompt graph of its own attention: gated before anything else reads it
        part["parity"]["prompt_invariance"] = prompt_invariance(tmp, part, shapes, prompts)
        part["parity"]["prompt_agreement_fp32"] = agreement_fp32
    if draft is not None:
        part["parity"]["draft_agreement"] = draft_agreement(tmp, part, shapes, prompts)
    refuse_prompt_graph(part["parity"])
    inv = part["parity"]["batch_invariance"]
    if not inv["equal"]:
        cache = f"; reading the whole cache: {inv['kv_len']['max_abs_logit_delta']:.3g}" if "kv_len" in inv else ""
        raise ParityError(
            f"the batched {cfg.precision} {part['attention']} graph computes a row differently when other rows share "
            f"the call (max |delta logit| {inv['max_abs_logit_delta']:.3g} over {inv['rows']} rows x {inv['steps']} "
            f"steps{cache}): a request's tokens would depend on the batch. Build with --attention portable, "
            "without --batch-attention rows or --batch-block-size, or without --batch (one request per engine copy)")
    return part


def _never_one_row(tmp: Path, part: dict, shapes, prompts, first: dict) -> dict:
    """A row alone differed from the same row among others: on a CPU whose int8 kernels take
    another path for a single row (AVX2 without VNNI: ONNX Runtime's MatMulNBits with int8
    compute rounds one row ~2e-6 apart from the same row in a call of 2 or more, while any
    2+ agree), have every call run an even number of rows (io row_multiple 2: a lone row gets
    a padding row, runtime/backends/ort_batch.py) and measure again; the first result stays
    when that does not help."""
    part["row_multiple"] = 2
    again = invariance(tmp, part, shapes, prompts)
    if not again["equal"]:
        del part["row_multiple"]
        return first
    log.info("batch invariance holds with calls of an even number of rows (a row alone rounded apart by %.3g)",
             first["max_abs_logit_delta"])
    part["source"]["rows_per_call"] = ("even (io row_multiple 2): this CPU's int8 kernels round a row computed "
                                       "alone apart from the same row among others")
    return {**again, "one_row_alone": {"equal": False, "max_abs_logit_delta": first["max_abs_logit_delta"]}}


def cache_length(attention: str, shapes) -> dict:
    """What the manifest says of a batched model's cache length: a "rows" graph takes a cache of
    the positions its rows use (a symbolic length; the runtime grows it, at most the capacity
    built for: its rotary tables end there), the other variants the whole capacity."""
    if attention != "rows":
        return {}
    return {"layout": "[batch, kv_heads, kv_len, head_dim]", "capacity": shapes.kv_capacity,
            "length": "grows: the positions the rows use, in blocks of 64, at most kv_capacity"}


def batch_attention(cfg, target_part: dict) -> str:
    """The batched model's attention: --batch-attention, else the target's, except that a gqa
    target's batch attends with "rows": ONNX Runtime's CPU GroupQueryAttention cannot verify
    windows in several rows, so a gqa batch could not speculate, and every request (the single
    stream too, runtime/one.py) runs on the batched model."""
    if cfg.batch_attention is not None:
        return cfg.batch_attention
    attention = target_part.get("attention", cfg.attention)
    return "rows" if attention == "gqa" else attention


def prefill_attention(cfg, attention: str) -> str | None:
    """The attention of the batched model's "prefill" graph where it differs from the step
    graph's: "gqa" (GroupQueryAttention) for --batch-prefill rowwise-gqa beside a "rows" step
    graph. A prompt chunk is one row a call (runtime/batch/engine.py), which GroupQueryAttention
    runs fused; it writes the step graph's cache layout in place, reading each row's own length
    (grow_cache). None: the prefill graph (if any) is the step graph, quantized (a "gqa" batch
    already prefills with GroupQueryAttention). An "auto" choice stays rowwise where the batch
    attends otherwise; an explicit one there is a ConfigError."""
    if cfg.batch_prefill_graph != "rowwise-gqa" or attention == "gqa":
        return None
    if attention == "rows":
        return "gqa"
    if cfg.batch_prefill == "auto":
        return None
    raise ConfigError(f"--batch-prefill rowwise-gqa with a batched model attending with {attention!r}: its prompt "
                      "graph shares the cache of a 'rows' step graph; build with --batch-attention rows, or give "
                      "--batch-prefill rowwise")


def draft_spec(cfg, attention: str):
    """How the batched model's "draft" graph is quantized, or None when it gets none: the int8
    self-draft (--draft int8 / int8-dynamic, its whole vocabulary) inside a batch, which only a
    batch that verifies windows runs (not "gqa": ONNX Runtime's CPU GroupQueryAttention refuses
    several tokens in several rows, window_invariance)."""
    from specrt.calibration.int8 import SPECS
    if attention == "gqa" or cfg.draft_vocab is not None:
        return None
    return {"int8": SPECS["blockwise"], "int8-dynamic": SPECS["dynamic"]}.get(cfg.draft_kind)


def draft_graph_attention(cfg, attention: str, target_part: dict) -> str | None:
    """The attention of the batched int8 self-draft's graph when it differs from the step
    graph's: "gqa" beside a "rows" step graph whose target attends with GroupQueryAttention
    (ONNX Runtime). A draft step is one token a row, which GroupQueryAttention runs in several
    rows, fused (312 nodes after ONNX Runtime's optimizer against 871; the build timed a step
    at one row at x0.87 of the rows draft's, 2026-12-06), and its numbers need no invariance:
    the target verifies every guess, and a row's tokens are a function of the target's logits
    alone (runtime/choice.py). What it writes is checked (check_draft_keeps_the_cache). None:
    the draft graph is the step graph quantized."""
    # a quantized target's part does not repeat the attention it was exported with: cfg's
    return "gqa" if attention == "rows" and target_part.get("attention", cfg.attention) == "gqa" else None


def export_draft(cfg, dm, layers: int | None, tmp: Path, batch_part: dict, draft_part: dict, prompts) -> dict | None:
    """A separate draft model (`--draft PATH` or `--draft truncate:N`) with a batch dimension,
    for the batched engine: its own cache, one graph "step" with a symbolic T (prompt chunks,
    the catch-up of a row's last tokens, one-token steps). Exported as the one-row draft is
    (fp32, the same layers), into tmp/batch_draft; its manifest part (role "batch_draft"), or
    None when the batch cannot speculate (its target batch verifies no windows: a draft there
    would never run). What a draft proposes never changes a row's tokens (the target verifies
    every one, runtime/choice.py), so no invariance gate: the build measures its agreement with
    the batched target, the prior of its acceptance."""
    from specrt.export import onnx_export
    if not batch_part["parity"]["window_invariance"].get("equal"):
        return None
    attention = batch_part["attention"]
    part = onnx_export.export_model(dm, cfg.shapes, tmp / "batch_draft", layers=layers, attention=attention,
                                    batch="dynamic", tokens={"step": "dynamic"})
    what = draft_part["source"].get("derived", "a draft model")
    part.update(subdir="batch_draft", family=draft_part["family"], precision=draft_part["precision"],
                source={**draft_part["source"], "attention": attention,
                        "derived": f"the draft ({what}) with a batch dimension and its own cache (export/batch.py)"},
                kv={**draft_part["kv"], "update": part["kv_update"], **cache_length(attention, cfg.shapes)})
    part["parity"] = {"draft_agreement": own_draft_agreement(tmp, batch_part, part, cfg.shapes, prompts)}
    return part


def own_draft_agreement(tmp: Path, batch_part: dict, part: dict, shapes, prompts) -> dict:
    """Greedy top-1 agreement of a batched draft with its own cache and the batched target, all
    rows in one call, each step on the target's own greedy prefix (the draft is fed the
    target's token, as a row catches up after a round)."""
    from specrt.builder.manifest_writer import model_entry
    rows_ids = [list(p[:shapes.max_context - STEPS * 2 - 1]) for p in prompts]
    model = _model(tmp, batch_part, shapes, len(rows_ids))
    draft = _open(tmp, model_entry("batch_draft", part, "batch_draft"), shapes, len(rows_ids))
    cur = _prefill(model, rows_ids, shapes)
    _prefill(draft, rows_ids, shapes)
    return _agreement(model, draft, cur, rows_ids, "batched draft model")


def _agreement(model, draft, cur: list[int], rows_ids, what: str) -> dict:
    """STEPS * 2 greedy steps of all rows in one call from each row's first token `cur`: the
    draft's guess against the target's choice, the target's token fed to both."""
    lengths = np.array([len(r) for r in rows_ids], np.int64)
    same = total = 0
    for _ in range(STEPS * 2):
        toks = np.array(cur, np.int64)[:, None]
        guess = np.argmax(draft.step("decode", toks, lengths, 0)[:, 0], axis=-1)
        cur = [int(x) for x in np.argmax(model.step("decode", toks, lengths, 0)[:, 0], axis=-1)]
        same += int(np.sum(guess == np.array(cur)))
        total += len(cur)
        lengths = lengths + 1
    log.info("%s: top-1 agreement with the batched target %d / %d", what, same, total)
    return {"positions": total, "equal_argmax": same, "top1_agreement": round(same / total, 4)}


def _model(tmp: Path, part, shapes, rows: int, graphs=None, cache=None):
    """part: the build's dict, or a built folder's models.batch (`specrt retime`)."""
    from specrt.builder.manifest_writer import as_entry
    return _open(tmp, as_entry("batch", part, "batch"), shapes, rows, graphs, cache)


def _open(root: Path, entry, shapes, rows: int, graphs=None, cache=None):
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    if graphs is None:
        graphs = tuple(g for g in ("step", "prefill") if g in entry.graphs)
    return OrtBatchModel(root, entry, shapes, rows=rows, threads=2, graphs=graphs, cache=cache,
                         **({"serves": "draft", "min_rows": 1} if graphs == ("draft",) else {}))


def draft_model(tmp: Path, part: dict, shapes, target):
    """The batched "draft" graph over `target`'s cache (as runtime/batch/generator.open_batch loads it)."""
    return _model(tmp, part, shapes, target.rows, graphs=("draft",), cache=target.cache)


def _prefill(model, rows_ids, shapes, lasts: list | None = None, gather: bool = True) -> list[int]:
    """Prefill each row alone; returns each row's first greedy token (and appends its last
    logits to `lasts`). gather: as the engine, ask for the chunk's last position only
    (logit_pos); False: every position's logits, the last one picked here."""
    C, first = shapes.prefill_chunk, []
    for r, ids in enumerate(rows_ids):
        last = None
        for s in range(0, len(ids), C):
            chunk = ids[s:s + C]
            toks = np.zeros((1, C), np.int64)
            toks[0, :len(chunk)] = chunk
            if gather:
                pos = np.array([[len(chunk) - 1]], np.int64)
                last = model.step("prefill", toks, np.array([s], np.int64), r, pos)[0, 0].copy()
            else:
                last = model.step("prefill", toks, np.array([s], np.int64), r)[0, len(chunk) - 1].copy()
        first.append(int(np.argmax(last)))
        if lasts is not None:
            lasts.append(last)
    return first


def invariance(tmp: Path, part: dict, shapes, prompts) -> dict:
    """Rows alone vs together (all n, and an odd number of them), bit for bit, over STEPS
    greedy decode steps (T=1)."""
    rows_ids = [list(p[:shapes.max_context - STEPS - 1]) for p in prompts]
    n = len(rows_ids)
    alone, together = _model(tmp, part, shapes, n), _model(tmp, part, shapes, n)
    # an odd number of rows too (n - 1 when n is even): a kernel may round a call's odd last row
    # apart (models with io row_multiple 2 pad such calls with one row; this shows it holds)
    odd_n = n - 1 if n % 2 == 0 else n
    odd = _model(tmp, part, shapes, odd_n) if odd_n > 1 and odd_n != n else None
    every, last = [], []
    cur = _prefill(alone, rows_ids, shapes, every, gather=False)
    first = _prefill(together, rows_ids, shapes, last)
    if odd is not None:
        _prefill(odd, rows_ids[:odd_n], shapes)
    # the engine asks a prefill chunk for its last position only (logit_pos): is that what the
    # LM head over every position gives? (information: the engine always asks the same way)
    gather_delta = float(max(np.max(np.abs(a - b)) for a, b in zip(every, last)))
    log.info("prefill logits of the last position alone vs among the chunk's: max |delta| %.3g", gather_delta)
    if first != cur:
        log.warning("prefill: %d of %d rows' first greedy tokens differ between the last-position logits and "
                    "every position's", sum(a != b for a, b in zip(first, cur)), n)
    lengths = [len(r) for r in rows_ids]
    worst, equal = 0.0, True
    for _ in range(STEPS):
        starts = np.array(lengths, np.int64)
        toks = np.array(cur, np.int64)[:, None]
        # (a model that pads one-row calls writes its padding row into the next row from that
        # row's length on, which its own step then overwrites)
        a = np.stack([alone.step("step", toks[r:r + 1], starts[r:r + 1], r,
                                 pad_start=int(starts[r + 1]) if r + 1 < n else None)[0, 0].copy() for r in range(n)])
        b = together.step("step", toks, starts, 0)[:, 0].copy()
        equal &= bool(np.array_equal(a, b))
        worst = max(worst, float(np.max(np.abs(a - b))))
        if odd is not None:
            c = odd.step("step", toks[:odd_n], starts[:odd_n], 0)[:, 0]
            equal &= bool(np.array_equal(a[:odd_n], c))
            worst = max(worst, float(np.max(np.abs(a[:odd_n] - c))))
        cur = [int(x) for x in np.argmax(b, axis=-1)]
        lengths = [x + 1 for x in lengths]
    log.info("batch invariance: %d rows x %d steps, equal=%s, max |delta| %.3g", n, STEPS, equal, worst)
    out = {"rows": n, "steps": STEPS, "equal": equal, "max_abs_logit_delta": worst,
           "prefill_last_position_delta": gather_delta, "odd_rows": odd_n if odd is not None else None,
           "row_multiple": together.row_multiple}
    if together.grows or any(together.has_kv_pos.values()):
        # a "rows" graph reads L cache positions, L set by the batch's longest row (a cache of L
        # positions, or the first L of the whole cache in graphs built before 2026-12-06): the
        # same step once reading just what it needs and once the whole cache must agree bit for
        # bit (the same K/V are written both times)
        toks, starts = np.array(cur, np.int64)[:, None], np.array(lengths, np.int64)
        # the least it may read (the runtime rounds it up to KV_BLOCK): the step's own positions and
        # whatever the rows hold past them (a padded prompt chunk wrote past a row's length)
        L = max(int(starts.max()) + 1, int(together.cache.end.max()))
        short = together.step("step", toks, starts, 0, kv_len=L).copy()
        whole = together.step("step", toks, starts, 0, kv_len=shapes.kv_capacity).copy()
        delta = float(np.max(np.abs(short - whole)))
        # and a verify window (k + 1 tokens a row) at both lengths: a batch that speculates
        # reads windows over a cache whose length the other rows set
        W = shapes.k + 1
        if int(starts.max()) + W <= shapes.kv_capacity:
            win = np.repeat(toks, W, axis=1)
            Lw = max(int(starts.max()) + W, int(together.cache.end.max()))
            short_w = together.step("step", win, starts, 0, kv_len=Lw).copy()
            whole_w = together.step("step", win, starts, 0, kv_len=shapes.kv_capacity).copy()
            delta = max(delta, float(np.max(np.abs(short_w - whole_w))))
        log.info("kv_len invariance: reading %d vs %d cache positions (one token and %d-token windows), "
                 "max |delta| %.3g", L, shapes.kv_capacity, W, delta)
        out["kv_len"] = {"lengths": [L, shapes.kv_capacity], "window": W, "equal": delta == 0.0,
                         "max_abs_logit_delta": delta}
        out["equal"] = equal and delta == 0.0
    return out


def agreement(tmp: Path, part: dict, target_part: dict, shapes, prompts) -> dict:
    """Greedy choices of the batched graph (rows together) vs the one-row target graphs, on the
    same prefixes (teacher-forced on the one-row graphs' own greedy continuation)."""
    from specrt.driver import GraphSet, greedy
    g = GraphSet(tmp / target_part["subdir"], {k: target_part["graphs"][k] for k in ("prefill", "decode")},
                 target_part["dims"], shapes.kv_capacity)
    n_new = STEPS * 2
    ref = [greedy(g, list(p[:shapes.max_context - n_new - 1]), n_new).tokens for p in prompts]
    model = _model(tmp, part, shapes, len(prompts))
    rows_ids = [list(p[:shapes.max_context - n_new - 1]) for p in prompts]
    first = _prefill(model, rows_ids, shapes)
    same = sum(int(f == r[0]) for f, r in zip(first, ref))
    total = len(ref)
    lengths = [len(r) for r in rows_ids]
    for j in range(n_new - 1):
        toks = np.array([r[j] for r in ref], np.int64)[:, None]
        logits = model.step("step", toks, np.array(lengths, np.int64), 0)[:, 0]
        same += sum(int(np.argmax(logits[i]) == ref[i][j + 1]) for i in range(len(ref)))
        total += len(ref)
        lengths = [x + 1 for x in lengths]
    return {"positions": total, "equal_argmax": same, "rate": round(same / total, 4)}


def window_invariance(tmp: Path, part, shapes, prompts, min_tokens: int | None = None) -> dict:
    """Each row's greedy steps as m-token steps (the token and m - 1 padding tokens, all rows in
    one call) vs the same positions inside (m+1)- to (k+1)-token windows (teacher-forced on the
    m-token steps' tokens), bit for bit; m = 1, else MIN_TOKENS. ONNX Runtime's CPU MatMul takes
    another path for a single row of two computed inputs (attention's Q.K^T and P.V) and rounds
    differently there, while 2..k+1 rows agree: a graph whose attention MatMuls see one row per
    token (ONNX Attention, one query per head) holds only from two tokens a row, so a batch
    that speculates runs every target pass with `min_tokens` tokens a row (the runtime pads
    plain steps); the "rows" graphs group a kv head's G queries (G*T rows) and hold from one.
    min_tokens: measure that m only (`specrt retime`: the m a folder's runtime runs)."""
    model = _model(tmp, part, shapes, len(prompts))
    if model.multi_token_rows is not None:
        return {"equal": False, "reason": "GroupQueryAttention on the CPU runs several tokens per row only for one "
                                          "row, so a batch cannot verify windows"}
    rows_ids = [list(p[:shapes.max_context - STEPS - shapes.k - 2]) for p in prompts]
    n, W = len(rows_ids), shapes.k + 1
    worst = {}
    for m in (1, MIN_TOKENS) if min_tokens is None else (min_tokens,):
        model, win = _model(tmp, part, shapes, n), _model(tmp, part, shapes, n)
        cur = _prefill(model, rows_ids, shapes)
        _prefill(win, rows_ids, shapes)
        L = np.array([len(r) for r in rows_ids], np.int64)
        toks, ref = [list(cur)], []
        pad = np.zeros((n, m), np.int64)
        for j in range(STEPS):
            pad[:, 0] = toks[-1]
            logits = model.step("step", pad, L + j, 0)[:, 0].copy()
            ref.append(logits)
            toks.append([int(x) for x in np.argmax(logits, axis=-1)])
        seq = np.array(toks[:STEPS], np.int64).T          # [n, STEPS]: the token fed at each position
        ref = np.stack(ref, axis=1)                       # [n, STEPS, V]
        worst[m] = 0.0
        for size in range(max(m + 1, 2), W + 1):         # every verify window a step may run
            for s0 in range(0, STEPS - size + 1, size):
                got = win.step("step", seq[:, s0:s0 + size], L + s0, 0)[:, :size].copy()
                worst[m] = max(worst[m], float(np.max(np.abs(got - ref[:, s0:s0 + size]))))
        log.info("window invariance: %d rows x %d positions, %d-token steps vs windows of up to %d, max |delta| %.3g",
                 n, STEPS, m, W, worst[m])
        if worst[m] == 0.0:
            break
    m = min(worst, key=lambda t: (worst[t] != 0.0, t))
    return {"rows": n, "positions": STEPS, "window": W, "min_tokens": m, "equal": worst[m] == 0.0,
            "max_abs_logit_delta": worst[m], "delta_by_min_tokens": {str(t): d for t, d in worst.items()}}


def draft_agreement(tmp: Path, part: dict, shapes, prompts) -> dict:
    """Greedy top-1 agreement of the batched draft with the batched target (all rows in one
    call), each step on the target's own greedy prefix: what acceptance inside a batch follows.
    The draft writes its guess's K/V into the shared cache; the target's step then overwrites
    it, as the verify pass does."""
    rows_ids = [list(p[:shapes.max_context - STEPS * 2 - 1]) for p in prompts]
    model = _model(tmp, part, shapes, len(rows_ids))
    draft = draft_model(tmp, part, shapes, model)
    cur = _prefill(model, rows_ids, shapes)
    check_draft_keeps_the_cache(model, draft, cur, rows_ids)
    return _agreement(model, draft, cur, rows_ids, "batched draft")


def check_draft_keeps_the_cache(model, draft, cur: list[int], rows_ids) -> None:
    """A draft over the target's cache may write only at each row's length (the verify pass
    writes the target's own K/V there before anything reads it): one draft step over every row
    must leave each row's positions 0..length-1 as they were, bit for bit. Its logits can never
    change a row's tokens (runtime/choice.py), its writes could: a kernel that wrote elsewhere
    (another ONNX Runtime, another attention) would change the target's answers silently, so
    the build refuses it (ParityError)."""
    lengths = np.array([len(r) for r in rows_ids], np.int64)
    n = len(rows_ids)
    before = [[a[i, :, :lengths[i]].copy() for i in range(n)] for a in model.cache.keys + model.cache.values]
    draft.step("decode", np.array(cur, np.int64)[:, None], lengths, 0)
    after = model.cache.keys + model.cache.values
    for layer, (was, now) in enumerate(zip(before, after)):
        for i in range(n):
            if not np.array_equal(was[i], now[i, :, :lengths[i]], equal_nan=True):
                raise ParityError(
                    f"one step of the batched draft graph changed cache array {layer} of row {i} before the row's "
                    f"length ({lengths[i]}): it would change the target's answers. Build without the draft inside "
                    "the batch (--draft none), or with the onnxruntime this specrt was tested with")
