"""The proposer seam: whatever guesses the next tokens for the target to verify.

    Proposer.begin(prompt, params, seed)
                                  a new generation (a model draft prefills its own cache;
                                  it samples with the request's params and seed)
    Proposer.propose(seq, k)      -> Proposal: up to k tokens continuing seq
    Proposer.accept(n)            the verdict of the last proposal: n of its tokens kept
                                  (the loop records it in `stats` before calling this)
    Proposer.end(committed)       the generation is over (or abandoned): rows past
                                  `committed` in the proposer's own cache are stale
    Proposer.stats                proposed / accepted / rounds, per proposer

`seq` is the prompt plus every emitted token; its last token (`cur`) has no K/V in the
target cache yet, so the target cache holds len(seq) - 1 rows and a proposal's token j
sits at position len(seq) + j. Proposers keep their own state (a draft's cache length);
the loop (runtime/loop.py) owns the target, the verify pass and the accept rule.

One file per proposer, like vLLM's `spec_decode/`: draft.py (a draft model, own or shared
KV cache), lookup.py (prompt lookup and the 1-gram guess), ngram.py (the target's own
n-gram table). An EAGLE-style head or a tree proposer is one more file here.
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


@dataclass
class ProposerStats:
    """Per proposer, as llama.cpp's common/speculative keeps them: rounds it proposed in,
    tokens proposed and tokens the target kept."""
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0

    def record(self, proposed: int, accepted: int) -> None:
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


@runtime_checkable
class Proposer(Protocol):
    name: str
    stats: ProposerStats

    def begin(self, prompt: Sequence[int], params=None, seed: int = 0) -> None:
        """params/seed: the generation's sampling (a model draft samples its proposals with them)."""
        ...

    def propose(self, seq: Sequence[int], k: int) -> Proposal: ...

    def accept(self, n: int) -> None: ...

    def end(self, committed: int) -> None: ...


class Stateless:
    """Base of the proposers that keep no cache (lookup, table): begin, accept and end do
    nothing. Proposals are written into one buffer of k_max tokens, allocated here."""
    name = "stateless"

    def __init__(self, k_max: int):
        self.stats = ProposerStats()
        self._buf = np.zeros(max(k_max, 1), np.int64)

    def begin(self, prompt: Sequence[int], params=None, seed: int = 0) -> None:
        pass

    def accept(self, n: int) -> None:
        pass

    def end(self, committed: int) -> None:
        pass

    def _tokens(self, tokens: Sequence[int]) -> Proposal:
        n = len(tokens)
        if not n:
            return EMPTY
        self._buf[:n] = tokens
        return Proposal(self._buf[:n])


class Chain:
    """The first of `proposers` that has a guess (llama.cpp chains its implementations the same
    way): e.g. the 1-gram match, then the n-gram table, for the one token of a pair round.
    `accept` goes to the proposer whose guess was used."""
    name = "chain"

    def __init__(self, proposers: Sequence[Proposer]):
        self.proposers = tuple(proposers)
        self.stats = ProposerStats()
        self._used: Proposer | None = None

    def begin(self, prompt: Sequence[int], params=None, seed: int = 0) -> None:
        for p in self.proposers:
            p.begin(prompt, params, seed)

    def propose(self, seq: Sequence[int], k: int) -> Proposal:
        self._used = None
        for p in self.proposers:
            got = p.propose(seq, k)
            if len(got):
                self._used = p
                return got
        return EMPTY

    def accept(self, n: int) -> None:
        if self._used is not None:
            self._used.accept(n)

    def end(self, committed: int) -> None:
        for p in self.proposers:
            p.end(committed)
