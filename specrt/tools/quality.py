"""How faithful each engine folder is to the fp32 reference, and what its steps cost:
one table, one row per variant (`specrt quality`).

Each folder is measured on the model its requests run: a `--batch` folder's batched model (the
one engine of SpeculativeGenerator, the server, Triton: runtime/one.py), any other folder's
one-row graphs; the reference always on its one-row graphs (the fp32 export checked against
transformers). Per evaluation prompt (chat template applied), the reference decodes greedily
for N tokens (stopping after an EOS); every variant is then

    teacher-forced  the reference's N tokens through the variant's engine, in the calls a
                    request alone makes (runtime/batch/forced.py): its N rows against the
                    reference's N rows (the rows that chose the tokens): top-1 agreement,
                    KL(fp32 || variant) per position, max |delta logit|
    free-running    its own plain greedy output (`tokens(method="plain")`, with logprobs)
                    == the reference's N tokens: the greedy exact-match count

and the teacher-forced rows are checked against the engine's own: wherever the variant's greedy
output still shares the reference's context, its reported logprob must be the forced row's
(a ParityError otherwise: the numbers would describe another computation than the engine's).
Step costs are the median of a few plain (one token) and verify (k+1 tokens, where the engine
verifies windows: not a `--batch-attention gqa` model's) one-row steps of that model at one
position, timed interleaved across the variants in the same run, so ratios between rows are
comparable on a shared, noisy machine.

Imports the runtime only (no torch): it runs wherever the engines run.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from specrt.driver import kl_rows
from specrt.errors import ConfigError, ParityError, TokenizerMismatchError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.logprobs import token_logprob

_REF = "\0reference"   # the reference's timing key when it is not one of the rows
FIELDS = ("engines", "precision", "runs", "top1_agreement", "positions", "mean_kl", "max_abs_logit_delta",
          "greedy_exact_match", "greedy_prompts", "decode_ms", "verify_ms", "verify_tokens",
          "decode_x_reference", "verify_x_reference", "weights_bytes")
LOGPROB_TOL = 1e-4     # the engine's logprob against the forced row's (the same calls: equal bits on CPU)


def _load(engines: Sequence[str | Path], reference: str | Path, threads: int) -> tuple:
    """One generator per distinct folder and engine: the variants on their requests' engine
    ("auto"), the reference on its one-row graphs (reused when a variant runs them too)."""
    loaded: dict[tuple[Path, str], SpeculativeGenerator] = {}

    def get(p, engine: str) -> SpeculativeGenerator:
        key = (Path(p).resolve(), engine)
        if key not in loaded:   # "lookup" makes the verify graph ready; no draft is loaded
            loaded[key] = SpeculativeGenerator(p, methods=("plain", "lookup"), threads=threads, engine=engine)
        return loaded[key]

    ref = get(reference, "one-row")
    variants = []
    for p in engines:
        g = get(p, "auto")
        if g.one.one_row and g.root.resolve() == ref.root.resolve():
            g = ref                     # the same one-row graphs: one generator
        variants.append((str(p), g))
    for name, g in variants:
        if g.vocab != ref.vocab or g.manifest.tokenizer["sha256"] != ref.manifest.tokenizer["sha256"]:
            raise TokenizerMismatchError(
                f"{name} was built with another tokenizer than the reference {reference} (vocab {g.vocab} vs "
                f"{ref.vocab}, or tokenizer.json differs): compare variants of the same model only")
    return ref, variants


def runs(g: SpeculativeGenerator) -> str:
    """What a folder's requests run, as the table names it."""
    if g.one.one_row:
        return "one-row graphs"
    return f"batched model ({g.manifest.batch.source.get('attention', '?')})"


def _greedy(gen: SpeculativeGenerator, ids: list[int], n: int, eos: set[int]) -> tuple[list[int], list[float]]:
    """The engine's own plain greedy output (<= n tokens, EOS included) and its logprobs."""
    out, lps = [], []
    stream = gen.tokens(ids, max_new_tokens=n, method="plain", logprobs=0)
    try:
        for e in stream:
            out.append(e.token)
            lps.append(e.logprob.logprob)
            if e.token in eos:
                break
    finally:
        stream.close()
    return out, lps


def _check_engine(name: str, rows: np.ndarray, forced: list[int], own: list[int], lps: list[float]) -> None:
    """The forced rows are the engine's own where the contexts agree: at each position up to
    the first where its greedy token leaves `forced`, the logprob it reported is the row's."""
    for i, (t, lp) in enumerate(zip(own, lps)):
        if i >= len(rows):
            return
        want = token_logprob(rows[i], t, 0)[0]
        if abs(want - lp) > LOGPROB_TOL:
            raise ParityError(f"{name}: the teacher-forced pass gives token {t} at generated position {i} the "
                              f"logprob {want:.6f}, the engine's own greedy run {lp:.6f}: the quality numbers would "
                              "not describe what this folder runs (a specrt defect: report it with the manifest)")
        if t != forced[i]:
            return


def _forced(name: str, g: SpeculativeGenerator, ids: list[int], forced: list[int], own: list[int],
            lps: list[float]) -> np.ndarray:
    """The engine's rows on `forced` [len(forced), V], checked against its own greedy output."""
    rows = g.teacher_forced(ids, forced)
    _check_engine(name, rows, forced, own, lps)
    return rows


def _verifies(g: SpeculativeGenerator) -> bool:
    """Does the folder's engine verify windows of k+1 tokens? (a `--batch-attention gqa` model does not)"""
    if g.one.one_row:
        return "verify" in g.manifest.target.graphs
    return (g.manifest.batch.parity.get("window_invariance") or {}).get("equal") is True


def _step(g: SpeculativeGenerator, graph: str, window: list[int], position: int) -> None:
    eng = g.one.engine
    T = eng._graph_t(graph, len(window), 1)
    toks = np.zeros((1, T), np.int64)
    toks[0, :len(window)] = window
    eng.target.step(graph, toks, np.array([position], np.int64), 0, pad_start=0)


def _step_costs(timed: list[tuple[str, SpeculativeGenerator]], position: int, tokens: list[int], rounds: int,
                warmup: int = 2) -> dict[str, tuple[float, float | None, int]]:
    """name -> (median plain step ms, median verify ms or None, verify window), one-row steps of
    each folder's engine model, timed round by round across the folders so that they share the
    machine's load."""
    times: dict[str, tuple[list, list]] = {name: ([], []) for name, _ in timed}
    for r in range(warmup + rounds):
        for name, g in timed:
            w = g.shapes.k + 1
            t0 = time.perf_counter()
            _step(g, "decode", tokens[:1], position)
            t1 = time.perf_counter()
            if _verifies(g):
                _step(g, "verify", (tokens * w)[:w], position)
            t2 = time.perf_counter()
            if r >= warmup:
                times[name][0].append(1e3 * (t1 - t0))
                times[name][1].append(1e3 * (t2 - t1))
    for _, g in timed:
        g.one.engine.target.cache.forget(0)
    return {name: (statistics.median(times[name][0]),
                   statistics.median(times[name][1]) if _verifies(g) else None, g.shapes.k + 1)
            for name, g in timed}


def quality_table(engines: Sequence[str | Path], reference: str | Path, prompts: Sequence[str], *,
                  new_tokens: int = 32, threads: int = 2, timing_rounds: int = 7,
                  out: Callable[[str], None] | None = print) -> dict:
    """Measure every folder in `engines` against `reference` on `prompts` (text; the chat
    template is applied). Returns the report (see FIELDS for each variant's keys)."""
    if not engines:
        raise ConfigError("give at least one engine folder to measure")
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 1:
        raise ConfigError(f"new_tokens={new_tokens!r} must be an integer >= 1")
    ref, variants = _load(list(dict.fromkeys(str(e) for e in engines)), reference, threads)
    eos = set(ref.tokenizer.eos_token_ids)
    room = min(g.shapes.max_context for g in [ref] + [g for _, g in variants])
    encoded = [ref.encode_prompt(p, chat=True) for p in prompts]
    kept = [(i, ids) for i, ids in enumerate(encoded) if len(ids) + new_tokens < room]
    if not kept:
        raise ConfigError(f"none of the {len(prompts)} prompts leaves room for {new_tokens} new tokens in "
                          f"max_context={room}: give shorter prompts or fewer --new-tokens")
    stats = {name: {"agree": 0, "positions": 0, "kl": 0.0, "delta": 0.0, "exact": 0} for name, _ in variants}
    mismatched: dict[str, list[int]] = {name: [] for name, _ in variants}   # indices into `prompts`
    ends = []
    for j, ids in kept:
        toks, lps = _greedy(ref, ids, new_tokens, eos)
        ref_rows = _forced(f"the reference {reference}", ref, ids, toks, toks, lps)
        ends.append(len(ids) + len(toks))
        for name, g in variants:
            s = stats[name]
            own = toks
            if g is not ref:
                own, lps = _greedy(g, ids, new_tokens, eos)
            got = ref_rows if g is ref else _forced(name, g, ids, toks, own, lps)
            s["agree"] += int((got.argmax(-1) == np.asarray(toks)).sum())
            s["positions"] += len(toks)
            s["kl"] += float(kl_rows(ref_rows, got).sum())
            s["delta"] = max(s["delta"], float(np.abs(got - ref_rows).max()))
            if own == toks:
                s["exact"] += 1
            else:
                mismatched[name].append(j)
    timed = variants + ([] if any(g is ref for _, g in variants) else [(_REF, ref)])
    position = min(int(statistics.median(ends)), room - max(g.shapes.k + 1 for _, g in timed))
    costs = _step_costs(timed, position, kept[-1][1][-8:], timing_rounds)
    ref_cost = costs[next(name for name, g in timed if g is ref)]
    rows = []
    for name, g in variants:
        s, (dec, ver, w) = stats[name], costs[name]
        entry = g.manifest.target if g.one.one_row else g.manifest.batch
        rows.append({
            "engines": name, "precision": entry.precision, "runs": runs(g),
            "top1_agreement": s["agree"] / s["positions"], "positions": s["positions"],
            "mean_kl": s["kl"] / s["positions"], "max_abs_logit_delta": s["delta"],
            "greedy_exact_match": s["exact"], "greedy_prompts": len(kept),
            "greedy_mismatch_prompts": mismatched[name],
            "decode_ms": dec, "verify_ms": ver, "verify_tokens": w,
            "decode_x_reference": dec / ref_cost[0],
            "verify_x_reference": None if ver is None or ref_cost[1] is None else ver / ref_cost[1],
            "weights_bytes": int(entry.weights["bytes"]),
        })
    report = {
        "reference": str(reference), "new_tokens": new_tokens, "prompts": len(kept),
        "skipped_prompts": len(prompts) - len(kept), "threads": threads,
        "timing": {"position": position, "rounds": timing_rounds, "statistic": "median ms per step",
                   "interleaved": True},
        "how": "teacher-forced on the reference's greedy continuation (chat template, stops after EOS) through "
               "the model each folder's requests run (runs), in a request's own calls; KL(reference || variant) "
               "per position; greedy exact match = the variant's own plain greedy output equals the reference's",
        "variants": rows,
    }
    if out:
        out(format_table(report))
    return report


def held_out_quality(engines: Sequence[str | Path], reference: str | Path, *, prompt_file: str | None = None,
                     n_eval: int = 16, new_tokens: int = 32, threads: int = 2,
                     out: Callable[[str], None] | None = print) -> dict:
    """`specrt quality`: quality_table on the first n_eval held-out prompts of a prompt file
    (dataset.split; default: the shipped set), the report naming the file and its prompts by id."""
    from specrt.calibration.dataset import load_prompts, split
    held_out = split(load_prompts(prompt_file))[1][:n_eval]
    report = quality_table(engines, reference, [p.text for p in held_out], new_tokens=new_tokens, threads=threads,
                           out=out)
    report["prompt_file"] = prompt_file or "shipped (specrt/calibration/data/prompts.jsonl)"
    report["prompt_ids"] = [p.id for p in held_out]
    for row in report["variants"]:
        row["greedy_mismatch_ids"] = [held_out[i].id for i in row["greedy_mismatch_prompts"]]
    return report


def format_table(report: dict) -> str:
    n = max([len("engines")] + [len(r["engines"]) for r in report["variants"]])
    head = (f"{'engines':<{n}} {'precision':<13} {'top-1':>6} {'mean KL':>9} {'max|dlogit|':>11} "
            f"{'greedy =':>9} {'decode ms':>9} {'verify ms':>9} {'decode x':>8} {'weights MB':>10}  runs")
    lines = [f"quality vs {report['reference']}: {report['prompts']} held-out prompts x {report['new_tokens']} "
             f"tokens (teacher-forced on the reference's greedy text); step costs: median of "
             f"{report['timing']['rounds']} interleaved steps at position {report['timing']['position']}, "
             f"{report['threads']} threads", head, "-" * len(head)]
    for r in report["variants"]:
        lines.append(f"{r['engines']:<{n}} {r['precision'][:13]:<13} {r['top1_agreement']:>6.3f} "
                     f"{r['mean_kl']:>9.5f} {r['max_abs_logit_delta']:>11.3f} "
                     f"{r['greedy_exact_match']:>4}/{r['greedy_prompts']:<4} {r['decode_ms']:>9.2f} "
                     + (f"{r['verify_ms']:>9.2f}" if r["verify_ms"] is not None else f"{'-':>9}")
                     + f" {r['decode_x_reference']:>8.2f} {r['weights_bytes'] / 1e6:>10.1f}  {r['runs']}")
    lines.append(f"(verify = one T=k+1 step, k+1 = {', '.join(sorted({str(r['verify_tokens']) for r in report['variants']}))}, "
                 "- where the engine verifies no windows; decode x = plain step cost relative to the reference's "
                 "one-row graphs; runs = the model each folder's requests run, which the row measures)")
    return "\n".join(lines)


def record(report: dict) -> list[str]:
    """Write each variant's row into its own manifest (`quality`): the numbers, the reference
    they were measured against, and on which prompts. The manifest is replaced atomically;
    the files it lists (and their hashes) are untouched."""
    from specrt import manifest as mf
    from specrt import __version__
    done = []
    for row in report["variants"]:
        man = mf.load(row["engines"])
        quality = {"row": {k: row[k] for k in FIELDS if k in row},
                       "reference": str(report.get("reference")), "prompt_ids": report.get("prompt_ids"),
                       "prompt_file": report.get("prompt_file"), "new_tokens": report.get("new_tokens"),
                       "measured_by": f"specrt {__version__} quality"}
        dataclasses.replace(man, quality=quality).save(Path(row["engines"]))
        done.append(str(row["engines"]))
    return done
