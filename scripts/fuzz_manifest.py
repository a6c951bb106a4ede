"""Fuzz an engine folder's manifest: every field mutated by type and by value, each
mutant loaded and run; it stops by itself.

    .venv/bin/python scripts/fuzz_manifest.py ENGINES [--limit N] [--seed S] [--json FILE]

For each leaf of manifest.json (and each object key, deleted) the mutants are values of
the wrong type (null, bool, number, string, list, object) and bad values of the right
type (0, -1, huge, off by one; "", "../x", an absolute path; [], a dropped or repeated
element). Each mutant is written over a copy of ENGINES and run as a user would run it:
`SpeculativeGenerator(copy)` (in both memory modes for the weights' fields), then a short
greedy chat generation.
Outcomes:

    refused    a specrt error (SpecrtError): the change was caught, with a message
    same       it ran and produced the original tokens: the field does not steer this run
               (build timings, parity numbers, tool versions, ...)
    steered    it ran and produced other tokens after a change to a SETTINGS field (the chat
               template, the special tokens): a different valid setting that the run follows,
               as a user who edits a template intends; their damaged values are refused
    CHANGED    it ran and produced other tokens after any other change: a silent run of a
               changed manifest
    UNTYPED    any other exception: a bug

It exits 1 if any mutant is CHANGED or UNTYPED (each is listed).
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))       # this checkout's specrt, not an installed one

WRONG_TYPES = (None, True, 0, 1.5, "x", [], {})
SETTINGS = ("tokenizer.chat_template", "tokenizer.eos_token_ids", "tokenizer.eos_token", "tokenizer.bos_token")
BIG = 2**63
# keys whose children are many similar entries: only a sample of them is mutated
SAMPLED = {"initializers": 3, "build_log": 1}


def leaves(obj, path=()):
    """(path, value) of every mutable place; objects also yield their own path (for deletion)."""
    if isinstance(obj, dict):
        if path:
            yield path, obj
        keys = list(obj)
        if path and path[-1] in SAMPLED:
            keys = keys[:SAMPLED[path[-1]]]
        for k in keys:
            yield from leaves(obj[k], path + (k,))
    elif isinstance(obj, list):
        yield path, obj
        for i, v in enumerate(obj[:3]):
            yield from leaves(v, path + (i,))
    else:
        yield path, obj


def bad_values(v) -> list:
    """Values of v's own type that a careless edit or a hostile file could hold."""
    if isinstance(v, bool):
        return [not v]
    if isinstance(v, int):
        return [0, -1, v + 1, v - 1, -v, BIG, v * 1024]
    if isinstance(v, float):
        return [0.0, -v, v * 1e30, float("nan"), float("inf")]
    if isinstance(v, str):
        return ["", v + "x", "../" + v, "/" + v.lstrip("/"), "/etc/passwd", v.upper(), "a\x00b"]
    if isinstance(v, list):
        return [[], v[:-1], v + v[:1], list(reversed(v))] if v else [[0], ["x"]]
    if isinstance(v, dict):
        return [{}]
    return []


def mutants(raw: dict):
    """(description, mutated manifest) for every mutation of every field."""
    for path, value in leaves(raw):
        where = ".".join(map(str, path))
        values = [x for x in WRONG_TYPES if type(x) is not type(value)] + bad_values(value)
        for new in values:
            m = copy.deepcopy(raw)
            _set(m, path, new)
            yield f"{where} = {json.dumps(new)[:40]}", m
        if isinstance(path[-1], str):
            m = copy.deepcopy(raw)
            del _get(m, path[:-1])[path[-1]]
            yield f"del {where}", m


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _set(obj, path, value):
    _get(obj, path[:-1])[path[-1]] = value


def run(engines: Path, chat: bool = True, memories=("fast", "shared")) -> dict[str, list[int]]:
    """Tokens of a short greedy generation in each memory mode."""
    from specrt.runtime import SpeculativeGenerator
    out = {}
    for memory in memories:
        gen = SpeculativeGenerator(engines, memory=memory)
        out[memory] = gen.generate("Tell me a story.", chat=chat, max_new_tokens=12).tokens   # as `specrt generate`
    return out


def classify(engines: Path, baseline: list[int], memories=("fast", "shared")) -> tuple[str, str]:
    from specrt.errors import SpecrtError
    try:
        tokens = run(engines, memories=memories)
    except SpecrtError as e:
        return "refused", f"{type(e).__name__}: {str(e)[:160]}"
    except Exception as e:  # noqa: BLE001 - the point is to find these
        return "UNTYPED", f"{type(e).__name__}: {str(e)[:160]}"
    changed = {m: t[:8] for m, t in tokens.items() if t != baseline}
    return ("CHANGED", f"memory {changed} vs {baseline[:8]}") if changed else ("same", "")


def fuzz(engines: Path, *, limit: int | None = None, seed: int = 0, out=print) -> dict:
    raw = json.loads((engines / "manifest.json").read_text())
    cases = list(mutants(raw))
    if limit is not None and limit < len(cases):
        cases = random.Random(seed).sample(cases, limit)
    counts, findings = Counter(), []
    with tempfile.TemporaryDirectory(prefix="specrt-fuzz-") as tmp:
        work = Path(tmp) / "eng"
        shutil.copytree(engines, work)
        runs = run(work)
        assert runs["fast"] == runs["shared"], f"the unchanged engines disagree between memory modes: {runs}"
        baseline = runs["fast"]
        t0 = time.perf_counter()
        for i, (what, m) in enumerate(cases):
            (work / "manifest.json").write_text(json.dumps(m, indent=1))
            # "shared" memory reads the weights entries themselves; "fast" lets ONNX Runtime read them
            kind, detail = classify(work, baseline, ("fast", "shared") if ".weights" in what else ("fast",))
            if kind == "CHANGED" and what.removeprefix("del ").split(" = ")[0].startswith(SETTINGS):
                kind = "steered"
            counts[kind] += 1
            if kind in ("CHANGED", "UNTYPED"):
                findings.append({"mutation": what, "outcome": kind, "detail": detail})
                out(f"{kind:8s} {what}  {detail}")
            if (i + 1) % 200 == 0:
                out(f"-- {i + 1}/{len(cases)} mutants, {dict(counts)}, {time.perf_counter() - t0:.0f} s")
    return {"mutants": len(cases), "outcomes": dict(counts), "findings": findings}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", type=Path)
    ap.add_argument("--limit", type=int, help="run a random sample of this many mutants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the report here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    report = fuzz(a.engines, limit=a.limit, seed=a.seed)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{report['mutants']} mutants of {a.engines}/manifest.json in {report['seconds']} s: {report['outcomes']}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
