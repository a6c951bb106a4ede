"""Where a burst of requests spends its time in the batched engine, in process: N requests
submitted together (the held-out prompts of benchmarks/concurrency.py, each twice), each running
--new tokens through its EOS, on one engine of N rows; every model call timed by graph and rows x
tokens, beside the wall time.

    .venv/bin/python benchmarks/batch_time_split.py ENGINES [ENGINES ...] [--rows 24] [--new 128]
        [--prefill-budget 1024] [--rounds 1] [--prompt-tokens N]

Prints per folder: wall time and tok/s, prompt chunks (calls, seconds), decode/verify steps
(calls, seconds, the mean full-width step), what is left (the engine's Python), and the
heaviest call shapes. One run per folder, one after the other: compare folders in one
invocation on a quiet machine (2026-12-07: docs/benchmarks.md, "Where 24 long answers at once
spend their time"). Not part of `make test`.
"""
from __future__ import annotations

import argparse
import collections
import queue
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import concurrency  # noqa: E402  (the same prompts, chat-templated as the peers get them)

from specrt.runtime.backends.ort_batch import OrtBatchModel  # noqa: E402
from specrt.runtime.batch.generator import open_batch  # noqa: E402
from specrt.runtime.batch.request import Done, Failed  # noqa: E402


def split(folder: Path, rows: int, new: int, prompts: list[list[int]], budget: int | None = None) -> None:
    spent: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    real = OrtBatchModel.step

    def timed(self, graph, tokens, *a, **kw):
        t0 = time.perf_counter()
        try:
            return real(self, graph, tokens, *a, **kw)
        finally:
            key = (graph, tokens.shape[0], tokens.shape[1])
            spent[key] += time.perf_counter() - t0
            calls[key] += 1

    OrtBatchModel.step = timed
    try:
        gen = open_batch(folder, max_num_seqs=rows, threads=2, prefill_budget=budget)

        def run(reqs, n):
            done: queue.Queue = queue.Queue()
            for r in reqs:
                gen.submit(list(r), max_new_tokens=n, ignore_eos=True,
                           sink=lambda ev: done.put(ev) if isinstance(ev, (Done, Failed)) else None)
            for _ in reqs:
                if isinstance(done.get(), Failed):
                    raise SystemExit(f"{folder}: a request failed")

        run(prompts[:rows], 8)                                  # warm-up: sessions, buffers
        spent.clear()
        calls.clear()
        t0 = time.perf_counter()
        run(prompts, new)
        wall = time.perf_counter() - t0
        gen.close()
    finally:
        OrtBatchModel.step = real
    prompt = [k for k in spent if k[0] == "prefill"]
    steps = [k for k in spent if k[0] != "prefill"]
    full = [k for k in steps if k[1] == rows]
    wide = sum(calls[k] for k in prompt if k[1] > 1)
    model = sum(spent.values())
    print(f"{folder}: {len(prompts) * new} tokens in {wall:.2f} s = {len(prompts) * new / wall:.1f} tok/s")
    print(f"  prompt chunks {sum(calls[k] for k in prompt)} calls {sum(spent[k] for k in prompt):.2f} s; "
          f"({wide} of several requests); steps {sum(calls[k] for k in steps)} calls {sum(spent[k] for k in steps):.2f} s"
          + (f" ({rows}-row step {1000 * sum(spent[k] for k in full) / sum(calls[k] for k in full):.1f} ms)"
             if full else "") + f"; other {wall - model:.2f} s")
    for k, v in sorted(spent.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {k[0]:8s} {k[1]:3d} rows x {k[2]:3d} tokens: {calls[k]:4d} calls, {1000 * v / calls[k]:6.1f} ms each")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", type=Path, nargs="+")
    ap.add_argument("--rows", type=int, default=24, help="requests, all submitted together, on as many rows")
    ap.add_argument("--new", type=int, default=128, help="tokens each request generates (through its EOS)")
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="prompt tokens a step may prefill (as `specrt serve --prefill-budget`; default: one chunk)")
    ap.add_argument("--rounds", type=int, default=1, help="the folders in turn, this many times (interleaved)")
    ap.add_argument("--prompt-tokens", type=int, default=None,
                    help="keep the last N tokens of each prompt (short prompts: many requests' prompts in one call)")
    a = ap.parse_args(argv)
    ids, _, _ = concurrency.requests(argparse.Namespace(prompts=12, prompt_file=None))
    prompts = (ids * (a.rows // len(ids) + 1))[:a.rows]
    if a.prompt_tokens:
        prompts = [p[-a.prompt_tokens:] for p in prompts]
    for _ in range(a.rounds):
        for folder in a.engines:
            split(folder, a.rows, a.new, prompts, a.prefill_budget)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
