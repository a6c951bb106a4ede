"""Fuzz an engine folder's manifest: every field mutated by type and by value, each
mutant loaded and run; it stops by itself.

    .venv/bin/python scripts/fuzz_manifest.py ENGINES [--limit N] [--seed S] [--field PREFIX] [--json FILE]

For each leaf of manifest.json (and each object key, deleted) the mutants are values of
the wrong type (null, bool, number, string, list, object) and bad values of the right
type (0, -1, huge, off by one; "", "../x", an absolute path; [], a dropped or repeated
element). Each mutant is written over a copy of ENGINES and run every way a user runs the
folder (its "ways"), each a short greedy chat generation:

    fast, shared   `SpeculativeGenerator(copy, memory=...)` (`specrt generate`; --plain when the
                   folder has no draft), in each memory mode the backend offers and these
                   engines accept (an int4/int8 target refuses "shared": left out, with the
                   engine's reason); the weights' fields run in every mode, the rest in the first
    batch          `open_batch(copy)` with two requests at once (`specrt serve --max-num-seqs`),
                   when the folder has a batched model (`specrt build --batch`): the
                   models.batch fields are fuzzed like the others

Outcomes, per way, and for the mutant the worst of its ways:

    refused    a specrt error (SpecrtError): the change was caught, with a message
    same       it ran and produced the original tokens: the field does not steer this run
               (build timings, parity numbers, tool versions, ...)
    steered    it ran and produced other tokens after a change to a SETTINGS field (the chat
               template, the special tokens): a different valid setting that the run follows,
               as a user who edits a template intends; their damaged values are refused
    CHANGED    it ran and produced other tokens after any other change: a silent run of a
               changed manifest
    UNTYPED    any other exception (a hang of the batched engine included): a bug

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


def mutants(raw: dict, fields: tuple[str, ...] = ()):
    """(description, mutated manifest) for every mutation of every field (of those under the
    dotted prefixes `fields`, when given)."""
    for path, value in leaves(raw):
        where = ".".join(map(str, path))
        if fields and not any(where == f or where.startswith(f + ".") for f in fields):
            continue
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


PROMPTS = ("Tell me a story.", "Name three colours.")
NEW_TOKENS = 12
HANG_S = 120        # a hang guard for the batched engine's thread, never a performance bound
RANK = ("same", "refused", "steered", "CHANGED", "UNTYPED")     # a mutant's outcome: the worst of its ways


def single(engines: Path, memory: str, method: str) -> list[int]:
    """Tokens of `specrt generate` (one request, one engine) in this memory mode."""
    from specrt.runtime import SpeculativeGenerator
    gen = SpeculativeGenerator(engines, memory=memory)
    return gen.generate(PROMPTS[0], chat=True, max_new_tokens=NEW_TOKENS, method=method).tokens


def batched(engines: Path) -> list[int]:
    """Tokens of two chat requests decoded together by the batched engine (`open_batch`), joined
    by -1: a field that mixes rows up changes one of them."""
    from specrt.runtime.batch.generator import open_batch
    with open_batch(engines, max_num_seqs=2) as gen:
        handles = [gen.submit(p, chat=True, max_new_tokens=NEW_TOKENS) for p in PROMPTS]
        first, second = (h.result(timeout=HANG_S).tokens for h in handles)
    return first + [-1] + second


def run_way(way: str, engines: Path, method: str) -> list[int]:
    return batched(engines) if way == "batch" else single(engines, way, method)


def ways_of(engines: Path) -> tuple[dict[str, list[int]], dict[str, str], str]:
    """(baseline tokens of each way these engines run, {way: why it is left out}, method).

    The ways are asked of the engines, not named: each memory mode their backend offers, kept
    when the unchanged engines load in it (a MatMulNBits target refuses "shared" with a
    ConfigError), and "batch" when the manifest has a batched model. The method is the one
    `specrt generate` runs: speculative when the folder has a draft, plain otherwise."""
    from specrt import manifest as mf
    from specrt.errors import SpecrtError
    from specrt.runtime.backends import backend_for
    man = mf.load(engines)
    candidates = list(backend_for(man).memory_modes) + (["batch"] if man.batch is not None else [])
    method = "speculative" if man.draft is not None else "plain"
    baseline, left_out = {}, {}
    for way in candidates:
        try:
            baseline[way] = run_way(way, engines, method)
        except SpecrtError as e:
            left_out[way] = f"{type(e).__name__}: {str(e)[:160]}"
    single_runs = {w: t for w, t in baseline.items() if w != "batch"}
    if not single_runs:
        raise SystemExit(f"{engines}: the unchanged engines load in no memory mode: {left_out}")
    assert len({tuple(t) for t in single_runs.values()}) == 1, \
        f"the unchanged engines disagree between memory modes: {single_runs}"
    return baseline, left_out, method


def outcome(way: str, engines: Path, baseline: list[int], method: str) -> tuple[str, str]:
    from specrt.errors import SpecrtError
    try:
        tokens = run_way(way, engines, method)
    except SpecrtError as e:
        return ("UNTYPED" if _wrapped(e) else "refused"), f"{type(e).__name__}: {str(e)[:160]}"
    except Exception as e:  # noqa: BLE001 - the point is to find these
        return "UNTYPED", f"{type(e).__name__}: {str(e)[:160]}"
    return ("CHANGED", f"{tokens[:8]} vs {baseline[:8]}") if tokens != baseline else ("same", "")


def _wrapped(e: Exception) -> bool:
    """An untyped exception the batched engine's thread caught and passed on as a plain
    SpecrtError("internal error in the batched engine (KeyError: ...)", runtime/batch/generator.py):
    a bug like any other untyped exception, not a refusal."""
    return type(e).__name__ == "SpecrtError" and str(e).startswith("internal error")


def classify(engines: Path, baselines: dict[str, list[int]], method: str = "speculative",
             setting: bool = False) -> tuple[str, str]:
    """The mutant's outcome over these ways (the worst), with each way's detail. setting: the
    mutated field is a SETTINGS field, whose other valid values steer the run."""
    kinds, details = [], []
    for way, tokens in baselines.items():
        kind, detail = outcome(way, engines, tokens, method)
        kind = "steered" if kind == "CHANGED" and setting else kind
        kinds.append(kind)
        if kind != "same":
            details.append(f"[{way}] {kind} {detail}".rstrip())
    return max(kinds, key=RANK.index), "; ".join(details)


def ways_for(what: str, baseline: dict[str, list[int]]) -> dict[str, list[int]]:
    """The ways one mutant runs: every memory mode for the weights' fields ("shared" reads the
    weights entries itself, "fast" lets ONNX Runtime read them), the first for the rest; and
    the batched engine."""
    modes = [w for w in baseline if w != "batch"]
    keep = modes if ".weights" in what else modes[:1]
    return {w: t for w, t in baseline.items() if w in keep or w == "batch"}


def fuzz(engines: Path, *, limit: int | None = None, seed: int = 0, fields: tuple[str, ...] = (), out=print) -> dict:
    raw = json.loads((engines / "manifest.json").read_text())
    cases = list(mutants(raw, fields))
    if not cases:
        raise SystemExit(f"no field of {engines}/manifest.json starts with {fields}")
    if limit is not None and limit < len(cases):
        cases = random.Random(seed).sample(cases, limit)
    counts, findings = Counter(), []
    with tempfile.TemporaryDirectory(prefix="specrt-fuzz-") as tmp:
        work = Path(tmp) / "eng"
        shutil.copytree(engines, work)
        baseline, left_out, method = ways_of(work)
        out(f"ways: {', '.join(baseline)} ({method})" + "".join(f"; {w} left out: {why}" for w, why in left_out.items()))
        t0 = time.perf_counter()
        for i, (what, m) in enumerate(cases):
            (work / "manifest.json").write_text(json.dumps(m, indent=1))
            setting = what.removeprefix("del ").split(" = ")[0].startswith(SETTINGS)
            kind, detail = classify(work, ways_for(what, baseline), method, setting)
            counts[kind] += 1
            if kind in ("CHANGED", "UNTYPED"):
                findings.append({"mutation": what, "outcome": kind, "detail": detail})
                out(f"{kind:8s} {what}  {detail}")
            if (i + 1) % 200 == 0:
                out(f"-- {i + 1}/{len(cases)} mutants, {dict(counts)}, {time.perf_counter() - t0:.0f} s")
    return {"mutants": len(cases), "ways": list(baseline), "left_out": left_out, "method": method,
            "outcomes": dict(counts), "findings": findings}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", type=Path)
    ap.add_argument("--limit", type=int, help="run a random sample of this many mutants")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--field", action="append", default=[], metavar="PREFIX",
                    help="only the fields under this dotted prefix, e.g. models.batch (repeatable)")
    ap.add_argument("--json", type=Path, help="write the report here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    report = fuzz(a.engines, limit=a.limit, seed=a.seed, fields=tuple(a.field))
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"{report['mutants']} mutants of {a.engines}/manifest.json, ways {report['ways']}, "
          f"in {report['seconds']} s: {report['outcomes']}")
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    return 1 if report["findings"] else 0


if __name__ == "__main__":
    sys.exit(main())
