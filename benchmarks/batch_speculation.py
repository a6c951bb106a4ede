"""Does speculation inside a batch pay, and does it keep every answer? In one interleaved run,
for each row count (each system given all prompts at once via generate_batch, chat-templated,
greedy), on one engine folder built with `--batch` and an attention whose batches verify
windows (`--batch-attention rows`), optionally beside a `gqa` batched folder:

    stream       today's single stream: SpeculativeGenerator on the folder's one-row graphs,
                 one request after another (its own speculation: the int8 draft, adaptive k)
    one          what SpeculativeGenerator(folder) runs there: the batched engine as a batch
                 of one, stepped from the caller's thread (runtime/one.py), one request after another
    batch        open_batch: the policy picks plain, pair, lookup or draft rounds per step
                 from the build's batch_costs_ms (the int8 draft inside the batch)
    batch-table  the same, pricing with the build's table alone (not corrected by the loop's
                 timings: live_costs.py, SPECRT_LIVE_COSTS=0)
    batch-nodraft  the same without the draft (pair and lookup rounds only)
    batch-plain  speculate=False: plain one-token steps
    gqa          --gqa FOLDER's batched graph, plain one-token steps (the default `--batch`)

    .venv/bin/python benchmarks/batch_speculation.py ENGINES [--gqa F] [--rows 1,4,8] [--prompts 12]
        [--max-new-tokens 128] [--rounds 2] [--systems stream,batch,...]

Systems run one after another within a round, their order rotated each round, so drift on a
shared machine hits them alike; tok/s is the median over rounds. Prints each system's tok/s,
the ratios to batch-plain and stream, the step kinds chosen, and how many answers equal
batch-plain's (speculation must not change a token) and the stream's (one answer per engine
folder: the one-row graphs and the batched graph are different ONNX graphs). Not part of `make test`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from common import eval_prompts  # noqa: E402

from specrt.runtime.batch.generator import open_batch  # noqa: E402

SYSTEMS = ("stream", "one", "batch", "batch-table", "batch-nodraft", "batch-plain", "gqa")


class One:
    """What `SpeculativeGenerator(folder)` runs on a `--batch` folder: the batched engine as a
    batch of one, stepped from this thread (runtime/one.py), one request after another."""

    def __init__(self, engines):
        from specrt.runtime.generator import SpeculativeGenerator
        self.gen = SpeculativeGenerator(engines)
        if self.gen.target is not None:
            raise SystemExit(f"{engines}: SpeculativeGenerator runs its one-row graphs here (no batched model): "
                             "give a folder built with --batch")
        self.engine = self.gen.one.engine

    def generate_batch(self, texts, **kw):
        return [self.gen.generate(t, **kw) for t in texts]

    def close(self):
        pass


class Stream:
    """SpeculativeGenerator with the batched generator's generate_batch, one prompt at a time."""

    def __init__(self, engines):
        from specrt.runtime.generator import SpeculativeGenerator
        self.gen = SpeculativeGenerator(engines, engine="one-row")

    def generate_batch(self, texts, **kw):
        return [self.gen.generate(t, **kw) for t in texts]

    def close(self):
        pass


def _open(name: str, engines: str, gqa: str | None, rows: int):
    if name == "stream":
        return Stream(engines)
    if name == "one":
        return One(engines)
    if name == "gqa":
        return open_batch(gqa, max_num_seqs=rows, speculate=False)
    g = open_batch(engines, max_num_seqs=rows, speculate=name != "batch-plain")
    if name == "batch-nodraft":
        g.engine.policy.has_draft, g.engine.draft = False, None
    if name == "batch-table":
        g.engine.live_costs = False
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines")
    ap.add_argument("--gqa", default=None, help="a --batch folder with gqa attention (plain steps)")
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--systems", default=None, help=f"comma-separated, of {','.join(SYSTEMS)}")
    a = ap.parse_args(argv)
    names = a.systems.split(",") if a.systems else [s for s in SYSTEMS if s != "gqa" or a.gqa]
    texts = [p.text for p in eval_prompts(a.prompts, None)]
    kw = dict(max_new_tokens=a.max_new_tokens, chat=True)
    for rows in [int(r) for r in a.rows.split(",")]:
        systems = {n: _open(n, a.engines, a.gqa, rows) for n in names if n not in ("stream", "one") or rows == 1}
        for g in systems.values():
            g.generate_batch(texts[:1], max_new_tokens=8, chat=True)           # warm-up
        rates: dict[str, list[float]] = {n: [] for n in systems}
        answers, choices = {}, {}
        for r in range(a.rounds):
            order = list(systems)[r % len(systems):] + list(systems)[:r % len(systems)]
            for name in order:
                g = systems[name]
                eng = getattr(g, "engine", None)
                before = dict(eng.stats.choices) if eng is not None else {}
                t0 = time.perf_counter()
                outs = g.generate_batch(texts, **kw)
                dt = time.perf_counter() - t0
                n = sum(len(o.tokens) for o in outs)
                rates[name].append(n / dt)
                answers[name] = [o.tokens for o in outs]
                if eng is not None:
                    choices[name] = {k: v - before.get(k, 0) for k, v in eng.stats.choices.items()}
                print(f"rows {rows:>2} round {r}  {name:<14} {n / dt:7.1f} tok/s  ({n} tokens, {dt:.1f} s)  "
                      f"steps {choices.get(name, '-')}", flush=True)
        for g in systems.values():
            g.close()
        med = {n: statistics.median(v) for n, v in rates.items()}
        for name in systems:
            ratios = "  ".join(f"/ {b} x{med[name] / med[b]:.3f}" for b in ("batch-plain", "stream", "gqa")
                               if b in med and b != name)
            same = "  ".join(f"= {b} {sum(x == y for x, y in zip(answers[name], answers[b]))}/{len(texts)}"
                             for b in ("batch-plain", "stream") if b in answers and b != name)
            print(f"rows {rows:>2}  {name:<14} {med[name]:7.1f} tok/s  {ratios}   answers {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
