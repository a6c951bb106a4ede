"""A proposal without a distribution (prompt lookup, a pair round's guess, the n-gram table)
keeps sampled output exactly the target's, at the first position of a round and at a later
one after an accepted guess, through the one accept rule (runtime/choice.py first_mismatch)
as the batched engine calls it for every round (engine.py _verify; every request runs on that
engine, a single stream as a batch of one, so it is the rule's only entry point). The guess is
kept when it equals the target's choice at its position (the race keyed by the request's seed
and the position), so with probability p(guess); what comes after a rejected guess is that
same choice, so the guess never comes back.

The guesser is often wrong on purpose: it always guesses the target's second most likely
token (accepted about a quarter of the time), so most rounds end in a rejection. A rule that
draws the token after a rejected guess with fresh noise emits the guess with probability
p + (1 - p) p instead of p: about 0.2 too often here, which the chi-square test and the
total-variation bound (tests/goodness_of_fit.py) see at p-values far below 1e-6. Every
draw is seeded: each statistic here is a fixed number.
"""
from __future__ import annotations

import numpy as np
import pytest
from goodness_of_fit import P_VALUE_CEILING, goodness_of_fit

from specrt.runtime import choice as choice_mod
from specrt.runtime.batch import engine as engine_mod
from specrt.runtime.sampling import SamplingParams

V = 6
K = 2                   # two guesses a round: the second is verified only after the first was kept
START = 0
PARAMS = SamplingParams(temperature=0.9, top_k=5)     # one token of each row cut: a warp the rule must see
N = 10_000


def target_probs(logits: np.ndarray) -> np.ndarray:
    """[V] float64: softmax(logits / T), the top_k most likely kept, renormalised (written out
    from the definitions, no code shared with specrt)."""
    z = logits.astype(np.float64) / PARAMS.temperature
    p = np.exp(z - z.max())
    p[np.argsort(-p, kind="stable")[PARAMS.top_k:]] = 0.0
    return p / p.sum()


@pytest.fixture(scope="module")
def chain():
    """(logits [V, V]: row a is the target's after token a, p [V, V] float64, guess [V]: the
    second most likely token after a)."""
    logits = np.random.default_rng(1).normal(0.0, 1.0, (V, V)).astype(np.float32)
    p = np.stack([target_probs(row) for row in logits])
    guess = np.argsort(-p, axis=1, kind="stable")[:, 1]
    return logits, p, guess


def window(chain) -> tuple[np.ndarray, np.ndarray]:
    """(logits [K+1, V] of the verify pass over [START, g1, g2], guesses [K]): each guess the
    second most likely after the token before it."""
    logits, _, guess = chain
    g1 = int(guess[START])
    g2 = int(guess[g1])
    return logits[[START, g1, g2]], np.array([g1, g2], np.int64)


def batched_rule(chain, n: int) -> list[list[int]]:
    """n requests (seeds 0..n-1) through the batched engine's rule on the same window at
    position 9: each one's emitted tokens (its accepted guesses, then the recovered or bonus
    token). The rule is looked up where engine.py's _verify looks it up (the engine module's
    first_mismatch), at call time, so a test can put a wrong rule there."""
    logits, guesses = window(chain)
    scratch, out = np.zeros(V, np.float32), []
    for seed in range(n):
        accepted, nxt = engine_mod.first_mismatch(logits, guesses, PARAMS, seed, 9, scratch)
        out.append([*guesses[:accepted].tolist(), nxt])
    return out


def fits(chain, emitted: list[list[int]]):
    """(fit of the first token against p after START, fit of the second token in the rounds
    that kept the first guess against p after that guess, share of rounds that kept it)."""
    _, p, guess = chain
    g1 = int(guess[START])
    first = np.bincount([e[0] for e in emitted], minlength=V)
    later = np.bincount([e[1] for e in emitted if len(e) > 1], minlength=V)
    kept = sum(len(e) > 1 for e in emitted) / len(emitted)
    return goodness_of_fit(first, p[START]), goodness_of_fit(later, p[g1]), kept


def guard(chain, emitted) -> None:
    """The check means something: the guesses are mostly rejected, but often enough kept
    that the later position has thousands of samples, and the second guess is both kept and
    rejected."""
    _, p, guess = chain
    g1, g2 = int(guess[START]), int(guess[int(guess[START])])
    assert len({START, g1, g2}) == 3                    # three different rows of the chain
    assert 0.15 < p[START, g1] < 0.45 and 0.15 < p[g1, g2] < 0.45, (p[START, g1], p[g1, g2])
    one = sum(len(e) == 2 for e in emitted)             # the first guess kept, the second rejected
    both = sum(len(e) == 3 for e in emitted)
    assert one > 1000 and both > 300, (one, both)


def test_a_rejected_guess_leaves_the_output_exactly_the_targets(chain):
    emitted = batched_rule(chain, N)
    guard(chain, emitted)
    first, later, kept = fits(chain, emitted)
    _, p, guess = chain
    assert kept == pytest.approx(p[START, guess[START]], abs=0.02)     # kept with probability p(guess)
    assert first.outside_support == later.outside_support == 0, (first, later)
    assert first.passes and later.passes, (first, later)


RIGHT_FIRST_MISMATCH = choice_mod.first_mismatch      # the rule itself, for the wrong one built on it


def redraw(logits, proposal, params, seed, position, scratch):
    """Wrong: a guess that differs from the target's choice is replaced by a fresh draw from p
    (other noise than the choice it was compared with), so the guess comes back."""
    n, y = RIGHT_FIRST_MISMATCH(logits, proposal, params, seed, position, scratch)
    if n == len(proposal):
        return n, y
    return n, choice_mod.choose(logits[n], params, seed + 1_000_003, position + n, scratch)


def test_a_batched_rule_that_redraws_a_rejected_guess_fails_the_same_check(chain, monkeypatch):
    """The engine's rule with that mistake (put where engine.py's _verify looks it up): both
    positions fail by a wide margin."""
    monkeypatch.setattr(engine_mod, "first_mismatch", redraw)
    first, later, _ = fits(chain, batched_rule(chain, N))
    assert all(f.p_value < P_VALUE_CEILING and f.tv > 2 * f.tv_bound for f in (first, later)), (first, later)
