"""The one accept rule: the target's choice at a position is a pure function of (its logits,
the request's seed, the position), for a single stream and every row of a batch alike.

Greedy: argmax. Sampled: an exponential race (the Gumbel-max trick) over the warped
distribution p_t (runtime/sampling.py), its noise keyed by (seed, t) only:

    y_t = argmax_v p_t(v) / E(seed, t, v)        E ~ Exp(1), independent across v

run in two levels, so a position draws about 2 sqrt(V) numbers instead of V:

    b*  = argmax_b P_t(b) / E(seed, t, b)        P_t(b): p_t's mass in block b of S ids
    y_t = argmax_{v in b*} p_t(v) / E(seed, t, b*, v)

P(b* = b) = P_t(b) and P(y_t = v | b*) = p_t(v) / P_t(b*), so y_t ~ p_t exactly.

Every emitted token is y_t, whoever proposed what: a round keeps the proposed tokens while
they equal the target's choices and emits the first choice that differs (the greedy rule,
with argmax replaced by y_t). So
- the output follows the target's distribution exactly: the noise at t is independent of
  everything before t, which is all p_t depends on;
- a seeded request's tokens do not depend on the proposer, on k, on plain vs speculative
  rounds, or on the other rows of a batch (the speculation choice is free to use them);
- a model draft with distribution q draws x_t by the same race over q with the same noise
  (`choose` on its own logits), so x_t == y_t with probability close to 1 - TV(p, q), the
  acceptance of Leviathan et al.'s rule. Measured on SmolLM2-135M fp32 against its int8
  self-draft at temperature 0.8 (576 positions of sampled answers to 12 held-out prompts,
  20 seeds each): Leviathan's rule keeps 0.974 of draft tokens, this race 0.967 (flat:
  0.967), an inverse-CDF coupling (the rule before this one) 0.888. A guess without a
  distribution (prompt lookup, the n-gram table) is kept with probability p_t(guess), as
  under Leviathan's rule.

E(seed, t, ...): SplitMix64 (Steele et al. 2014) streams keyed by the seed and the
position, 53-bit uniforms in (0, 1), E = -log(u).
"""
from __future__ import annotations

import math

import numpy as np

from specrt.runtime.sampling import SamplingParams, probs_from_logits

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of (seed, position): every number drawn at a position comes from it."""
    return _splitmix64(_splitmix64(seed & _MASK) ^ (position & _MASK))


_U_GOLDEN = np.uint64(_GOLDEN)
_S30, _S27, _S31, _S11 = (np.uint64(s) for s in (30, 27, 31, 11))
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def exponentials(key: int, n: int) -> np.ndarray:
    """n independent Exp(1) numbers [n] float64 from the SplitMix64 stream of `key`
    (the stream's i-th output is splitmix64(key + i * golden))."""
    with np.errstate(over="ignore"):    # uint64 arithmetic wraps, as SplitMix64 wants
        x = np.arange(n, dtype=np.uint64) * _U_GOLDEN + np.uint64(key & _MASK)
        x += _U_GOLDEN
        x = (x ^ (x >> _S30)) * _M1
        x = (x ^ (x >> _S27)) * _M2
        x ^= x >> _S31
    u = ((x >> _S11).astype(np.float64) + 0.5) * (1.0 / (1 << 53))     # in (0, 1): -log(u) is finite
    return -np.log(u)


def block_size(vocab: int) -> int:
    """S: ids per block of the two-level race (about sqrt(V))."""
    return max(1, math.isqrt(max(vocab - 1, 0)) + 1)


def race(probs: np.ndarray, key: int) -> int:
    """The id the two-level exponential race keyed by `key` picks from probs [V] (non-negative,
    positive total; need not sum to 1). A zero-probability id is never picked."""
    V = probs.shape[0]
    S = block_size(V)
    mass = np.add.reduceat(probs, np.arange(0, V, S), dtype=np.float64)      # [ceil(V/S)]
    b = int(np.argmax(mass / exponentials(_splitmix64(key ^ 1), mass.shape[0])))
    if not mass[b] > 0:
        raise ValueError("probs has no positive mass; pass a [V] distribution with positive finite mass")
    block = probs[b * S:(b + 1) * S].astype(np.float64)
    return b * S + int(np.argmax(block / exponentials(_splitmix64(key + (b + 2) * _GOLDEN), block.shape[0])))


def choose(logits_row: np.ndarray, params: SamplingParams, seed: int, position: int, scratch: np.ndarray) -> int:
    """The token at `position` (its index in prompt + output) from logits [V]; scratch [V] float32.
    A proposer that samples from its own logits calls this too: the same noise couples it."""
    if params.greedy:
        return int(np.argmax(logits_row))
    return race(probs_from_logits(logits_row, params, scratch), position_key(seed, position))


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
