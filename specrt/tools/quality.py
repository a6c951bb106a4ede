"""How faithful each engine folder is to the fp32 reference, and what its steps cost:
one table, one row per variant (`specrt quality`).

Per evaluation prompt (chat template applied), the reference decodes greedily for N
tokens (stopping after an EOS); every variant is then

    teacher-forced  prefill(prompt) -> decode(ref token 0) -> ... -> decode(ref token N-2)
                    its N rows against the reference's N rows (the rows that chose the tokens):
                    top-1 agreement, KL(fp32 || variant) per position, max |delta logit|
    free-running    its own plain greedy output (the runtime's `tokens(method="plain")`)
                    == the reference's N tokens: the greedy exact-match count

as `identity.target_agreement` does at build time, but through each folder's own
manifest and the runtime's loaded models (long prompts are prefilled in chunks, as the
runtime does). Step costs are the median of a few decode (T=1) and verify (T=k+1) steps
at one position, timed interleaved across the variants in the same run, so ratios
between rows are comparable on a shared, noisy machine.

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
from specrt.errors import ConfigError, TokenizerMismatchError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.batch.one_row import prefill

_REF = "\0reference"   # the reference's timing key when it is not one of the rows
FIELDS = ("engines", "precision", "top1_agreement", "positions", "mean_kl", "max_abs_logit_delta",
          "greedy_exact_match", "greedy_prompts", "decode_ms", "verify_ms", "verify_tokens",
          "decode_x_reference", "verify_x_reference", "weights_bytes")


def _load(engines: Sequence[str | Path], reference: str | Path, threads: int) -> tuple:
    """One generator per distinct folder (the reference's is reused when it is listed)."""
    loaded: dict[Path, SpeculativeGenerator] = {}

    def get(p) -> SpeculativeGenerator:
        key = Path(p).resolve()
        if key not in loaded:   # "lookup" makes the verify graph ready; no draft is loaded
            # the one-row graphs (engine="one-row"): the teacher-forced passes below step them directly
            loaded[key] = SpeculativeGenerator(p, methods=("plain", "lookup"), threads=threads, engine="one-row")
        return loaded[key]

    ref = get(reference)
    variants = [(str(p), get(p)) for p in engines]
    for name, g in variants:
        if g.vocab != ref.vocab or g.manifest.tokenizer["sha256"] != ref.manifest.tokenizer["sha256"]:
            raise TokenizerMismatchError(
                f"{name} was built with another tokenizer than the reference {reference} (vocab {g.vocab} vs "
                f"{ref.vocab}, or tokenizer.json differs): compare variants of the same model only")
    return ref, variants


def _reference_run(model, chunk: int, ids: list[int], n: int, eos: set[int]) -> tuple[np.ndarray, list[int]]:
    """The reference's greedy continuation of `ids` (<= n tokens, EOS included) and the rows
    that chose each token: rows [m, V], tokens [m]."""
    row = prefill(model, chunk, ids)
    rows, toks = [], []
    for i in range(n):
        rows.append(row.copy())
        toks.append(int(row.argmax()))
        if toks[-1] in eos or i == n - 1:
            break
        row = model.step("decode", toks[-1:], len(ids) + i)[0]
    model.cache.rewind_to(len(ids) + len(toks) - 1)
    return np.stack(rows), toks


def _teacher_forced(model, chunk: int, ids: list[int], toks: list[int]) -> np.ndarray:
    """A variant's rows on the reference's tokens: rows [len(toks), V]."""
    rows = [prefill(model, chunk, ids).copy()]
    for i, t in enumerate(toks[:-1]):
        rows.append(model.step("decode", [t], len(ids) + i)[0].copy())
    model.cache.rewind_to(len(ids) + len(toks) - 1)
    return np.stack(rows)


def _greedy(gen: SpeculativeGenerator, ids: list[int], n: int, eos: set[int]) -> list[int]:
    out = []
    stream = gen.tokens(ids, max_new_tokens=n, method="plain")
    try:
        for e in stream:
            out.append(e.token)
            if e.token in eos:
                break
    finally:
        stream.close()
    return out


def _step_costs(timed: list[tuple[str, SpeculativeGenerator]], position: int, tokens: list[int], rounds: int,
                warmup: int = 2) -> dict[str, tuple[float, float, int]]:
    """name -> (median decode ms, median verify ms, verify window), timed round by round
    across the folders so that they share the machine's load."""
    times: dict[str, tuple[list, list]] = {name: ([], []) for name, _ in timed}
    for r in range(warmup + rounds):
        for name, g in timed:
            w = g.shapes.k + 1
            window = (tokens * w)[:w]
            t0 = time.perf_counter()
            g.target.step("decode", tokens[:1], position)
            t1 = time.perf_counter()
            g.target.step("verify", window, position)
            t2 = time.perf_counter()
            if r >= warmup:
                times[name][0].append(1e3 * (t1 - t0))
                times[name][1].append(1e3 * (t2 - t1))
    return {name: (statistics.median(times[name][0]), statistics.median(times[name][1]), g.shapes.k + 1)
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
        ref_rows, toks = _reference_run(ref.target, ref.shapes.prefill_chunk, ids, new_tokens, eos)
        ends.append(len(ids) + len(toks))
        for name, g in variants:
            s = stats[name]
            got = _teacher_forced(g.target, g.shapes.prefill_chunk, ids, toks)
            s["agree"] += int((got.argmax(-1) == np.asarray(toks)).sum())
            s["positions"] += len(toks)
            s["kl"] += float(kl_rows(ref_rows, got).sum())
            s["delta"] = max(s["delta"], float(np.abs(got - ref_rows).max()))
            if _greedy(g, ids, new_tokens, eos) == toks:
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
        rows.append({
            "engines": name, "precision": g.manifest.target.precision,
            "top1_agreement": s["agree"] / s["positions"], "positions": s["positions"],
            "mean_kl": s["kl"] / s["positions"], "max_abs_logit_delta": s["delta"],
            "greedy_exact_match": s["exact"], "greedy_prompts": len(kept),
            "greedy_mismatch_prompts": mismatched[name],
            "decode_ms": dec, "verify_ms": ver, "verify_tokens": w,
            "decode_x_reference": dec / ref_cost[0], "verify_x_reference": ver / ref_cost[1],
            "weights_bytes": int(g.manifest.target.weights["bytes"]),
        })
    report = {
        "reference": str(reference), "new_tokens": new_tokens, "prompts": len(kept),
        "skipped_prompts": len(prompts) - len(kept), "threads": threads,
        "timing": {"position": position, "rounds": timing_rounds, "statistic": "median ms per step",
                   "interleaved": True},
        "how": "teacher-forced on the reference's greedy continuation (chat template, stops after EOS); "
               "KL(reference || variant) per position; greedy exact match = the variant's own plain greedy "
               "output equals the reference's",
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
            f"{'greedy =':>9} {'decode ms':>9} {'verify ms':>9} {'decode x':>8} {'weights MB':>10}")
    lines = [f"quality vs {report['reference']}: {report['prompts']} held-out prompts x {report['new_tokens']} "
             f"tokens (teacher-forced on the reference's greedy text); step costs: median of "
             f"{report['timing']['rounds']} interleaved steps at position {report['timing']['position']}, "
             f"{report['threads']} threads", head, "-" * len(head)]
    for r in report["variants"]:
        lines.append(f"{r['engines']:<{n}} {r['precision'][:13]:<13} {r['top1_agreement']:>6.3f} "
                     f"{r['mean_kl']:>9.5f} {r['max_abs_logit_delta']:>11.3f} "
                     f"{r['greedy_exact_match']:>4}/{r['greedy_prompts']:<4} {r['decode_ms']:>9.2f} "
                     f"{r['verify_ms']:>9.2f} {r['decode_x_reference']:>8.2f} {r['weights_bytes'] / 1e6:>10.1f}")
    lines.append(f"(verify = one T=k+1 step, k+1 = {', '.join(sorted({str(r['verify_tokens']) for r in report['variants']}))}; "
                 "decode x = decode step cost relative to the reference's)")
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
