"""The proposer seam: whatever guesses the next tokens for the target to verify, per row of the
batched engine (runtime/batch/engine.py).

    guessers   Proposer.propose(seq, k) -> Proposal: up to k tokens continuing seq, from seq
               alone (prompt lookup, the 1-gram match, the target's n-gram table); the policy
               (batch/policy.py) asks each row's and prices the round
    models     a draft model is a BatchModel the engine steps itself, per row, over the target's
               cache (the int8 self-draft) or its own (a draft model, truncate:N): its proposals
               are sampled with the row's seed, so they need its cache and the row's grammar

`seq` is the prompt plus every emitted token; its last token (`cur`) has no K/V in the
target cache yet, so a proposal's token j sits at position len(seq) + j. One file per
guesser, like vLLM's `spec_decode/`: lookup.py (prompt lookup and the 1-gram guess), ngram.py
(the target's own n-gram table). An EAGLE-style head is a model draft (its own cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

NO_TOKENS = np.zeros(0, np.int64)


@dataclass(frozen=True)
class Proposal:
    """tokens: [n] int64 (a view; valid until the next propose). The accept rule needs no
    distribution (runtime/choice.py): a model that samples draws its tokens with the noise
    the target's choices use, which is what makes them likely to be kept."""
    tokens: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY = Proposal(NO_TOKENS)


@runtime_checkable
class Proposer(Protocol):
    name: str

    def propose(self, seq: Sequence[int], k: int) -> Proposal: ...


class Stateless:
    """Base of the guessers: proposals are written into one buffer of k_max tokens, allocated
    here (a proposal is valid until the next propose)."""
    name = "stateless"

    def __init__(self, k_max: int):
        self._buf = np.zeros(max(k_max, 1), np.int64)

    def _tokens(self, tokens: Sequence[int]) -> Proposal:
        n = len(tokens)
        if not n:
            return EMPTY
        self._buf[:n] = tokens
        return Proposal(self._buf[:n])


class Chain:
    """The first of `proposers` that has a guess (llama.cpp chains its implementations the same
    way): e.g. the 1-gram match, then the n-gram table, for the one token of a pair round."""
    name = "chain"

    def __init__(self, proposers: Sequence[Proposer]):
        self.proposers = tuple(proposers)

    def propose(self, seq: Sequence[int], k: int) -> Proposal:
        for p in self.proposers:
            got = p.propose(seq, k)
            if len(got):
                return got
        return EMPTY
