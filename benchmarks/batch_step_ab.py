"""Two engine folders' batched step graphs, one step at a time, calls interleaved in one process:
the time of one `OrtBatchModel.step` of R rows x T tokens at a context of C positions.

    .venv/bin/python benchmarks/batch_step_ab.py A_ENGINES B_ENGINES [--rounds 16] [--shapes 24x1x150,8x1x900]

Each model gets its own cache of 24 rows; before each shape every row is prefilled to C
positions (chunks of 64), then the two models' steps alternate A-B / B-A; the first two rounds
are dropped; medians in ms and B/A. The rows' tokens are all the same: the time of a step does
not depend on them. Built to compare a folder built before and after a graph change (2026-12-06:
a cache of the positions the rows use instead of a copy of each row's prefix). Not part of
`make test`.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from specrt.manifest import load
from specrt.runtime.backends.ort_batch import OrtBatchModel

SHAPES = ((8, 1, 150), (8, 2, 150), (24, 1, 150), (24, 1, 600), (8, 5, 300), (1, 1, 150))     # rows, T, context


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                    help="ROWSxTxCONTEXT,... (one token a row for GroupQueryAttention folders: they refuse several "
                         "rows of several tokens)")
    a = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    models = {}
    for name, folder in (("A", a.a), ("B", a.b)):
        man = load(folder)
        models[name] = OrtBatchModel(folder, man.models["batch"], man.shapes, rows=24, threads=2, graphs=("step",))
    print(f"A {a.a}, B {a.b}: median ms of one step, {a.rounds} interleaved rounds")
    for rows, T, ctx in shapes:
        for m in models.values():
            m.cache.forget(0)
            for r in range(rows):
                for s in range(0, ctx, 64):
                    n = min(64, ctx - s)
                    m.step("step", np.ones((1, n), np.int64), np.array([s]), r, np.array([[n - 1]]))
        toks, starts = np.ones((rows, T), np.int64), np.full(rows, ctx, np.int64)
        times = {k: [] for k in models}
        for i in range(a.rounds):
            for k in ("AB" if i % 2 else "BA"):
                t0 = time.perf_counter()
                models[k].step("step", toks, starts, 0)
                times[k].append(time.perf_counter() - t0)
        ma, mb = (statistics.median(times[k][2:]) * 1e3 for k in "AB")
        print(f"  {rows:2d} rows x {T} at {ctx:3d} positions: A {ma:6.2f}  B {mb:6.2f}  B/A x{mb / ma:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
