"""The target's own n-gram table as a proposer (the table and its file: runtime/ngrams.py).

A pair round's last resort: when neither prompt lookup nor the 1-gram match has a guess,
the longest suffix of the text found in the table gives one token.
"""
from __future__ import annotations

from typing import Sequence

from specrt.runtime.ngrams import NgramTable
from specrt.runtime.proposers.base import Proposal, Stateless


class TableGuess(Stateless):
    name = "ngram-table"

    def __init__(self, table: NgramTable):
        super().__init__(1)
        self.table = table

    def propose(self, seq: Sequence[int], k: int) -> Proposal:
        nxt = self.table.guess(seq) if k > 0 else None
        return self._tokens(() if nxt is None else (nxt,))
