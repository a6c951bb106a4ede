"""Sampling is lossless end to end: tokens from the speculative generator (ONNX graphs,
draft proposals, accept rule, KV rewinds) follow the target's warped distribution.

The exact distribution of the first three generated tokens is enumerated with the
Hugging Face target (prefixes with nonzero warped probability only) and compared with
N seeded generations by a chi-square test (cells with expected count < 5 pooled) and a
total-variation bound. The same check with a deliberately wrong accept rule must fail,
which shows the test can tell.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from scipy.stats import chisquare

from specrt.runtime import SamplingParams, SpeculativeGenerator
from specrt.runtime import loop as loop_mod
from specrt.runtime.sampling import Verdict, probs_from_logits, sample

PROMPT = [40, 50, 60, 70]
N = 3000
PARAMS = dict(temperature=1.5, top_k=4, top_p=0.95)   # all three warps, on p and q alike


def exact_distribution(target_dir, params: SamplingParams, depth: int = 3) -> dict[tuple, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    dist = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, pr in dist.items():
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].numpy().astype(np.float32)
            p = probs_from_logits(logits, params, np.zeros_like(logits))
            for t in np.flatnonzero(p):
                nxt[prefix + (int(t),)] = pr * float(p[t])
        dist = nxt
    return dist


def sample_sequences(gen: SpeculativeGenerator, n: int) -> Counter:
    counts = Counter()
    for seed in range(n):
        sp = SamplingParams(**PARAMS, seed=seed)
        counts[tuple(e.token for e in gen.tokens(PROMPT, max_new_tokens=3, sampling=sp))] += 1
    return counts


def goodness_of_fit(exact: dict, counts: Counter, n: int) -> tuple[float, float, float]:
    """Returns (chi-square p-value, total variation, TV bound)."""
    keys = sorted(exact, key=exact.get, reverse=True)
    exp = np.array([exact[k] * n for k in keys])
    obs = np.array([counts.get(k, 0) for k in keys], dtype=float)
    outside = n - obs.sum()                       # sequences the target gives probability 0
    big = exp >= 5
    e = np.append(exp[big], exp[~big].sum())
    o = np.append(obs[big], obs[~big].sum() + outside)
    if e[-1] < 5:                                 # fold a small pooled cell into the last big one
        e[-2] += e[-1]
        o[-2] += o[-1]
        e, o = e[:-1], o[:-1]
    p = chisquare(o, e * o.sum() / e.sum()).pvalue if outside == 0 else 0.0
    tv = 0.5 * (np.abs(obs / n - exp / n).sum() + outside / n)
    # E[TV] <= 0.5 * sqrt(cells / n); plus a McDiarmid deviation term at delta = 1e-6
    bound = 0.5 * math.sqrt(len(keys) / n) + math.sqrt(math.log(1e6) / (2 * n))
    return p, tv, bound


@pytest.fixture(scope="module")
def setup(tiny_truncated_engines, tiny_pair):
    gen = SpeculativeGenerator(tiny_truncated_engines)
    exact = exact_distribution(tiny_pair[0], SamplingParams(**PARAMS))
    assert abs(sum(exact.values()) - 1) < 1e-5
    return gen, exact


def test_speculative_sampling_follows_the_target_distribution(setup):
    gen, exact = setup
    counts = sample_sequences(gen, N)
    p, tv, bound = goodness_of_fit(exact, counts, N)
    assert p > 1e-3, (p, tv, bound)
    assert tv < bound, (tv, bound)
    assert len(exact) >= 20, len(exact)


def test_plain_sampling_follows_the_target_distribution(setup):
    gen, exact = setup
    counts = Counter()
    for seed in range(N // 2):
        sp = SamplingParams(**PARAMS, seed=seed)
        counts[tuple(e.token for e in gen.tokens(PROMPT, max_new_tokens=3, sampling=sp, method="plain"))] += 1
    p, tv, bound = goodness_of_fit(exact, counts, N // 2)
    assert p > 1e-3 and tv < bound, (p, tv, bound)


def test_drafts_are_both_accepted_and_rejected_under_sampling(setup):
    gen, _ = setup
    acc = drafted = 0
    for seed in range(200):
        list(gen.tokens(PROMPT, max_new_tokens=3, sampling=SamplingParams(**PARAMS, seed=seed)))
        acc += gen.last_metrics.accepted
        drafted += gen.last_metrics.drafted
    # the check means something only if drafts are both accepted and rejected
    assert 0.1 < acc / drafted < 0.9, acc / drafted


def _always_accept(p, q, draft_tokens, rng, scratch):
    k = len(draft_tokens)
    return Verdict(k, sample(p[k], rng), True)


def _resample_from_p(p, q, draft_tokens, rng, scratch):
    for i, x in enumerate(draft_tokens):
        if rng.random() >= min(1.0, p[i, x] / max(q[i, x], 1e-30)):
            return Verdict(i, sample(p[i], rng), False)   # wrong: should be the residual
    return Verdict(len(draft_tokens), sample(p[len(draft_tokens)], rng), True)


@pytest.mark.parametrize("wrong", [_always_accept, _resample_from_p])
def test_a_wrong_accept_rule_fails_the_same_check(setup, monkeypatch, wrong):
    gen, exact = setup
    monkeypatch.setattr(loop_mod, "verify_sampled", wrong)
    counts = sample_sequences(gen, N)
    p, tv, bound = goodness_of_fit(exact, counts, N)
    passes = p > 1e-3 and tv < bound
    assert not passes and p < 1e-6, (p, tv, bound)
