"""Stream a chat answer from an engine folder with speculative decoding, then print the metrics.

    python examples/generate.py artifacts/smollm2
    python examples/generate.py artifacts/smollm2 --prompt "Write a haiku about rain." --temperature 0.7 --seed 1

Only specrt's runtime is imported (no torch, no transformers): this is what a service embeds.
The engine folder is what `specrt build` wrote (`make engines` -> artifacts/smollm2).
"""
from __future__ import annotations

import argparse
import sys

from specrt.errors import SpecrtError
from specrt.runtime import SamplingParams, SpeculativeGenerator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("engines", help="a folder written by `specrt build`")
    p.add_argument("--prompt", default="Name three colors.")
    p.add_argument("--system", default=None, help="an optional system message")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (identical to plain decoding)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)

    try:
        gen = SpeculativeGenerator(args.engines)
        # a list of chat messages: rendered with the model's chat template (multi-turn works the same way)
        messages = [{"role": "user", "content": args.prompt}]
        sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        for chunk in gen.stream(messages, system=args.system, max_new_tokens=args.max_new_tokens,
                                sampling=sampling):
            print(chunk.text, end="", flush=True)
        print()
    except SpecrtError as e:          # every specrt error says what to do
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = gen.last_metrics
    print(m.summary(), file=sys.stderr)
    print(f"acceptance {m.acceptance_rate:.1%}, {m.decode_tokens_per_s:.1f} tok/s, finish: {m.finish_reason}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
