"""A prompt file of long prompts (retrieved-document style) for the benchmarks' --prompt-file.

    .venv/bin/python benchmarks/long_prompts.py --out /tmp/long.jsonl [--tokens 900] [--count 16]

Each prompt is an excerpt of this repository's docs/*.md of about --tokens tokens (counted
with the default engines' tokenizer.json, or ~4 characters a token without one), followed by
"Summarize the text above in one sentence.". The excerpts come from the files in sorted order,
so the file is the same for a checkout. The benchmarks take the held-out split of a prompt
file (a quarter: --count 16 gives 4 held-out prompts).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASK = "Summarize the text above in one sentence."


def excerpts(tokens: int, count: int, tokenizer=None) -> list[str]:
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "docs").glob("*.md")))
    paras = [p.strip() for p in text.split("\n\n") if p.strip()]
    count_of = (lambda s: len(tokenizer.encode(s).ids)) if tokenizer is not None else (lambda s: len(s) // 4)
    out, cur, n = [], [], 0
    for p in paras:
        c = count_of(p)
        if c > tokens // 4 or n + c > tokens * 1.1:    # a long table or code block: it would overshoot
            continue
        cur.append(p)
        n += c
        if n >= tokens:
            out.append("\n\n".join(cur) + "\n\n" + ASK)
            cur, n = [], 0
            if len(out) == count:
                return out
    raise SystemExit(f"docs/*.md give only {len(out)} excerpts of {tokens} tokens: lower --tokens or --count")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--tokens", type=int, default=900)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--tokenizer", type=Path, default=ROOT / "artifacts/smollm2/tokenizer.json")
    a = ap.parse_args(argv)
    tok = None
    if a.tokenizer.exists():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(a.tokenizer))
    rows = [{"id": f"long-{i:03d}", "kind": "long", "prompt": p} for i, p in enumerate(excerpts(a.tokens, a.count, tok))]
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    sizes = [len(tok.encode(r["prompt"]).ids) for r in rows] if tok else [len(r["prompt"]) // 4 for r in rows]
    print(f"{a.out}: {len(rows)} prompts, {min(sizes)}-{max(sizes)} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
