"""Exactness of the accept rule on its own: a small speculative decoder over fixed random
Markov chains (target p, deliberately different draft q) must emit tokens that follow
the target distribution (chi-square goodness of fit and a total-variation bound); two
deliberately wrong rules must fail the same check. All randomness is seeded, so every
statistic here is deterministic. (The same check through the ONNX generator is in
test_sampling_exact.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from goodness_of_fit import P_VALUE_CEILING, P_VALUE_FLOOR, Fit, goodness_of_fit

from specrt.runtime.sampling import (
    SamplingParams,
    Verdict,
    accept_probability,
    probs_from_logits,
    sample,
    verify_sampled,
)


def warp(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    return probs_from_logits(logits, params, np.empty(logits.shape[0], np.float32))


# --- a speculative decoder over Markov chains ------------------------------------
V = 6
K = 3
START = 0
N_TOKENS = 4  # joint of tokens 1-2 (accepted / recovered paths) and token 4 (bonus path)
Rule = Callable[[np.ndarray, np.ndarray, np.ndarray, np.random.Generator, np.ndarray], Verdict]


def markov_chains(params: SamplingParams, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Target P and draft Q [V, V]: row a is the warped next-token distribution after token a.

    Draft logits are the target's plus N(0, 1.5^2) noise: close enough that all K
    draft tokens are often accepted (the bonus path runs), far enough that the
    draft's own distribution is plainly not the target's.
    """
    rng = np.random.default_rng(seed)
    target_logits = rng.normal(0.0, 1.5, (V, V)).astype(np.float32)
    draft_logits = target_logits + rng.normal(0.0, 1.5, (V, V)).astype(np.float32)
    p = np.stack([warp(row, params) for row in target_logits])
    q = np.stack([warp(row, params) for row in draft_logits])
    return p, q


@dataclass
class Run:
    tokens: np.ndarray  # [n, N_TOKENS]
    steps: int
    recovered: int
    bonus: int


def speculate(p_chain: np.ndarray, q_chain: np.ndarray, rule: Rule, n: int, seed: int) -> Run:
    """Emit the first N_TOKENS tokens after START, n times, k=K draft tokens per step."""
    rng = np.random.default_rng(seed)
    scratch = np.empty(V, np.float32)
    tokens = np.empty((n, N_TOKENS), np.int64)
    steps = recovered = bonus = 0
    for s in range(n):
        emitted: list[int] = []
        last = START
        while len(emitted) < N_TOKENS:
            context = [last]
            for _ in range(K):
                context.append(sample(q_chain[context[-1]], rng))
            draft = np.array(context[1:])
            # Verify position i sees prefix + draft[:i], whose last token is context[i].
            verdict = rule(p_chain[context], q_chain[context[:K]], draft, rng, scratch)
            emitted.extend(context[1 : 1 + verdict.n_accepted])
            emitted.append(verdict.next_token)
            last = emitted[-1]
            steps += 1
            bonus += verdict.bonus
            recovered += not verdict.bonus
        tokens[s] = emitted[:N_TOKENS]
    return Run(tokens, steps, recovered, bonus)


def exact_target(p_chain: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact joint of tokens (1, 2) [V*V] and marginal of token 4 [V] under the target chain."""
    p64 = p_chain.astype(np.float64)
    p64 /= p64.sum(axis=1, keepdims=True)  # sample() draws from each row scaled by its own sum
    joint12 = (p64[START][:, None] * p64).ravel()
    marginal4 = np.linalg.matrix_power(p64, N_TOKENS)[START]
    return joint12, marginal4


def fits(run: Run, p_chain: np.ndarray) -> tuple[Fit, Fit]:
    joint12, marginal4 = exact_target(p_chain)
    t = run.tokens
    return (goodness_of_fit(np.bincount(t[:, 0] * V + t[:, 1], minlength=V * V), joint12),
            goodness_of_fit(np.bincount(t[:, 3], minlength=V), marginal4))


def always_accept(p, q, draft_tokens, rng, scratch) -> Verdict:
    """Wrong: keeps every draft token, so output follows q."""
    k = draft_tokens.shape[0]
    return Verdict(n_accepted=k, next_token=sample(p[k], rng), bonus=True)


def resample_from_p(p, q, draft_tokens, rng, scratch) -> Verdict:
    """Wrong: draws the recovered token from p instead of the residual, double-counting min(p, q)."""
    for i, x in enumerate(draft_tokens):
        if rng.random() < accept_probability(float(p[i, x]), float(q[i, x])):
            continue
        return Verdict(n_accepted=i, next_token=sample(p[i], rng), bonus=False)
    return Verdict(n_accepted=len(draft_tokens), next_token=sample(p[-1], rng), bonus=True)


# (params, chain seed): both warps are non-trivial and cut part of the vocabulary.
EXACTNESS_CASES = [
    pytest.param(SamplingParams(temperature=0.7, top_p=0.9), 1, id="T0.7-top_p0.9"),
    pytest.param(SamplingParams(temperature=1.3, top_k=4, top_p=0.95), 1, id="T1.3-top_k4-top_p0.95"),
    pytest.param(SamplingParams(temperature=1.3, min_p=0.2), 1, id="T1.3-min_p0.2"),
]
N_EXACT = 30_000
N_WRONG = 10_000


@pytest.mark.parametrize(("params", "chain_seed"), EXACTNESS_CASES)
def test_speculative_sampling_reproduces_the_target_distribution(params, chain_seed):
    p_chain, q_chain = markov_chains(params, chain_seed)
    joint12, _ = exact_target(p_chain)
    q_joint12, _ = exact_target(q_chain)
    # The setup must be able to catch mistakes: draft far off, the warp cut tokens, many cells.
    assert 0.5 * np.abs(joint12 - q_joint12).sum() > 0.3
    assert (p_chain == 0).any() and (q_chain == 0).any()
    assert (joint12 > 0).sum() >= 12

    run = speculate(p_chain, q_chain, verify_sampled, N_EXACT, seed=1234)
    # Both endings of a step ran often: recovered tokens (rejections) and bonus tokens.
    assert run.recovered > 0.05 * run.steps and run.bonus > 0.05 * run.steps

    for fit in fits(run, p_chain):
        assert fit.outside_support == 0
        assert fit.p_value > P_VALUE_FLOOR, fit
        assert fit.tv < fit.tv_bound, fit


@pytest.mark.parametrize(
    "wrong_rule",
    [pytest.param(always_accept, id="always-accept"), pytest.param(resample_from_p, id="resample-from-p")],
)
def test_a_wrong_accept_rule_fails_the_exactness_check(wrong_rule):
    params, chain_seed = EXACTNESS_CASES[0].values
    p_chain, q_chain = markov_chains(params, chain_seed)
    joint_fit, _ = fits(speculate(p_chain, q_chain, wrong_rule, N_WRONG, seed=1234), p_chain)
    assert joint_fit.p_value < P_VALUE_CEILING, joint_fit
    assert joint_fit.tv > 2 * joint_fit.tv_bound, joint_fit


def test_a_fixed_seed_gives_identical_tokens():
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=42)
    p_chain, q_chain = markov_chains(params, 1)
    first = speculate(p_chain, q_chain, verify_sampled, 300, seed=params.seed)
    second = speculate(p_chain, q_chain, verify_sampled, 300, seed=params.seed)
    other = speculate(p_chain, q_chain, verify_sampled, 300, seed=params.seed + 1)
    np.testing.assert_array_equal(first.tokens, second.tokens)
    assert (first.steps, first.recovered, first.bonus) == (second.steps, second.recovered, second.bonus)
    assert not np.array_equal(first.tokens, other.tokens)
