"""Calibration and evaluation prompts.

The project ships `data/prompts.jsonl`: 200+ short prompts written for it (chat
questions, instructions, code, math, rewriting, summarising a passage given in the
prompt, lists), one JSON object a line: {"id": ..., "kind": ..., "prompt": ...}.
Users pass their own as `.jsonl` (a "prompt" field; "id" and "kind" optional) or as
plain text, one prompt a line (blank lines skipped).

`split` divides a set into calibration and held-out evaluation parts, per kind, the
same way every time for the same seed: activation ranges are collected on one part and
quality is measured on the other.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specrt.errors import ConfigError

SHIPPED = Path(__file__).with_name("data") / "prompts.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str       # chat | instruct | code | math | rewrite | summarize | list; "user" for plain text
    text: str


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """The shipped prompt set (path=None) or a user's file (.jsonl, else one prompt a line)."""
    path = SHIPPED if path is None else Path(path)
    if not path.exists():
        raise ConfigError(f"prompt file {path} does not exist: give a .jsonl file with a \"prompt\" field per line, "
                          "or a text file with one prompt per line")
    if not path.is_file():
        raise ConfigError(f"prompt file {path} is a folder: give a .jsonl or text file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError(f"prompt file {path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"prompt file {path} cannot be read ({e.strerror}): check its permissions") from None
    prompts = _from_jsonl(path, lines) if path.suffix == ".jsonl" else _from_text(path, lines)
    if not prompts:
        raise ConfigError(f"prompt file {path} holds no prompts: write one prompt per line"
                          + (" as {\"prompt\": \"...\"}" if path.suffix == ".jsonl" else ""))
    return prompts


def _from_text(path: Path, lines: list[str]) -> list[Prompt]:
    stem = path.stem
    return [Prompt(f"{stem}-{n}", "user", line.strip()) for n, line in enumerate(lines, 1) if line.strip()]


def _from_jsonl(path: Path, lines: list[str]) -> list[Prompt]:
    out, ids = [], {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} line {n} is not valid JSON ({e.msg}): write one object per line, "
                              "e.g. {\"prompt\": \"...\"}") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path} line {n} is a JSON {type(row).__name__}, not an object: write "
                              "{\"prompt\": \"...\"}")
        text = row.get("prompt")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{path} line {n} has no \"prompt\" text (got {text!r}): every line needs a "
                              "non-empty string \"prompt\"")
        pid = str(row.get("id", f"{path.stem}-{n}"))
        if pid in ids:
            raise ConfigError(f"{path} line {n} repeats id {pid!r} of line {ids[pid]}: ids must be unique")
        ids[pid] = n
        kind = row.get("kind", "user")
        if not isinstance(kind, str) or not kind:
            raise ConfigError(f"{path} line {n}: \"kind\" must be a non-empty string, got {kind!r}")
        out.append(Prompt(pid, kind, text.strip()))
    return out


def split(prompts: Sequence[Prompt], eval_fraction: float = 0.25, seed: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """(calibration, evaluation): disjoint, deterministic for a seed, each kind split by
    eval_fraction (at least one evaluation prompt per kind with two or more prompts).
    Both parts come in one seeded shuffled order, so the first N evaluation prompts mix kinds."""
    if not isinstance(eval_fraction, (int, float)) or isinstance(eval_fraction, bool) or not 0 < eval_fraction < 1:
        raise ConfigError(f"eval_fraction={eval_fraction!r} must lie strictly between 0 and 1")
    prompts = list(prompts)
    if len(prompts) < 2:
        raise ConfigError(f"{len(prompts)} prompt(s) cannot be split into calibration and evaluation parts: "
                          "give at least 2")
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)                                   # one order for everything below
    by_kind: dict[str, list[int]] = {}
    for i in order:
        by_kind.setdefault(prompts[i].kind, []).append(i)
    held = set()
    for idx in by_kind.values():
        n = round(len(idx) * eval_fraction)
        n = min(max(n, 1 if len(idx) > 1 else 0), len(idx) - 1 if len(idx) > 1 else n)
        held.update(idx[:n])
    if not held:                                         # every kind has one prompt: take from the shuffle
        held.update(order[:min(max(1, round(len(order) * eval_fraction)), len(order) - 1)])
    return [prompts[i] for i in order if i not in held], [prompts[i] for i in order if i in held]
