"""A draft model: k one-token steps of a small model (or a quantized copy of the target).

Two cache kinds (manifest `kv.shares_cache_with`):
- own cache (a separate or truncated model): the draft prefills the prompt itself and
  catches up on what it has not seen (the tokens emitted since its last proposal) before
  proposing; after a verdict its valid length is what the target kept of its guesses.
- shared cache (an INT8 copy of the target): it reads the target's cache for the context
  and writes its guesses into rows [len(seq)-1, ...) that the verify pass then overwrites,
  so it has no state of its own.

Greedy: the backend's argmax of each step (a device backend reads back one integer).
Sampled: each token is the draft's own choice at its position (runtime/choice.py: the same
`SamplingParams` warp and the same noise, keyed by the request's seed and the position, as
the target's choice there), so it is kept about as often as Leviathan's rule would keep it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specrt.runtime.backends.base import ModelRunner
from specrt.runtime.proposers.base import EMPTY, Proposal, ProposerStats
from specrt.runtime.rounds import prefill
from specrt.runtime.choice import choose
from specrt.runtime.sampling import SamplingParams


class DraftModel:
    name = "draft"

    def __init__(self, model: ModelRunner, k_max: int, vocab: int, *, prefill_tokens: int | None = None):
        """prefill_tokens: T of the draft's prefill graph (own cache only)."""
        self.model, self.shared = model, model.shares_cache
        self.prefill_tokens = prefill_tokens
        self.tokens = np.zeros(max(k_max, 1), np.int64)         # [k] drafted tokens
        self.scratch = np.zeros(vocab, np.float32)               # [V] a warped draft row
        self.stats = ProposerStats()
        self.params, self.seed = SamplingParams(), 0
        self.length = 0          # own cache: rows with K/V of seq (the draft's own valid length)
        self._at, self._k = 0, 0   # the last proposal: its first position and size

    def begin(self, prompt: Sequence[int], params: SamplingParams | None = None, seed: int = 0) -> None:
        self.params, self.seed = params or SamplingParams(), seed
        if not self.shared:
            prefill(self.model, self.prefill_tokens, prompt)
            self.length = len(prompt)

    def propose(self, seq: Sequence[int], k: int) -> Proposal:
        at = self._at = len(seq) - 1        # position of the first drafted token's input, `cur`
        self._k = k
        if k <= 0:
            return EMPTY
        m, params = self.model, self.params
        if not self.shared:                 # feed what the draft has not seen (e.g. a bonus token's predecessor)
            while self.length < at:
                m.step("decode", (seq[self.length],), self.length)
                self.length += 1
        x = seq[-1]
        for j in range(k):
            if params.greedy:
                m.argmax_step("decode", (x,), at + j, self.tokens[j:j + 1])
                x = int(self.tokens[j])
            else:
                # the token at position at + j + 1 (its index in seq), coupled to the target's choice there
                x = choose(m.step("decode", (x,), at + j)[0], params, self.seed, at + j + 1, self.scratch)
                self.tokens[j] = x
        return Proposal(self.tokens[:k])

    def accept(self, n: int) -> None:
        """Rows at..at+k hold K/V of cur and the drafted tokens; the first n drafted ones were kept,
        so rows up to at + n (cur and those n) stay valid, but never past what was written."""
        if not self.shared and self._k:
            self.length = min(self._at + self._k, self._at + n + 1)

    def end(self, committed: int) -> None:
        if not self.shared:
            self.model.cache.rewind_to(min(self.length, committed))
