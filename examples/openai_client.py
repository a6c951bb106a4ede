"""Stream a chat answer from `specrt serve` with the official `openai` client.

    specrt serve artifacts/smollm2 --port 8000          # in another terminal
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1

Needs `pip install openai`. With `specrt serve --api-key KEY` (or SPECRT_API_KEY), pass the same
key with --api-key or the OPENAI_API_KEY environment variable.
"""
from __future__ import annotations

import argparse
import os
import sys

import openai


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "unused"))
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--prompt", default="Name three colors.")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    args = p.parse_args(argv)

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    try:
        model = args.model or client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens,
            temperature=args.temperature, stream=True, stream_options={"include_usage": True})
        finish, usage = None, None
        for chunk in stream:
            if chunk.choices:
                print(chunk.choices[0].delta.content or "", end="", flush=True)
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage      # on the last chunk, asked for by include_usage
        print()
        if usage is not None:
            print(f"{model}: {usage.prompt_tokens} prompt tokens, {usage.completion_tokens} completion tokens, "
                  f"finish: {finish}", file=sys.stderr)
    except openai.APIError as e:  # the server's OpenAI error body: message, type, param, code
        print(f"\nerror: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
