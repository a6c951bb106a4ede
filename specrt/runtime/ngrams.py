"""The target's own n-grams: a table of "after these n tokens the target wrote this one",
built at build time from the target's greedy continuations of the calibration prompts
(builder/gates/ngrams.py) and shipped in the engine folder (`ngrams.json`, manifest
`proposers.ngrams`).

A pair round (runtime/batch/engine.py) verifies one guessed token for the price of a plain step,
so any guess is worth making; prompt lookup has none when the last tokens never occurred
before, and this table fills that gap: the longest suffix of the text (n = orders..1)
found in the table gives the guess. Measured on SmolLM2-135M held-out prompts (their own
greedy text): the next token is guessed 31% of the time by prompt lookup (n=2, then n=1)
alone and 38% with a table from ~20k calibration tokens (benchmarks/draft_probe.py).

Standard library only: the runtime imports neither numpy-heavy builders nor torch here.

    file format (JSON): {"format": "specrt-ngrams", "orders": N,
                         "entries": {"1": [[a, next], ...], "2": [[a, b, next], ...], ...}}
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from specrt.errors import GraphFileError

FORMAT = "specrt-ngrams"


class NgramTable:
    def __init__(self, tables: dict[int, dict[tuple[int, ...], int]]):
        self.tables = tables                       # n -> {(t1..tn): next}
        self.orders = sorted(tables, reverse=True)  # longest first

    @classmethod
    def load(cls, path: str | Path) -> "NgramTable":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
            if raw.get("format") != FORMAT:
                raise ValueError(f"format={raw.get('format')!r}")
            tables = {int(n): {tuple(int(t) for t in row[:-1]): int(row[-1]) for row in rows}
                      for n, rows in raw["entries"].items()}
            if any(len(k) != n for n, t in tables.items() for k in t):
                raise ValueError("an entry's length does not match its order")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise GraphFileError(f"n-gram table {path} cannot be read ({type(e).__name__}: {e}): rebuild the "
                                 "engines") from None
        return cls(tables)

    def guess(self, seq: Sequence[int]) -> int | None:
        """The next token after the longest suffix of seq found in the table, or None."""
        for n in self.orders:
            if len(seq) >= n:
                nxt = self.tables[n].get(tuple(seq[-n:]))
                if nxt is not None:
                    return nxt
        return None

    def __len__(self) -> int:
        return sum(len(t) for t in self.tables.values())


def to_json(tables: dict[int, dict[tuple[int, ...], int]]) -> str:
    """The file's text for `tables` (rows sorted: the same table gives the same bytes)."""
    return json.dumps({"format": FORMAT, "orders": max(tables, default=0),
                       "entries": {str(n): sorted([*k, v] for k, v in t.items()) for n, t in sorted(tables.items())}},
                      separators=(",", ":"))
