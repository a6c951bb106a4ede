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
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np

from specrt.errors import ParityError

log = logging.getLogger(__name__)
STEPS = 8          # decode steps compared per row


def export(cfg, tgt, tmp: Path, target_part: dict, prompts) -> dict:
    """Export the batched target into tmp/batch (quantized as the target is), check it, and
    return its manifest part (role "batch")."""
    from specrt.calibration import quantize
    from specrt.export import onnx_export
    shapes = cfg.shapes
    src = tmp / ("batch" if cfg.precision == "fp32" else "_batch_fp32")
    part = onnx_export.export_model(tgt, shapes, src, attention=target_part.get("attention", cfg.attention),
                                    batch="dynamic", tokens={"step": "dynamic"})
    if cfg.precision != "fp32":
        spec = quantize.QuantSpec(**cfg.target_quantization)
        q = quantize.quantize_graphs(src, part, tmp / "batch", ("step",), spec)
        q.pop("quantization", None)
        part = {**part, **{k: q[k] for k in ("graphs", "weights")}}
        shutil.rmtree(src)
    part.update(subdir="batch", family=target_part["family"], precision=target_part["precision"],
                source={**target_part["source"], "derived": "the target with a batch dimension (export/batch.py)"},
                kv=target_part["kv"])
    part["parity"] = {"batch_invariance": invariance(tmp, part, shapes, prompts),
                      "greedy_agreement_with_target": agreement(tmp, part, target_part, shapes, prompts)}
    inv = part["parity"]["batch_invariance"]
    if not inv["equal"]:
        raise ParityError(
            f"the batched {cfg.precision} {part['attention']} graph computes a row differently when other rows share "
            f"the call (max |delta logit| {inv['max_abs_logit_delta']:.3g} over {inv['rows']} rows x {inv['steps']} "
            "steps): a request's tokens would depend on the batch. Build with --attention portable, or without "
            "--batch (one request per engine copy)")
    return part


def _model(tmp: Path, part: dict, shapes, rows: int):
    from specrt.build.manifest_writer import model_entry
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    return OrtBatchModel(tmp, model_entry("batch", part, "batch"), shapes, rows=rows, threads=2)


def _prefill(model, rows_ids, shapes) -> list[int]:
    """Prefill each row alone; returns each row's first greedy token."""
    C, first = shapes.prefill_chunk, []
    for r, ids in enumerate(rows_ids):
        last = None
        for s in range(0, len(ids), C):
            chunk = ids[s:s + C]
            toks = np.zeros((1, C), np.int64)
            toks[0, :len(chunk)] = chunk
            last = model.step("step", toks, np.array([s], np.int64), r)[0, len(chunk) - 1].copy()
        first.append(int(np.argmax(last)))
    return first


def invariance(tmp: Path, part: dict, shapes, prompts) -> dict:
    """Rows alone vs together, bit for bit, over STEPS greedy decode steps (T=1)."""
    rows_ids = [list(p[:shapes.max_context - STEPS - 1]) for p in prompts]
    n = len(rows_ids)
    alone, together = _model(tmp, part, shapes, n), _model(tmp, part, shapes, n)
    cur = _prefill(alone, rows_ids, shapes)
    assert cur == _prefill(together, rows_ids, shapes)
    lengths = [len(r) for r in rows_ids]
    worst, equal = 0.0, True
    for _ in range(STEPS):
        starts = np.array(lengths, np.int64)
        toks = np.array(cur, np.int64)[:, None]
        a = np.stack([alone.step("step", toks[r:r + 1], starts[r:r + 1], r)[0, 0].copy() for r in range(n)])
        b = together.step("step", toks, starts, 0)[:, 0].copy()
        equal &= bool(np.array_equal(a, b))
        worst = max(worst, float(np.max(np.abs(a - b))))
        cur = [int(x) for x in np.argmax(b, axis=-1)]
        lengths = [x + 1 for x in lengths]
    log.info("batch invariance: %d rows x %d steps, equal=%s, max |delta| %.3g", n, STEPS, equal, worst)
    return {"rows": n, "steps": STEPS, "equal": equal, "max_abs_logit_delta": worst}


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
