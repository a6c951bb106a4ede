"""Tests for specrt.runtime.sampling: params validation, the logit warp, and the pieces of
the accept rule. Its exactness over many draws is in test_accept_rule_exactness.py."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from specrt.errors import SamplingParamsError
from specrt.runtime.sampling import (
    SamplingParams,
    Verdict,
    accept_probability,
    probs_from_logits,
    residual_distribution,
    sample,
    verify_greedy,
    verify_sampled,
)

# probs [0.4, 0.3, 0.2, 0.1] at temperature 1: easy to check by hand.
HAND_LOGITS = np.log(np.array([4.0, 3.0, 2.0, 1.0], dtype=np.float32))


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    return probs_from_logits(logits, params, np.empty(logits.shape[0], np.float32))


class FixedRng:
    """Stands in for numpy.random.Generator where a test needs exact u values."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


# --- SamplingParams -----------------------------------------------------------


def test_default_params_are_greedy_and_temperature_makes_them_sampled():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("temperature", {"temperature": -0.1}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": float("inf")}),
        ("temperature", {"temperature": True}),
        ("temperature", {"temperature": "0.7"}),
        ("top_k", {"top_k": -1}),
        ("top_k", {"top_k": 2.0}),
        ("top_k", {"top_k": True}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("top_p", {"top_p": -0.2}),
        ("top_p", {"top_p": float("nan")}),
        ("top_p", {"top_p": float("inf")}),
        ("top_p", {"top_p": False}),
        ("min_p", {"min_p": -0.1}),
        ("min_p", {"min_p": 1.5}),
        ("min_p", {"min_p": float("nan")}),
        ("min_p", {"min_p": True}),
        ("min_p", {"min_p": "0.1"}),
        ("seed", {"seed": -3}),
        ("seed", {"seed": 1.5}),
        ("seed", {"seed": True}),
    ],
)
def test_each_bad_param_raises_naming_the_field_and_value(field, kwargs):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{field}=")
    assert repr(kwargs[field]) in message
    assert isinstance(info.value, ValueError)


def test_top_p_message_gives_the_range_and_how_to_disable():
    with pytest.raises(SamplingParamsError, match=r"top_p=1\.5 is outside \(0, 1\]; use 1\.0 to disable"):
        SamplingParams(top_p=1.5)


def test_boundary_params_are_accepted():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)
    SamplingParams(temperature=1e-6, top_k=np.int64(5), top_p=1e-9, seed=np.int64(7))
    SamplingParams(temperature=np.float32(0.5), top_p=np.float64(0.9))


def test_params_are_frozen():
    params = SamplingParams(temperature=0.7)
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]


# --- probs_from_logits --------------------------------------------------------


def test_temperature_one_is_plain_softmax():
    probs = warp(HAND_LOGITS, SamplingParams(temperature=1.0))
    np.testing.assert_allclose(probs, [0.4, 0.3, 0.2, 0.1], rtol=1e-6)


def test_temperature_divides_logits_before_softmax():
    # exp(log(w) / 2) = sqrt(w)
    w = np.sqrt([4.0, 3.0, 2.0, 1.0])
    np.testing.assert_allclose(warp(HAND_LOGITS, SamplingParams(temperature=2.0)), w / w.sum(), rtol=1e-6)


def test_tiny_temperature_concentrates_on_argmax_without_overflow():
    # exp underflowing to 0 is the intended result for the other tokens.
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        probs = warp(HAND_LOGITS * 100, SamplingParams(temperature=1e-30))
    np.testing.assert_array_equal(probs, [1.0, 0.0, 0.0, 0.0])


def test_minus_inf_logits_get_zero_probability():
    logits = np.array([0.0, -np.inf, 0.0, -np.inf], dtype=np.float32)
    np.testing.assert_allclose(warp(logits, SamplingParams(temperature=0.8)), [0.5, 0.0, 0.5, 0.0])


def test_temperature_only_path_writes_into_out_without_a_vocab_sized_allocation():
    v = 1 << 20  # 4 MiB of float32: any temporary of this size shows up in the peak
    logits = np.random.default_rng(0).normal(size=v).astype(np.float32)
    out = np.empty(v, np.float32)
    params = SamplingParams(temperature=0.7)
    tracemalloc.start()
    try:
        result = probs_from_logits(logits, params, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result is out
    assert peak < v  # well under one float32 [V] array (4 * V bytes)
    assert math.isclose(float(out.sum(dtype=np.float64)), 1.0, rel_tol=1e-5)


def test_top_k_keeps_the_k_largest_and_renormalises():
    np.testing.assert_allclose(
        warp(HAND_LOGITS, SamplingParams(temperature=1.0, top_k=3)), [4 / 9, 3 / 9, 2 / 9, 0.0], rtol=1e-6
    )


def test_top_k_at_least_the_vocabulary_is_a_no_op():
    probs = warp(HAND_LOGITS, SamplingParams(temperature=1.0, top_k=10))
    np.testing.assert_allclose(probs, [0.4, 0.3, 0.2, 0.1], rtol=1e-6)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # cumulative mass 0.4, 0.7, 0.9, 1.0
    np.testing.assert_allclose(
        warp(HAND_LOGITS, SamplingParams(temperature=1.0, top_p=0.65)), [4 / 7, 3 / 7, 0.0, 0.0], rtol=1e-6
    )
    np.testing.assert_allclose(
        warp(HAND_LOGITS, SamplingParams(temperature=1.0, top_p=0.75)), [4 / 9, 3 / 9, 2 / 9, 0.0], rtol=1e-6
    )


def test_top_p_always_keeps_at_least_one_token():
    probs = warp(HAND_LOGITS, SamplingParams(temperature=1.0, top_p=1e-9))
    np.testing.assert_array_equal(probs, [1.0, 0.0, 0.0, 0.0])


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # After top-k=3 the mass is 4/9, 7/9: 0.75 is reached by two tokens. Without the
    # renormalisation in between (0.4, 0.7) it would take three.
    probs = warp(HAND_LOGITS, SamplingParams(temperature=1.0, top_k=3, top_p=0.75))
    np.testing.assert_allclose(probs, [4 / 7, 3 / 7, 0.0, 0.0], rtol=1e-6)


def test_top_p_combined_with_temperature_matches_a_hand_computation():
    # T=2: weights sqrt(4,3,2,1) -> probs ~ (0.325, 0.282, 0.230, 0.163), cumulative
    # 0.325, 0.607, 0.837: top_p=0.65 needs three tokens (plain softmax would need two).
    w = np.sqrt([4.0, 3.0, 2.0, 1.0])
    expected = np.where(np.arange(4) < 3, w, 0.0)
    np.testing.assert_allclose(
        warp(HAND_LOGITS, SamplingParams(temperature=2.0, top_p=0.65)), expected / expected.sum(), rtol=1e-6
    )


def test_min_p_keeps_tokens_at_least_min_p_times_the_most_likely_and_renormalises():
    # probs 0.4, 0.3, 0.2, 0.1: min_p=0.5 keeps p >= 0.2 (the boundary token stays), 0.6 keeps p >= 0.24
    np.testing.assert_allclose(warp(HAND_LOGITS, SamplingParams(temperature=1.0, min_p=0.5)),
                               [4 / 9, 3 / 9, 2 / 9, 0.0], rtol=1e-6)
    np.testing.assert_allclose(warp(HAND_LOGITS, SamplingParams(temperature=1.0, min_p=0.6)),
                               [4 / 7, 3 / 7, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(warp(HAND_LOGITS, SamplingParams(temperature=1.0, min_p=1.0)), [1, 0, 0, 0])
    np.testing.assert_allclose(warp(HAND_LOGITS, SamplingParams(temperature=1.0, min_p=0.0)),
                               [0.4, 0.3, 0.2, 0.1], rtol=1e-6)


def test_min_p_applies_after_top_p_as_transformers_warpers_do():
    # top_p=0.75 keeps 0.4, 0.3, 0.2 (-> 4/9, 3/9, 2/9); min_p=0.3 then keeps p >= 0.3 * 4/9: all
    # three. min-p first (vLLM's order) would cut only 0.1 and top-p would then keep two tokens.
    np.testing.assert_allclose(warp(HAND_LOGITS, SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3)),
                               [4 / 9, 3 / 9, 2 / 9, 0.0], rtol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.9, min_p=0.05),
                                    SamplingParams(temperature=1.3, top_k=20, min_p=0.5),
                                    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.2)])
def test_min_p_matches_transformers_warper_chain(params):
    torch = pytest.importorskip("torch")
    from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)
    chain = [TemperatureLogitsWarper(params.temperature)]
    chain += [TopKLogitsWarper(params.top_k)] if params.top_k else []
    chain += [TopPLogitsWarper(params.top_p)] if params.top_p < 1 else []
    chain += [MinPLogitsWarper(params.min_p)]
    logits = np.random.default_rng(3).normal(0.0, 1.0, (8, 512)).astype(np.float32)
    scores = LogitsProcessorList(chain)(torch.zeros(1, 1, dtype=torch.long), torch.tensor(logits))
    theirs = scores.softmax(-1).numpy()
    for row, want in zip(logits, theirs):
        ours = warp(row, params)
        np.testing.assert_array_equal(ours > 0, want > 0)
        assert 0 < (ours > 0).sum() < (warp(row, SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                                                   top_p=params.top_p)) > 0).sum()
        np.testing.assert_allclose(ours, want, atol=1e-6)


def test_greedy_params_give_a_one_hot_row_on_the_first_argmax():
    logits = np.array([0.5, 2.0, -1.0, 2.0], dtype=np.float32)
    out = np.full(4, 7.0, np.float32)
    result = probs_from_logits(logits, SamplingParams(), out)
    assert result is out
    np.testing.assert_array_equal(out, [0.0, 1.0, 0.0, 0.0])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_logits_without_a_finite_max_are_refused(bad):
    logits = np.array([0.0, bad, 1.0], dtype=np.float32)
    with pytest.raises(ValueError, match="finite maximum"):
        warp(logits, SamplingParams(temperature=1.0))


def test_out_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match=r"out has shape \(3,\); expected \(4,\)"):
        probs_from_logits(HAND_LOGITS, SamplingParams(temperature=1.0), np.empty(3, np.float32))


# --- sample -------------------------------------------------------------------


def test_sample_never_returns_a_zero_probability_token_at_the_ends_of_u():
    probs = np.array([0.0, 0.5, 0.5, 0.0], dtype=np.float32)
    largest_u = 1.0 - 2.0**-53
    assert sample(probs, FixedRng(0.0)) == 1
    assert sample(probs, FixedRng(largest_u)) == 2
    # A row that sums to 1 + 1e-6 or 1 - 1e-6 (float32 rounding) behaves the same.
    for scale in (1 + 1e-6, 1 - 1e-6):
        assert sample(probs * scale, FixedRng(largest_u)) == 2
        assert sample(probs * scale, FixedRng(0.0)) == 1


def test_sample_maps_u_through_the_cdf():
    probs = np.array([0.25, 0.0, 0.75], dtype=np.float32)
    assert sample(probs, FixedRng(0.2499)) == 0
    assert sample(probs, FixedRng(0.25)) == 2
    assert sample(probs, FixedRng(0.9)) == 2


def test_sample_accumulates_in_float64_so_small_tokens_after_a_large_one_stay_reachable():
    # float32: 1 + 1e-8 == 1, so the tail's CDF would be flat and its tokens never drawn
    probs = np.concatenate([[1.0], np.full(1000, 1e-8)]).astype(np.float32)
    assert 0 < sample(probs, FixedRng(1 - 1e-7)) <= 1000


@pytest.mark.parametrize("probs", [np.zeros(4, np.float32), np.zeros(0, np.float32)], ids=["zeros", "empty"])
def test_sample_refuses_a_row_with_no_mass(probs):
    with pytest.raises(ValueError, match="positive finite mass"):
        sample(probs, np.random.default_rng(0))


# --- accept rule pieces -------------------------------------------------------


def test_draft_probability_zero_never_divides():
    assert accept_probability(0.3, 0.0) == 1.0
    assert accept_probability(0.0, 0.0) == 0.0
    assert accept_probability(np.float32(0.3), np.float32(0.0)) == 1.0
    # And inside the verifier: the target allows x but the draft's row says q(x) = 0.
    p = np.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=np.float32)
    q = np.array([[1.0, 0.0, 0.0]], dtype=np.float32)
    verdict = verify_sampled(p, q, np.array([1]), FixedRng(0.999, 0.5), np.empty(3, np.float32))
    assert verdict == Verdict(n_accepted=1, next_token=2, bonus=True)


def test_accept_probability_is_min_of_one_and_the_ratio():
    rng = np.random.default_rng(3)
    for p_x, q_x in rng.random((200, 2)):
        a = accept_probability(p_x, q_x)
        assert 0.0 <= a <= 1.0
        assert a == pytest.approx(min(1.0, p_x / q_x))
    assert accept_probability(0.2, 0.4) == pytest.approx(0.5)
    assert accept_probability(0.4, 0.2) == 1.0
    assert accept_probability(0.0, 0.4) == 0.0


def test_residual_is_the_normalised_positive_part_of_p_minus_q():
    p = np.array([0.5, 0.3, 0.2, 0.0], dtype=np.float32)
    q = np.array([0.2, 0.4, 0.1, 0.3], dtype=np.float32)
    out = np.empty(4, np.float32)
    result = residual_distribution(p, q, out)
    assert result is out
    np.testing.assert_allclose(out, [0.75, 0.0, 0.25, 0.0], rtol=1e-6)


def test_residual_that_sums_to_zero_falls_back_to_p():
    p = np.array([0.1, 0.6, 0.3], dtype=np.float32)
    out = np.full(3, np.nan, np.float32)
    with np.errstate(all="raise"):
        result = residual_distribution(p, p.copy(), out)
    assert result is out
    np.testing.assert_array_equal(out, p)


# --- verify_greedy / verify_sampled --------------------------------------------


def test_greedy_verify_accepts_all_and_adds_the_bonus_token():
    verdict = verify_greedy(np.array([5, 1, 4, 9]), np.array([5, 1, 4]))
    assert verdict == Verdict(n_accepted=3, next_token=9, bonus=True)


def test_greedy_verify_stops_at_the_first_mismatch_with_the_target_token():
    verdict = verify_greedy(np.array([5, 2, 4, 9]), np.array([5, 1, 4]))
    assert verdict == Verdict(n_accepted=1, next_token=2, bonus=False)
    verdict = verify_greedy(np.array([0, 1, 4, 9]), np.array([5, 1, 4]))
    assert verdict == Verdict(n_accepted=0, next_token=0, bonus=False)


def test_greedy_verify_with_no_draft_tokens_returns_the_bonus_from_position_zero():
    verdict = verify_greedy(np.array([7]), np.array([], dtype=np.int64))
    assert verdict == Verdict(n_accepted=0, next_token=7, bonus=True)


def test_sampled_verify_with_no_draft_tokens_samples_the_bonus_from_position_zero():
    p = np.array([[0.0, 0.0, 1.0, 0.0]], dtype=np.float32)
    q = np.empty((0, 4), np.float32)
    no_draft = np.array([], dtype=np.int64)
    verdict = verify_sampled(p, q, no_draft, np.random.default_rng(0), np.empty(4, np.float32))
    assert verdict == Verdict(n_accepted=0, next_token=2, bonus=True)


def test_sampled_verify_never_accepts_a_token_the_target_rules_out():
    p = np.array([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]], dtype=np.float32)
    q = np.array([[1.0, 0.0, 0.0]], dtype=np.float32)
    scratch = np.empty(3, np.float32)
    # u = 0.0 is the draw most willing to accept; it must still reject.
    verdict = verify_sampled(p, q, np.array([0]), FixedRng(0.0, 0.0), scratch)
    assert verdict == Verdict(n_accepted=0, next_token=1, bonus=False)
    rng = np.random.default_rng(1)
    for _ in range(200):
        verdict = verify_sampled(p, q, np.array([0]), rng, scratch)
        assert verdict.n_accepted == 0 and verdict.next_token in (1, 2)


def test_sampled_verify_on_one_hot_rows_matches_greedy_verify():
    # With greedy params both warps are one-hot, so the sampled rule must reduce to argmax matching.
    rng = np.random.default_rng(5)
    greedy = SamplingParams()
    k, v = 4, 5
    scratch = np.empty(v, np.float32)
    for _ in range(100):
        target_logits = rng.normal(size=(k + 1, v)).astype(np.float32)
        draft_logits = rng.normal(size=(k, v)).astype(np.float32)
        p = np.stack([warp(row, greedy) for row in target_logits])
        q = np.stack([warp(row, greedy) for row in draft_logits])
        # Draft tokens: mostly the target's argmax so long accepted runs occur too.
        draft = np.where(rng.random(k) < 0.7, target_logits[:k].argmax(1), draft_logits.argmax(1))
        q[np.arange(k)] = np.eye(v, dtype=np.float32)[draft]
        assert verify_sampled(p, q, draft, rng, scratch) == verify_greedy(target_logits.argmax(1), draft)


def test_sampled_verify_refuses_target_rows_without_the_bonus_position():
    # p must have k+1 rows even when q and the draft tokens agree with each other
    with pytest.raises(ValueError, match=r"expected p \[k\+1, V\]"):
        verify_sampled(
            np.full((2, 4), 0.25, np.float32),
            np.full((2, 4), 0.25, np.float32),
            np.array([0, 1]),
            np.random.default_rng(0),
            np.empty(4, np.float32),
        )


def test_sampled_verify_refuses_draft_tokens_that_are_not_one_row():
    p, q = np.full((3, 4), 0.25, np.float32), np.full((2, 4), 0.25, np.float32)
    with pytest.raises(ValueError, match=r"draft_tokens \[k\]"):
        verify_sampled(p, q, np.array([[0], [1]]), np.random.default_rng(0), np.empty(4, np.float32))


def test_sampled_verify_names_a_scratch_buffer_of_the_wrong_size():
    p, q = np.full((3, 4), 0.25, np.float32), np.full((2, 4), 0.25, np.float32)
    with pytest.raises(ValueError, match=r"^scratch has shape \(3,\); expected \(4,\)"):
        verify_sampled(p, q, np.array([0, 1]), np.random.default_rng(0), np.empty(3, np.float32))


def test_verifiers_refuse_mismatched_shapes():
    with pytest.raises(ValueError, match=r"expected \[k\+1\] and \[k\]"):
        verify_greedy(np.array([1, 2]), np.array([1, 2]))
    with pytest.raises(ValueError, match=r"expected p \[k\+1, V\], q \[k, V\]"):
        verify_sampled(
            np.full((3, 4), 0.25, np.float32),
            np.full((3, 4), 0.25, np.float32),
            np.array([0, 1]),
            np.random.default_rng(0),
            np.empty(4, np.float32),
        )


# --- issue 16: inputs at the edges -------------------------------------------------


@pytest.mark.parametrize("t", [1e-46, 1e-300, 5e-324])
def test_a_temperature_below_float32s_smallest_subnormal_concentrates_on_the_maxima_not_nan(t):
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        probs = warp(HAND_LOGITS, SamplingParams(temperature=t))
        tied = warp(np.array([1.0, 3.0, 3.0, -2.0], np.float32), SamplingParams(temperature=t))
    np.testing.assert_array_equal(probs, [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(tied, [0.0, 0.5, 0.5, 0.0])    # the limit t -> 0+ splits ties


def test_coerce_takes_params_a_mapping_or_none_and_names_what_it_refuses():
    p = SamplingParams(temperature=0.5, seed=3)
    assert SamplingParams.coerce(p) is p
    assert SamplingParams.coerce(None) == SamplingParams()
    assert SamplingParams.coerce({"temperature": 0.5, "seed": 3}) == p
    with pytest.raises(SamplingParamsError, match="temprature"):
        SamplingParams.coerce({"temprature": 0.5})
    with pytest.raises(SamplingParamsError, match="mapping"):
        SamplingParams.coerce("hot")
    with pytest.raises(SamplingParamsError, match="temperature"):
        SamplingParams.coerce({"temperature": -1.0})
