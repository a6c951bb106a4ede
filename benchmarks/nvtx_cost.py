"""Cost of the NVTX ranges on CPU: speculative (and plain) tok/s with the ranges on and with
them replaced by no-ops, interleaved prompt by prompt in one run.

    python benchmarks/nvtx_cost.py artifacts/smollm2 [--prompts 8 --max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import sys

from specrt.prompts import PROMPTS
from specrt.runtime import SpeculativeGenerator
from specrt.runtime import nvtx_ranges as trace


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    gen = SpeculativeGenerator(a.engines)
    real = (trace.push, trace.pop)
    modes = {"nvtx on": real, "nvtx off": (lambda name: None, lambda: None)}
    texts = (PROMPTS * (1 + a.prompts // len(PROMPTS)))[:a.prompts]
    tot = {(m, meth): [0, 0.0] for m in modes for meth in ("speculative", "plain")}
    same = True
    gen.generate(texts[0], chat=True, max_new_tokens=8)
    for i, text in enumerate(texts):
        for meth in ("speculative", "plain"):
            outs = {}
            for m in (list(modes) if i % 2 == 0 else list(modes)[::-1]):
                trace.push, trace.pop = modes[m]
                out = gen.generate(text, chat=True, max_new_tokens=a.max_new_tokens, method=meth)
                mt = out.metrics
                tot[(m, meth)][0] += len(out.tokens)
                tot[(m, meth)][1] += mt.time_total - mt.time_prefill
                outs[m] = out.tokens
            same &= outs["nvtx on"] == outs["nvtx off"]
    trace.push, trace.pop = real
    print(f"nvtx package: {'yes' if trace.ENABLED else 'no (ranges are no-ops)'}")
    for meth in ("speculative", "plain"):
        on, off = (tot[(m, meth)][0] / tot[(m, meth)][1] for m in modes)
        print(f"{meth:<12} nvtx on {on:.1f} tok/s | off {off:.1f} tok/s | on/off {on / off:.3f}")
    print(f"outputs identical: {'yes' if same else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
