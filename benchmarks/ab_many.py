"""N-way A/B of the single stream: systems (a checkout of specrt, how it runs, on which engine
folder) interleaved in one run, greedy, on the held-out chat prompts (ab_checkouts.held_out; up
to 52; before 2026-12-06 specrt.prompts.PROMPTS, 10 prompts repeated to --prompts).

    python benchmarks/ab_many.py ENGINES NAME=CHECKOUT[:ENGINE][@FOLDER] ... [--prompts 12]
                                 [--rounds 3] [--max-new-tokens 128]

ENGINE: auto (the checkout's default), one-row (a folder's one-row graphs; the one-request
loop of a checkout before issue 27, e.g. 47dabae), fixed (every round drafts k: the policy's
choices switched off), table (the cost table as the build timed it, not corrected in the loop:
SPECRT_LIVE_COSTS=0). FOLDER: another engine folder than ENGINES for this system (a rebuild
with other settings). Each system runs in its own long-lived worker process
(ab_checkouts.Worker and its WORKER; load time excluded); the order of the systems rotates prompt by prompt,
so drift on a shared machine hits all. Prints per system decode tok/s (after prefill) and its
ratio to the first system, the draft's acceptance, whether its tokens equal the first
system's, and tok/s with the prompt's prefill counted. Not part of `make test`.

Example (the single stream against the loop it replaced, docs/benchmarks.md):

    git clone -q . /tmp/old && git -C /tmp/old checkout -q 47dabae
    python benchmarks/ab_many.py artifacts/smollm2 old=/tmp/old:one-row new=. fixed=.:fixed
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_checkouts import Worker, held_out  # noqa: E402


def parse_system(spec: str, engines: str) -> tuple[str, Path, str, str]:
    """NAME=CHECKOUT[:ENGINE][@FOLDER] -> (name, checkout, engine, folder)."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise SystemExit(f"{spec!r}: give NAME=CHECKOUT[:ENGINE][@FOLDER]")
    rest, _, folder = rest.partition("@")
    checkout, _, engine = rest.partition(":")
    engine = engine or "auto"
    if engine not in ("auto", "one-row", "fixed", "table"):
        raise SystemExit(f"{spec!r}: ENGINE is auto, one-row, fixed or table, not {engine!r}")
    return name, Path(checkout).resolve(), engine, str(Path(folder or engines).resolve())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines")
    ap.add_argument("systems", nargs="+", metavar="NAME=CHECKOUT[:ENGINE][@FOLDER]")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts (tokens compared on the first)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    a = ap.parse_args(argv)
    systems = [parse_system(s, a.engines) for s in a.systems]
    if len({s[0] for s in systems}) != len(systems):
        raise SystemExit("system names must differ")
    texts = held_out(a.prompts)
    workers = {name: Worker(co, folder, engine) for name, co, engine, folder in systems}
    for w in workers.values():                       # warm-up
        w.run(texts[0], 8, "speculative")
    names = list(workers)
    tot = {n: {"tokens": 0, "seconds": 0.0, "wall": 0.0, "drafted": 0, "accepted": 0} for n in names}
    first: dict[str, list] = {n: [] for n in names}
    live: dict[str, dict | None] = {}
    for rnd in range(a.rounds):
        for i, text in enumerate(texts):
            for n in names[i % len(names):] + names[:i % len(names)]:
                r = workers[n].run(text, a.max_new_tokens, "speculative")
                t = tot[n]
                t["tokens"] += len(r["tokens"])
                for key in ("seconds", "wall", "drafted", "accepted"):
                    t[key] += r[key]
                if rnd == 0:
                    first[n].append(r["tokens"])
                live[n] = r.get("live")
    for w in workers.values():
        w.close()
    base = tot[names[0]]
    print(f"{'system':<12} {'tok/s':>8} {'ratio':>7} {'accept':>7} {'same tokens':>12} {'with prefill':>13} {'ratio':>7}")
    for n in names:
        t = tot[n]
        rate, wall = t["tokens"] / t["seconds"], t["tokens"] / t["wall"]
        print(f"{n:<12} {rate:>8.1f} {rate / (base['tokens'] / base['seconds']):>7.3f} "
              f"{t['accepted'] / max(t['drafted'], 1):>7.3f} {str(first[n] == first[names[0]]):>12} "
              f"{wall:>13.1f} {wall / (base['tokens'] / base['wall']):>7.3f}")
    for n in names:             # the loop's corrections of the build's cost table (runtime/batch/live_costs.py)
        if live.get(n) and live[n]["shapes"]:
            shapes = " ".join(f"{k}:x{f:.2f}({c})" for k, (f, c) in sorted(live[n]["shapes"].items()))
            print(f"{n}: live costs x{live[n]['overall']:.2f} overall; {shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
