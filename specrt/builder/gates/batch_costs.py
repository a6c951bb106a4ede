"""What one step of the batched model costs, per (T, rows): the build's measurement
(`build.speculation.batch_costs_ms`) and `specrt retime`'s on a built folder, which
runtime/batch/policy.BatchCosts chooses step kinds from. Timings, not gates: the invariance
gates are gates/batch.py's."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt.builder.gates.batch import _open


def costs(tmp: Path, part: dict, shapes, *, rows: int = 8, context: int = 128, runs: int = 7,
          warmup: int = 2, draft_part: dict | None = None) -> dict:
    """Median ms of one batched step per (T, rows) at `context` tokens of cache, timed
    interleaved: T = 1, 2 and k+1; rows 1, 2, 4, 8 (several tokens in several rows only where
    the kernels run them); and one draft step a row (the "draft" graph, or the batched draft
    model draft_part). runtime/batch/policy.BatchCosts reads it."""
    from specrt.builder.manifest_writer import model_entry
    own = model_entry("batch_draft", draft_part, "batch_draft") if draft_part is not None else None
    return entry_costs(tmp, model_entry("batch", part, "batch"), shapes, rows=rows, context=context, runs=runs,
                       warmup=warmup, draft_entry=own)


def entry_costs(root: Path, entry, shapes, *, rows: int = 8, context: int = 128, runs: int = 7,
                warmup: int = 2, draft_entry=None) -> dict:
    """`costs` of a batched model described by its manifest entry (files relative to `root`):
    the build's measurement, and `specrt retime`'s on a built folder (tools/retime.py).
    draft_entry: a batched draft model with its own cache (models.batch_draft)."""
    from specrt.builder.gates.plan import interleaved_ms
    model = _open(root, entry, shapes, rows)
    context = min(context, shapes.max_context - shapes.k - 1)
    ns = [n for n in (1, 2, 4, 8, 16) if n <= rows]
    cases = [(T, n) for T in sorted({1, 2, shapes.k + 1}) for n in ns
             if T == 1 or model.multi_token_rows is None or n <= model.multi_token_rows]

    def step(T: int, n: int):
        toks, starts = np.ones((n, T), np.int64), np.full(n, context, np.int64)
        # (a model that pads odd calls writes a padding row into the free row after them)
        return lambda: model.step("step", toks, starts, 0, pad_start=context)

    calls = {c: step(*c) for c in cases}
    draft = _open(root, entry, shapes, model.rows, ("draft",), model.cache) if "draft" in entry.graphs else \
        _open(root, draft_entry, shapes, model.rows) if draft_entry is not None else None
    if draft is not None:       # one draft step (one token a row) at each row count
        for n in ns:
            toks, starts = np.ones((n, 1), np.int64), np.full(n, context, np.int64)
            calls["draft", n] = (lambda t, s: lambda: draft.step("decode", t, s, 0, pad_start=context))(toks, starts)
    ms = interleaved_ms(calls, runs=runs, warmup=warmup)
    target: dict[str, dict[str, float]] = {}
    drafted: dict[str, float] = {}
    for (T, n), v in ms.items():
        if T == "draft":
            drafted[str(n)] = v
        else:
            target.setdefault(str(T), {})[str(n)] = v
    return {"target": target, **({"draft": drafted} if drafted else {}), "context": context, "runs": runs}
