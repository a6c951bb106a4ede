"""Prompt lookup: proposals that cost nothing, for a target too fast for a model draft.

An int4 target has no cheaper copy of itself, so a model draft costs a large share of a
target step. Prompt lookup proposes the continuation of the latest earlier occurrence of
the last n tokens, in the prompt and the text so far; greedy verification keeps the output
the target's own, and rounds without a match need only a one-token step.

`PromptLookup(n=1)` is also the *1-gram match* a pair round falls back to when the n-gram
lookup has no guess (runtime/batch/engine.py): the token that followed the latest earlier
occurrence of the last token.
"""
from __future__ import annotations

from typing import Sequence

from specrt.runtime.proposers.base import Proposal, Stateless


def lookup(seq: Sequence[int], n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of seq[-n:] (none: [])."""
    if len(seq) <= n:
        return []
    key = list(seq[-n:])
    for start in range(len(seq) - n - 1, -1, -1):       # latest match first, not the suffix itself
        if list(seq[start:start + n]) == key:
            return list(seq[start + n:start + n + k])
    return []


class PromptLookup(Stateless):
    """Proposes lookup(seq, n, k): no distribution (q is one-hot on each token)."""

    def __init__(self, n: int, k_max: int):
        super().__init__(k_max)
        self.n = n
        self.name = f"lookup-{n}"

    def propose(self, seq: Sequence[int], k: int) -> Proposal:
        return self._tokens(lookup(seq, self.n, k) if k > 0 else ())


class OneGram(Stateless):
    """The token that followed the latest earlier occurrence of the last token: lookup with
    n = 1 and k = 1, found with one C-speed scan (`list.index`) instead of a Python loop."""
    name = "one-gram"

    def __init__(self):
        super().__init__(1)

    def propose(self, seq: Sequence[int], k: int) -> Proposal:
        if k < 1 or len(seq) < 2:
            return self._tokens(())
        try:
            at = len(seq) - 2 - list(seq[-2::-1]).index(seq[-1])   # latest earlier occurrence
        except ValueError:
            return self._tokens(())
        return self._tokens((seq[at + 1],))
