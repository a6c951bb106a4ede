"""A trained draft head against the engine without it, interleaved in one run, single stream.

    python benchmarks/head_bench.py ENGINES HEAD [--baseline ENGINES_WITHOUT_HIDDEN] [--prompts 12]
                                    [--max-new-tokens 128] [--rows 1] [--temperature 0]

ENGINES: a folder built with `specrt build --batch --hidden-layers ...`; HEAD: a folder from
`specrt train-draft`. Systems, each in one open engine (load time excluded), prompt by prompt in
rotating order so drift on a shared machine hits all: "plain" (plain steps only), "default" (the
folder's own policy: the int8 self-draft where it pays, prompt lookup, pair rounds), "head"
(the policy with the trained head as its draft), and with --baseline the same "default" on a
folder built without hidden states (what the extra output costs). Prints decode tok/s (after
the first token), each system's ratio to plain, tokens per target pass, and whether every
system's tokens equal plain's (they must: the target verifies every guess). The 12 held-out
prompts (never trained on) through the chat template.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from specrt.calibration.dataset import load_prompts, split
from specrt.runtime import SamplingParams, open_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engines")
    ap.add_argument("head")
    ap.add_argument("--baseline")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rows", type=int, default=1, help="max_num_seqs (1: the single stream)")
    ap.add_argument("--temperature", type=float, default=0.0)
    a = ap.parse_args()
    prompts = [p.text for p in split(load_prompts())[1][:a.prompts]]
    systems = {"plain": open_batch(a.engines, max_num_seqs=a.rows, speculate=False),
               "default": open_batch(a.engines, max_num_seqs=a.rows),
               "head": open_batch(a.engines, max_num_seqs=a.rows, head=a.head)}
    if a.baseline:
        systems["baseline default"] = open_batch(a.baseline, max_num_seqs=a.rows)
    names = list(systems)
    secs = {n: 0.0 for n in names}
    toks = {n: 0 for n in names}
    passes = {n: [0, 0] for n in names}           # target passes after the first token, tokens they emitted
    same = {n: True for n in names}
    for i, p in enumerate(prompts):
        sampling = SamplingParams(temperature=a.temperature, seed=i) if a.temperature else None
        out = {}
        for n in names[i % len(names):] + names[:i % len(names)]:
            gen = systems[n]
            t = time.perf_counter()
            c = gen.generate(p, chat=True, max_new_tokens=a.max_new_tokens, sampling=sampling)
            elapsed = time.perf_counter() - t
            m = c.metrics
            secs[n] += elapsed - m.time_prefill
            toks[n] += max(len(c.tokens) - 1, 0)
            passes[n][0] += m.iterations
            passes[n][1] += m.iterations + m.accepted
            out[n] = c.tokens
        for n in names:
            same[n] &= out[n] == out["plain"]
    base = toks["plain"] / secs["plain"]
    print(f"{len(prompts)} held-out prompts x {a.max_new_tokens} tokens, rows={a.rows}, temperature={a.temperature}")
    print(f"{'system':18s} {'tok/s':>8s} {'x plain':>8s} {'tokens/pass':>12s} {'tokens = plain':>15s}")
    for n in names:
        rate = toks[n] / secs[n]
        print(f"{n:18s} {rate:8.1f} {rate / base:8.2f} {passes[n][1] / max(passes[n][0], 1):12.2f} "
              f"{'yes' if same[n] else 'NO':>15s}")
    for gen in systems.values():
        gen.close()


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
