"""Does speculation inside a batch pay, and does it keep every answer? In one interleaved run:

    gqa        the default int4 engines' batched graph: plain one-token steps (the CPU's
               GroupQueryAttention cannot verify windows in a batch)
    std        engines built with --attention standard --batch: the policy picks plain,
               pair or lookup rounds per step from the build's batch_costs_ms
    std-plain  the same engines, speculate=False (every step a padded two-token plain step)

    .venv/bin/python benchmarks/batch_speculation.py [--rows 1,8] [--prompts 12] [--max-new-tokens 128]

Prints aggregate tok/s per system and row count (each system given all prompts at once via
generate_batch), the ratios, the step kinds chosen, and whether each std answer equals the
std-plain answer (speculation must not change a token). Not part of `make test`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
from common import ROOT, eval_prompts  # noqa: E402

from specrt.runtime.batch.generator import open_batch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gqa", default=str(ROOT / "artifacts/smollm2-int4"))
    ap.add_argument("--std", default=str(ROOT / "artifacts/smollm2-int4-std"))
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    texts = [p.text for p in eval_prompts(a.prompts, None)]
    systems = {"gqa": (a.gqa, True), "std": (a.std, True), "std-plain": (a.std, False)}
    for rows in [int(r) for r in a.rows.split(",")]:
        got = {}
        for name, (path, spec) in systems.items():      # one after another, same prompts, same machine state
            with open_batch(path, max_num_seqs=rows, speculate=spec) as g:
                g.generate(texts[0], max_new_tokens=8, chat=True)                   # warm-up
                t0 = time.perf_counter()
                outs = g.generate_batch(texts, max_new_tokens=a.max_new_tokens, chat=True)
                dt = time.perf_counter() - t0
                n = sum(len(o.tokens) for o in outs)
                st = g.engine.stats
                got[name] = ([o.tokens for o in outs], n / dt)
                print(f"rows {rows:>2}  {name:<10} {n / dt:7.1f} tok/s  ({n} tokens, {dt:.1f} s)  "
                      f"steps {dict(st.choices)}  occupancy {st.occupancy:.2f}", flush=True)
        same = sum(x == y for x, y in zip(got["std"][0], got["std-plain"][0]))
        print(f"rows {rows:>2}  std / std-plain x{got['std'][1] / got['std-plain'][1]:.2f}   "
              f"std / gqa x{got['std'][1] / got['gqa'][1]:.2f}   std answers = std-plain answers: "
              f"{same}/{len(texts)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
