"""The one accept rule's pieces (runtime/choice.py) on their own: the SplitMix64 exponentials,
the two-level race, and the target's choice at a position. Their exactness inside decoding
rounds is in test_accept_rule_exactness.py; every number here comes from fixed keys, so each
statistic is a fixed number."""
from __future__ import annotations

import numpy as np
import pytest
from goodness_of_fit import goodness_of_fit

from specrt.runtime.choice import block_size, choose, exponentials, first_mismatch, position_key, race
from specrt.runtime.sampling import SamplingParams

KEYS = [position_key(11, t) for t in range(3000)]      # 3000 fixed keys: one per position of seed 11


def picks(probs: np.ndarray, keys=KEYS) -> np.ndarray:
    return np.array([race(probs, key) for key in keys])


# --- exponentials ---------------------------------------------------------------------------


def test_exponentials_are_a_fixed_stream_per_key():
    a, b = exponentials(12345, 64), exponentials(12345, 64)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(exponentials(12345, 16), a[:16])     # a prefix of the same stream
    assert not np.array_equal(exponentials(12346, 64), a)               # another key, another stream
    assert np.isfinite(a).all() and (a > 0).all()
    assert len(np.unique(a)) == 64


def test_exponentials_have_mean_one_and_an_exponential_tail():
    e = exponentials(position_key(3, 5), 1_000_000)
    assert np.isfinite(e).all() and (e > 0).all()
    assert abs(e.mean() - 1.0) < 5e-3, e.mean()                         # sd of the mean: 1e-3
    assert abs(e.var() - 1.0) < 2e-2, e.var()
    assert abs((e > 2.0).mean() - np.exp(-2.0)) < 3e-3, (e > 2.0).mean()  # P(E > 2) = e^-2


def test_exponentials_wrap_keys_at_64_bits():
    np.testing.assert_array_equal(exponentials((1 << 64) + 7, 8), exponentials(7, 8))


# --- race -----------------------------------------------------------------------------------


@pytest.mark.parametrize("probs", [
    [1.0],                                                      # V = 1
    [0.0, 1.0], [1.0, 0.0],                                     # V = 2
    [0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.5, 0.0, 0.5],          # V = 3 (blocks of 2: the last one short)
    [0.0, 0.2, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0],   # the ends zero, a block of all zeros
    [0.0] * 9 + [1e-30, 1.0],                                   # a tiny id beside a big one, V % S != 0
    [1e-6] + [0.0] * 15 + [1.0],                                # the first and last ids only, V = S^2 + 1
], ids=lambda p: f"V{len(p)}")
def test_race_never_picks_a_zero_probability_id(probs):
    probs = np.array(probs, np.float32)
    got = picks(probs)
    assert (probs[got] > 0).all(), sorted(set(got.tolist()) - set(np.flatnonzero(probs).tolist()))
    assert set(got.tolist()) <= set(np.flatnonzero(probs).tolist())


def test_block_size_is_about_the_square_root_of_the_vocabulary():
    assert [block_size(v) for v in (1, 2, 3, 4, 5, 10, 17, 49152)] == [1, 2, 2, 2, 3, 4, 5, 222]
    for v in range(1, 300):
        s = block_size(v)
        assert s * s >= v and (s - 1) * (s - 1) < v, v          # ceil(sqrt(V)) blocks of S ids cover V


def test_the_same_key_gives_the_same_id_and_a_scaled_row_the_same_id():
    probs = np.array([0.1, 0.25, 0.05, 0.3, 0.1, 0.2], np.float32)
    first = picks(probs, KEYS[:200])
    np.testing.assert_array_equal(picks(probs, KEYS[:200]), first)
    np.testing.assert_array_equal(picks(probs * 7.5, KEYS[:200]), first)     # need not sum to 1
    assert len(set(first.tolist())) == 6                                     # and the keys do differ


def test_different_positions_give_different_choices():
    logits = np.zeros(40, np.float32)            # uniform over 40 ids: any fixed choice shows at once
    params, scratch = SamplingParams(temperature=1.0), np.zeros(40, np.float32)
    at = [choose(logits, params, 99, t, scratch) for t in range(200)]
    assert len(set(at)) > 30, at
    assert [choose(logits, params, 99, t, scratch) for t in range(200)] == at
    assert [choose(logits, params, 100, t, scratch) for t in range(200)] != at   # another seed, other tokens
    assert len({position_key(99, t) for t in range(200)}) == 200


# p over V = 10 (blocks of 4: [0-3] [4-7] [8-9]), zeros inside blocks, unequal block masses
HAND = np.array([0.05, 0.0, 0.15, 0.1, 0.0, 0.3, 0.0, 0.1, 0.2, 0.1])


def test_race_frequencies_fit_the_distribution():
    """Over 20,000 fixed keys the picks follow p (chi-square and a TV bound): a race whose
    block level weighs blocks by anything but their mass, or whose two levels share their
    noise, fails this."""
    keys = [position_key(2026, t) for t in range(20_000)]
    fit = goodness_of_fit(np.bincount(picks(HAND.astype(np.float32), keys), minlength=10), HAND)
    assert fit.outside_support == 0 and fit.passes, fit


def test_a_row_with_no_mass_is_refused():
    for probs in (np.zeros(1, np.float32), np.zeros(7, np.float32)):
        with pytest.raises(ValueError, match="no positive mass"):
            race(probs, 5)


# --- choose and first_mismatch ------------------------------------------------------------


def test_greedy_choice_is_the_argmax_whatever_the_seed_and_position():
    logits = np.array([0.5, 2.0, -1.0, 2.0], np.float32)
    scratch = np.zeros(4, np.float32)
    assert {choose(logits, SamplingParams(), s, t, scratch) for s in range(5) for t in range(5)} == {1}


def test_first_mismatch_keeps_the_agreeing_prefix_and_emits_the_targets_choice():
    rng = np.random.default_rng(0)
    params, V, k = SamplingParams(temperature=1.0), 12, 4
    scratch = np.zeros(V, np.float32)
    for seed in range(50):
        logits = rng.normal(size=(k + 1, V)).astype(np.float32)
        y = [choose(logits[j], params, seed, 30 + j, scratch) for j in range(k + 1)]   # the target's choices
        for n in range(k + 1):                   # a proposal agreeing for n tokens, then wrong
            proposal = np.array(y[:n] + [(v + 1) % V for v in y[n:k]], np.int64)
            assert first_mismatch(logits, proposal, params, seed, 30, scratch) == (n, y[n])
