"""Where a single stream's time goes, call by call: every ONNX Runtime call timed in process,
grouped by graph file and tokens a row, for one checkout of specrt (this one, or an older one
with --checkout, e.g. the one-request loop before issue 27 with --engine one-row).

    .venv/bin/python benchmarks/call_costs.py ENGINES [--checkout DIR] [--engine one-row]
        [--prompts 6] [--max-new-tokens 128]

Runs `SpeculativeGenerator(ENGINES).tokens(prompt, method="speculative")` on the first held-out
chat prompts, one after another, in a subprocess whose PYTHONPATH is the checkout, with the
backend's step method wrapped by a timer (the batched engine's `OrtBatchModel.step`; an older
checkout's one-row backend class, the one with `argmax_step`). Prints tokens, wall time, the
calls' share of it (the rest is the engine's Python), and per (graph file, T): calls, median
ms, total s. Run it for two checkouts one after the other and compare the per-call medians
(they are less sensitive to a shared machine's drift than tok/s). Not part of `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = r"""
import collections, json, sys, time
import numpy as np
engines, engine, n_prompts, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
calls = collections.defaultdict(list)
try:
    from specrt.runtime.backends import ort_batch
    inner = ort_batch.OrtBatchModel.step
    def step(self, graph, tokens, starts, *a, **k):
        t0 = time.perf_counter()
        out = inner(self, graph, tokens, starts, *a, **k)
        calls[(self._file_of[graph], int(tokens.shape[1]))].append(time.perf_counter() - t0)
        return out
    ort_batch.OrtBatchModel.step = step
except ImportError:
    pass
from specrt.runtime.backends import ort_cpu
for cls in [c for c in vars(ort_cpu).values() if isinstance(c, type) and hasattr(c, "argmax_step")]:
    def wrap(inner):
        def step(self, graph, tokens, start):
            t0 = time.perf_counter()
            out = inner(self, graph, tokens, start)
            calls[(f"{getattr(self, 'entry', None) and self.entry.role}/{graph}", self.graphs[graph].tokens)].append(
                time.perf_counter() - t0)
            return out
        return step
    cls.step = wrap(cls.step)
from specrt.calibration.dataset import load_prompts, split
from specrt.runtime import SpeculativeGenerator
gen = SpeculativeGenerator(engines, **({"engine": engine} if engine != "auto" else {}))
texts = [p.text for p in split(load_prompts())[1][:n_prompts]]
ids = [gen.encode_prompt(t, chat=True) for t in texts]
list(gen.tokens(ids[0], max_new_tokens=8, method="speculative"))     # warm up
calls.clear()
t0 = time.perf_counter()
n = sum(len(list(gen.tokens(x, max_new_tokens=max_new, method="speculative"))) for x in ids)
wall = time.perf_counter() - t0
rows = [{"graph": g, "T": T, "calls": len(v), "median_ms": float(np.median(v)) * 1e3, "total_s": float(sum(v))}
        for (g, T), v in calls.items()]
print(json.dumps({"tokens": n, "wall_s": wall, "rows": rows}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engines")
    ap.add_argument("--checkout", default=str(Path(__file__).resolve().parent.parent),
                    help="the specrt checkout to run (default: this one)")
    ap.add_argument("--engine", default="auto", help="SpeculativeGenerator's engine= (e.g. one-row)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args()
    checkout = Path(a.checkout).resolve()
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", WORKER, str(Path(a.engines).resolve()), a.engine, str(a.prompts),
                          str(a.max_new_tokens)], env=env, cwd=checkout, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    r = json.loads(out.stdout.strip().splitlines()[-1])
    in_calls = sum(x["total_s"] for x in r["rows"])
    print(f"{checkout} ({a.engine}): {r['tokens']} tokens in {r['wall_s']:.2f} s, {r['tokens'] / r['wall_s']:.1f} "
          f"tok/s; {sum(x['calls'] for x in r['rows'])} calls, {in_calls:.2f} s ({in_calls / r['wall_s']:.0%} of the "
          "time; the rest is the engine's Python)")
    print(f"  {'graph':<28} {'T':>4} {'calls':>6} {'median ms':>10} {'total s':>8}")
    for x in sorted(r["rows"], key=lambda x: -x["total_s"]):
        print(f"  {x['graph']:<28} {x['T']:>4} {x['calls']:>6} {x['median_ms']:>10.2f} {x['total_s']:>8.2f}")


if __name__ == "__main__":
    main()
