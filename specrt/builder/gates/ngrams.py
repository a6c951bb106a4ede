"""Build the target's n-gram table (runtime/ngrams.py) from its own greedy text.

The built target graphs (whatever their precision) continue the calibration part of the
shipped prompts greedily, in the chat template, until `budget` tokens are generated; every
n-gram (n = 1..orders) of prompt + continuation votes for the token that followed it, and
the table keeps the most frequent one (ties: the smaller id, so a build is reproducible).
The held-out prompts are never used, so a benchmark on them measures generalisation.

Cost: one plain decode step per generated token (SmolLM2 int4 on 2 cores: ~6 ms, so the
default 8192 tokens take ~50 s of the build).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from specrt import manifest as mf
from specrt.driver import GraphSet, encode_prompts, greedy
from specrt.runtime import ngrams

ORDERS = 4
PER_PROMPT = 128


def calibration_ids(tokenizer, limit: int | None = None) -> list[list[int]]:
    """The calibration part of the shipped prompts as token ids (driver.encode_prompts)."""
    from specrt.calibration.dataset import load_prompts, split
    cal, _ = split(load_prompts())
    return encode_prompts(tokenizer, [p.text for p in cal[:limit]])


def continuations(model_dir: Path, part: dict, shapes: mf.Shapes, prompts: list[list[int]], budget: int,
                  eos: set[int], progress=None) -> tuple[list[list[int]], int]:
    """(prompt + greedy continuation per prompt, tokens generated): prefill chunks, then
    decode steps, until `budget` generated tokens; prompts the context cannot hold are skipped."""
    gs = GraphSet(model_dir, {g: part["graphs"][g] for g in ("prefill", "decode")}, part["dims"], shapes.kv_capacity)
    out, generated = [], 0
    for ids in prompts:
        if generated >= budget:
            break
        n = min(PER_PROMPT, budget - generated, shapes.max_context - len(ids) - 1)
        if n < 1:
            continue
        new = greedy(gs, ids, n, eos=eos).tokens
        generated += len(new)
        out.append(list(ids) + new)
        if progress:
            progress(generated)
    return out, generated


def table_of(sequences: list[list[int]], orders: int = ORDERS) -> dict[int, dict[tuple[int, ...], int]]:
    votes: dict[int, dict[tuple[int, ...], Counter]] = {n: defaultdict(Counter) for n in range(1, orders + 1)}
    for seq in sequences:
        for i in range(1, len(seq)):
            for n in range(1, min(orders, i) + 1):
                votes[n][tuple(seq[i - n:i])][seq[i]] += 1
    return {n: {k: min(c, key=lambda t: (-c[t], t)) for k, c in v.items()} for n, v in votes.items()}


def build(tokenizer, model_dir: Path, part: dict, shapes: mf.Shapes, out_file: Path, budget: int, eos: set[int],
          progress=None) -> dict:
    """Generate, tabulate, write `out_file`; returns the manifest entry (proposers.ngrams).
    tokenizer: the runtime's, over the build's tokenizer.json."""
    prompts = calibration_ids(tokenizer)
    seqs, generated = continuations(model_dir, part, shapes, prompts, budget, eos, progress)
    tables = table_of(seqs)
    out_file.write_text(ngrams.to_json(tables))
    return {"file": out_file.name, "sha256": mf.sha256_file(out_file), "bytes": out_file.stat().st_size,
            "orders": ORDERS, "entries": sum(len(t) for t in tables.values()),
            "generated_tokens": generated,
            "prompts": len(seqs),
            "how": "the target's own greedy continuations of the calibration prompts (chat template); the most "
                   f"frequent next token after each n-gram, n = 1..{ORDERS}; guesses for pair rounds"}
