"""Many requests on one engine: offline batches, threads, coroutines and cancelling.

    python examples/batch.py artifacts/smollm2
    python examples/batch.py artifacts/smollm2-int4 --max-num-seqs 8 --json

The folder is what `specrt build --batch` wrote (`make engines`, `make engines-int4`). One copy of
the weights serves up to --max-num-seqs requests at once (continuous batching, speculation
chosen per step); every answer is the one `SpeculativeGenerator(folder).generate` gives for the
same prompt and settings, whatever else shares the batch (docs/runtime.md). Only specrt's
runtime is imported (no torch, no transformers).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading

from specrt.errors import SpecrtError
from specrt.runtime import SamplingParams, open_batch
from specrt.runtime.batch.request import Delta, Done, Failed

PROMPTS = ["Name three colors.", "What is the capital of France?", "Write a haiku about rain.",
           "Why is the sky blue?"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("engines", help="a folder written by `specrt build --batch`")
    p.add_argument("--max-num-seqs", type=int, default=4, help="requests decoding at once")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true", help="one JSON object per answer on stdout")
    args = p.parse_args(argv)

    def show(how: str, prompt: str, text: str, finish: str | None) -> None:
        if args.json:
            print(json.dumps({"how": how, "prompt": prompt, "text": text, "finish": finish}), flush=True)
        else:
            print(f"[{how}] {prompt}\n  {text.strip()!r} ({finish})", flush=True)

    kw = dict(chat=True, max_new_tokens=args.max_new_tokens)
    try:
        with open_batch(args.engines, max_num_seqs=args.max_num_seqs) as gen:
            # offline: every prompt at once, answers in the prompts' order
            for prompt, c in zip(PROMPTS, gen.generate_batch(PROMPTS, **kw)):
                show("generate_batch", prompt, c.text, c.finish_reason)

            # from threads: each submits and waits for its own answer
            answers: dict[str, object] = {}

            def ask(prompt: str) -> None:
                answers[prompt] = gen.submit(prompt, **kw).result()
            threads = [threading.Thread(target=ask, args=(q,)) for q in PROMPTS[:2]]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for prompt in PROMPTS[:2]:
                show("thread", prompt, answers[prompt].text, answers[prompt].finish_reason)

            # from coroutines: streamed without blocking the event loop; a seeded sample is the
            # same tokens whatever else is in the batch
            async def stream(prompt: str) -> tuple[str, str]:
                parts = [c.text async for c in gen.astream(prompt, **kw)]
                return prompt, "".join(parts)

            async def together():
                return await asyncio.gather(*(stream(q) for q in PROMPTS[2:]))
            for prompt, text in asyncio.run(together()):
                show("coroutine", prompt, text, None)
            seeded = SamplingParams(temperature=0.8, seed=7)
            c = asyncio.run(gen.agenerate(PROMPTS[0], sampling=seeded, **kw))
            show("coroutine, seeded", PROMPTS[0], c.text, c.finish_reason)

            # cancelling: a sink receives the events on the engine thread (as a server's does) and
            # poll_cancel, asked at every step, ends the request once its first text has come
            events, finished = [], threading.Event()

            def sink(ev) -> None:
                events.append(ev)
                if isinstance(ev, (Done, Failed)):
                    finished.set()
            gen.submit(PROMPTS[3], sink=sink, poll_cancel=lambda: any(isinstance(e, Delta) for e in events), **kw)
            finished.wait()
            text = "".join(e.text for e in events if isinstance(e, Delta))
            show("cancelled", PROMPTS[3], text, getattr(events[-1], "finish_reason", None))
    except SpecrtError as e:          # every specrt error says what to do
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
