"""The target's choice at a position, as a pure function of (its logits, the request's seed,
the position): what makes a batched request's output independent of its batch.

Greedy: argmax. Sampled: the warped distribution (runtime/sampling.py) inverted at a
uniform u that depends only on (seed, position):

    y_t = F_t^-1( u(seed, t) )        F_t: the CDF of the warped target distribution at t

Every emitted token is y_t, whoever proposed what: a round keeps the proposed tokens while
they equal the target's choices and emits the first choice that differs (the greedy rule,
with argmax replaced by y_t). So
- the output follows the target's distribution exactly: u(seed, t) is independent of
  everything before position t, which is all y_t's context depends on;
- the output does not depend on the proposer, on k, on plain vs speculative rounds, or on
  the other rows of the batch (the per-step speculation choice is free to use them);
- a proposer with a distribution q is coupled through the same u (x_t = G_t^-1(u)), so
  it is accepted when its inverse CDF lands on the same token: close q, high acceptance.

The cost against Leviathan's rule: a model draft is accepted somewhat less often (the
coupling is not the optimal one); a guess (prompt lookup, the n-gram table) is accepted
with probability p(guess) either way.

u(seed, t): SplitMix64 of the seed and the position (Steele et al. 2014), 53 bits.
"""
from __future__ import annotations

import numpy as np

from specrt.runtime.sampling import SamplingParams, probs_from_logits, sample_at

_MASK = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) for (seed, position): the same pair, the same number."""
    return (_splitmix64(_splitmix64(seed & _MASK) ^ (position & _MASK)) >> 11) * (1.0 / (1 << 53))


def choose(logits_row: np.ndarray, params: SamplingParams, seed: int, position: int, scratch: np.ndarray) -> int:
    """The token at `position` (its index in prompt + output) from logits [V]; scratch [V]."""
    if params.greedy:
        return int(np.argmax(logits_row))
    return sample_at(probs_from_logits(logits_row, params, scratch), uniform(seed, position))


def first_mismatch(logits: np.ndarray, proposal, params: SamplingParams, seed: int, position: int,
                   scratch: np.ndarray) -> tuple[int, int]:
    """Verify one row's round: logits [k+1, V] at [cur, x1..xk] (position: that of x1).
    Returns (n accepted, the next token): the proposal is kept while x_j equals the target's
    choice at its position; the first choice that differs (or the bonus) comes next."""
    k = len(proposal)
    for j in range(k + 1):
        y = choose(logits[j], params, seed, position + j, scratch)
        if j == k or int(proposal[j]) != y:
            return j, y
    raise AssertionError("unreachable")
