"""Two engine folders' batched engines side by side, interleaved, in process: which is faster
on the same requests, and do they give the same answers?

    .venv/bin/python benchmarks/batch_ab.py A_ENGINES B_ENGINES [--rows 8] [--prompts 24]
                     [--max-new-tokens 128] [--rounds 3] [--ignore-eos]

Each round runs A then B (then B then A the next round, so neither always goes first) with
all prompts given at once to generate_batch; prints each run's aggregate tok/s, prefill and
decode-step time from the engine's own counters, the steps of each kind the batch chose
(plain, pair, lookup), the median B/A ratio, and how many answers are equal. Both engines open once and stay open (warm). Not part of `make test`.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request runs its max_new_tokens: the same work for A and B even when their "
                         "answers differ in length (different quantizations do)")
    a = ap.parse_args(argv)
    texts = [p.text for p in eval_prompts(a.prompts, None)]
    gens = {"A": open_batch(a.a, max_num_seqs=a.rows), "B": open_batch(a.b, max_num_seqs=a.rows)}
    speed: dict[str, list[float]] = {"A": [], "B": []}
    answers: dict[str, list] = {}
    try:
        for g in gens.values():
            g.generate(texts[0], max_new_tokens=8, chat=True)          # warm-up
        for r in range(a.rounds):
            for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                g = gens[name]
                before = dict(g.engine.stats.choices)
                t0 = time.perf_counter()
                outs = g.generate_batch(texts, max_new_tokens=a.max_new_tokens, chat=True, ignore_eos=a.ignore_eos)
                dt = time.perf_counter() - t0
                n = sum(len(o.tokens) for o in outs)
                speed[name].append(n / dt)
                answers.setdefault(name, [o.tokens for o in outs])
                steps = {k: v - before.get(k, 0) for k, v in g.engine.stats.choices.items() if v - before.get(k, 0)}
                print(f"round {r}  {name}  {n / dt:7.1f} tok/s  ({n} tokens, {dt:.2f} s; steps {steps})", flush=True)
    finally:
        for g in gens.values():
            g.close()
    ma, mb = statistics.median(speed["A"]), statistics.median(speed["B"])
    same = sum(x == y for x, y in zip(answers["A"], answers["B"]))
    print(f"median: A {ma:.1f} tok/s  B {mb:.1f} tok/s  B/A x{mb / ma:.3f}  (per round: "
          f"{', '.join(f'x{b / a_:.3f}' for a_, b in zip(speed['A'], speed['B']))})")
    print(f"answers equal: {same}/{len(texts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
