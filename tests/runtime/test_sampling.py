"""Tests for specrt.runtime.sampling: params validation, the logit warp, and the greedy verdict.
The sampled accept rule is runtime/choice.py: test_choice.py, and its exactness over many
draws test_accept_rule_exactness.py."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from specrt.errors import SamplingParamsError
from specrt.runtime.sampling import SamplingParams, probs_from_logits

# probs [0.4, 0.3, 0.2, 0.1] at temperature 1: easy to check by hand.
HAND_LOGITS = np.log(np.array([4.0, 3.0, 2.0, 1.0], dtype=np.float32))


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    return probs_from_logits(logits, params, np.empty(logits.shape[0], np.float32))


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


# --- the greedy verdict: the accept rule (runtime/choice.py) at temperature 0 -----------------

def _verdict(argmax, draft):
    """(accepted, next token) of first_mismatch over one-hot rows at `argmax`."""
    from specrt.runtime.choice import first_mismatch
    logits = np.full((len(argmax), 10), -1.0, np.float32)
    logits[np.arange(len(argmax)), argmax] = 1.0
    return first_mismatch(logits, np.array(draft, np.int64), SamplingParams(), 0, 0, np.zeros(10, np.float32))


def test_greedy_verify_accepts_all_and_adds_the_bonus_token():
    assert _verdict([5, 1, 4, 9], [5, 1, 4]) == (3, 9)


def test_greedy_verify_stops_at_the_first_mismatch_with_the_target_token():
    assert _verdict([5, 2, 4, 9], [5, 1, 4]) == (1, 2)
    assert _verdict([0, 1, 4, 9], [5, 1, 4]) == (0, 0)


def test_greedy_verify_with_no_draft_tokens_returns_the_bonus_from_position_zero():
    assert _verdict([7], []) == (0, 7)


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
