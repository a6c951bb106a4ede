"""A/B: the same engines driven by two checkouts of specrt, interleaved in one run.

    python benchmarks/ab_checkouts.py OLD_CHECKOUT NEW_CHECKOUT ENGINES [--prompts 8 --max-new-tokens 128]
                                      [--temperature 0.8] [--engine one-row]

Each checkout runs in its own long-lived worker process (PYTHONPATH points at it; load
time excluded), on the held-out chat prompts (`held_out`); prompts alternate A,B / B,A so
drift on a shared machine hits both.
Prints tok/s (decode, after prefill) and the draft's acceptance rate per method and
checkout, their ratio, and whether the two produced identical tokens. --temperature > 0
samples (prompt i with seed i, the same in both checkouts): a change of the accept rule
changes the tokens, so "identical" is then expected to say NO, and the acceptance column
shows what the rule costs or gains. Used to show a refactor changed neither speed nor
output (e.g. `git archive <rev> | tar -x -C /tmp/old`). --engine one-row: both checkouts run
the folder's one-row graphs (SpeculativeGenerator(engine="one-row")), not its batched model;
--old-engine one-row: only the old checkout does (the one-request loop before issue 27 against
today's batch of one on the same folder).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

def held_out(n: int) -> list[str]:
    """The first n held-out chat prompts (benchmarks/peers/common.py eval_prompts: the calibration
    prompt file's held-out split, as `specrt quality` and batch_speculation.py take them; 52).
    Until 2026-12-06 these scripts ran specrt.prompts.PROMPTS, 10 prompts repeated to n."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
    from common import eval_prompts
    return [p.text for p in eval_prompts(n, None)]


# engine: "auto" (the checkout's default), "one-row" (SpeculativeGenerator(engine="one-row")),
# "fixed" (the default engine with the policy's choices off: every round drafts k; ab_many.py) or
# "table" (the default engine pricing with the build's cost table alone: SPECRT_LIVE_COSTS=0)
WORKER = r"""
import json, sys, time
import specrt
from specrt.runtime import SpeculativeGenerator
engine = sys.argv[2]
gen = SpeculativeGenerator(sys.argv[1], **({"engine": engine} if engine not in ("auto", "fixed", "table") else {}))
if engine == "fixed":
    gen.one.fixed = True
print(json.dumps({"ready": specrt.__file__}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    ids = gen.encode_prompt(req["prompt"], chat=True)
    t0 = time.perf_counter()
    toks = [e.token for e in gen.tokens(ids, max_new_tokens=req["n"], method=req["method"],
                                        sampling=req.get("sampling"))]
    wall = time.perf_counter() - t0
    m = gen.last_metrics
    live = getattr(getattr(getattr(getattr(gen, "one", None), "full", None), "costs", None), "live", None)
    snap = live.snapshot() if live is not None else None
    live = {"overall": snap["overall"], "shapes": {"/".join(map(str, k)): v for k, v in snap["shapes"].items()}} \
        if snap is not None else None
    print(json.dumps({"tokens": toks, "seconds": m.time_total - m.time_prefill, "wall": wall,
                      "drafted": m.drafted, "accepted": m.accepted, "live": live}), flush=True)
"""


class Worker:
    def __init__(self, checkout: Path, engines: str, engine: str = "auto"):
        env = {**os.environ, "PYTHONPATH": str(checkout), **({"SPECRT_LIVE_COSTS": "0"} if engine == "table" else {})}
        self.p = subprocess.Popen([sys.executable, "-c", WORKER, engines, engine], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env, cwd=checkout)
        ready = json.loads(self.p.stdout.readline())
        if not ready["ready"].startswith(str(checkout)):
            raise SystemExit(f"worker imported {ready['ready']}, not the checkout {checkout}")

    def run(self, prompt: str, n: int, method: str, sampling: dict | None = None) -> dict:
        self.p.stdin.write(json.dumps({"prompt": prompt, "n": n, "method": method, "sampling": sampling}) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait(30)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("engines")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sample, prompt i with seed i")
    ap.add_argument("--engine", choices=("auto", "one-row"), default="auto",
                    help="SpeculativeGenerator's engine= in both checkouts (one-row: the folder's one-row graphs)")
    ap.add_argument("--old-engine", choices=("auto", "one-row"), default=None,
                    help="the old checkout's engine= when it differs (e.g. one-row: the one-request loop a checkout "
                         "before the batch of one ran, against the new checkout's default)")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(a.new))
    engines = str(Path(a.engines).resolve())
    workers = {"old": Worker(a.old.resolve(), engines, a.old_engine or a.engine),
               "new": Worker(a.new.resolve(), engines, a.engine)}
    texts = held_out(a.prompts)
    for w in workers.values():                       # warm-up
        w.run(texts[0], 8, "plain"), w.run(texts[0], 8, "speculative")
    tot = {(c, m): [0, 0.0, 0, 0] for c in workers for m in ("plain", "speculative")}
    identical = True
    for i, text in enumerate(texts):
        for method in ("plain", "speculative"):
            order = ("old", "new") if i % 2 == 0 else ("new", "old")
            sampling = {"temperature": a.temperature, "seed": i} if a.temperature > 0 else None
            res = {c: workers[c].run(text, a.max_new_tokens, method, sampling) for c in order}
            identical &= res["old"]["tokens"] == res["new"]["tokens"]
            for c, r in res.items():
                tot[(c, method)][0] += len(r["tokens"])
                tot[(c, method)][1] += r["seconds"]
                tot[(c, method)][2] += r.get("drafted", 0)
                tot[(c, method)][3] += r.get("accepted", 0)
    for w in workers.values():
        w.close()
    print(f"{'method':<12} {'old tok/s':>10} {'new tok/s':>10} {'new/old':>8} {'old accept':>11} {'new accept':>11}")
    for method in ("plain", "speculative"):
        o, n = (tot[(c, method)][0] / tot[(c, method)][1] for c in ("old", "new"))
        acc = [tot[(c, method)][3] / tot[(c, method)][2] if tot[(c, method)][2] else float("nan") for c in ("old", "new")]
        print(f"{method:<12} {o:>10.1f} {n:>10.1f} {n / o:>8.3f} {acc[0]:>11.3f} {acc[1]:>11.3f}")
    print(f"outputs identical between checkouts: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
