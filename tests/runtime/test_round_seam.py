"""The proposer seam and the one round skeleton (runtime/loop.py, runtime/proposers/):
every proposer implements one protocol, a new proposer needs no change to the loop, and
the state each round leaves behind (the position and seed it verified with, a draft's own
cache, the adaptive policy's estimate) is the right one."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specrt.errors import SamplingParamsError
from specrt.runtime import SamplingParams, SpeculativeGenerator
from specrt.runtime import rounds as rounds_mod
from specrt.runtime.adaptive import AdaptiveK, StepCosts
from specrt.runtime.loop import FixedDraft, decode
from specrt.runtime.methods import Method
from specrt.runtime.metrics import Metrics
from specrt.runtime.ngrams import NgramTable
from specrt.runtime.proposers import Chain, OneGram, PromptLookup, Proposal, Proposer, ProposerStats, TableGuess
from specrt.runtime.rounds import prefill

PROMPT = [5, 9, 17, 33, 2, 5, 9, 17, 40, 41]


@pytest.fixture(scope="module")
def trunc(tiny_truncated_engines):
    """The tiny target with its own first two layers as draft (its own cache; drafts both
    accepted and rejected)."""
    return SpeculativeGenerator(tiny_truncated_engines)


def test_every_proposer_implements_the_protocol(trunc):
    table = NgramTable({1: {(3,): 4}})
    for p in (trunc.drafter, PromptLookup(2, 4), OneGram(), TableGuess(table), Chain([OneGram(), TableGuess(table)])):
        assert isinstance(p, Proposer), p
        assert isinstance(p.stats, ProposerStats)
    assert list(TableGuess(table).propose([1, 3], 1).tokens) == [4]
    assert len(TableGuess(table).propose([1, 2], 1)) == 0
    assert list(Chain([OneGram(), TableGuess(table)]).propose([7, 3], 1).tokens) == [4]   # no 1-gram: the table


def test_methods_are_an_enum_that_says_what_each_needs():
    assert Method.parse("lookup") is Method.LOOKUP and Method.LOOKUP.greedy_only
    assert Method.SPECULATIVE.needs_draft and not Method.PLAIN.needs_draft
    assert set(Method.LOOKUP.target_graphs) == {"decode", "verify"}
    with pytest.raises(SamplingParamsError, match="choose one of"):
        Method.parse("beam")


class Oracle:
    """A proposer that knows the answer: one more file is all a new proposer needs."""
    name = "oracle"

    def __init__(self, answer: list[int], prompt_len: int):
        self.answer, self.at0 = answer, prompt_len
        self.stats = ProposerStats()

    def begin(self, prompt, params=None, seed=0):
        pass

    def propose(self, seq, k):
        i = len(seq) - self.at0               # tokens of the answer already in seq
        return Proposal(np.asarray(self.answer[i:i + k], np.int64))

    def accept(self, n):
        pass

    def end(self, committed):
        pass


def test_a_new_proposer_plugs_into_the_loop_without_changing_it(trunc):
    plain = [e.token for e in trunc.tokens(PROMPT, max_new_tokens=24, method="plain")]
    oracle = Oracle(plain, len(PROMPT))
    assert isinstance(oracle, Proposer)
    first = prefill(trunc.target, trunc.manifest.target.graphs["prefill"].tokens, PROMPT)
    m = Metrics(k=trunc.k)
    got = [e.token for e in decode(trunc.target, FixedDraft(oracle), first, len(PROMPT), 24, SamplingParams(), 0,
                                   trunc.ws, m, seq=list(PROMPT))]
    assert got == plain
    assert m.accepted == m.drafted and m.iterations < 24 / trunc.k + 2      # every guess kept: k+1 tokens a round
    assert oracle.stats.accepted == oracle.stats.proposed == m.accepted


class Scripted:
    """A policy that plays a fixed cycle of rounds (in place of AdaptiveK)."""

    def __init__(self, script):
        self.script, self.i = list(script), 0

    def choose(self, budget_k=None, lookup_len=0, pair=False, draft=True):
        how, k = self.script[self.i % len(self.script)]
        self.i += 1
        k = min(k, budget_k or 0)
        if how == "lookup":
            k = min(k, lookup_len)
        return (how, k) if k else ("plain", 0)

    def observe(self, how, k, accepted):
        pass


def test_a_lookup_round_after_a_draft_round_verifies_with_the_same_rule(trunc, monkeypatch):
    """Proposals carry tokens only, so nothing of a draft round (its distributions) can reach the
    next guess's verification: every sampled round, draft, lookup or plain, is verified by the
    one rule (choice.first_mismatch) with the request's seed at the position of its first new
    token, and those positions follow the emitted text."""
    assert [f.name for f in dataclasses.fields(Proposal)] == ["tokens"]
    calls = []
    real = rounds_mod.first_mismatch

    def spy(logits, proposal, params, seed, position, scratch):
        n, nxt = real(logits, proposal, params, seed, position, scratch)
        calls.append((len(proposal), seed, position, n))
        return n, nxt

    monkeypatch.setattr(rounds_mod, "first_mismatch", spy)
    monkeypatch.setattr(trunc, "_policy", lambda: Scripted([("draft", 3), ("lookup", 3)]))
    prompt = PROMPT * 3                                   # text that repeats: lookup has guesses
    looked = drafted = 0
    for seed in (0, 1, 7, 2**40 + 3, 2**62 + 5, 99):
        calls.clear()
        sp = SamplingParams(temperature=1.0, seed=seed)
        toks = [e.token for e in trunc.tokens(prompt, max_new_tokens=30, sampling=sp, ngram=1)]
        m = trunc.last_metrics
        assert len(calls) == m.iterations, (len(calls), m.as_dict())      # one verification a target pass
        at = len(prompt) + 1            # the first token, at len(prompt), came from the prefill's row
        for k, s, position, n in calls:
            assert (s, position) == (seed, at), (calls, seed)
            at += n + 1
        assert calls[-1][2] < len(prompt) + len(toks) <= at
        looked += m.lookup_rounds
        drafted += sum(k > 0 for k, *_ in calls) - m.lookup_rounds
    assert looked > 0 and drafted > 0, (looked, drafted)


def test_the_drafts_own_cache_after_mixed_rounds_holds_what_a_fresh_prefill_writes(trunc, tiny_truncated_engines):
    """After every round the draft's valid rows are K/V of the text itself, never of a rejected
    guess: a length left too long would make later rounds skip the catch-up and read stale rows."""
    ref = SpeculativeGenerator(tiny_truncated_engines, methods=("speculative",))
    T = trunc.manifest.draft.graphs["prefill"].tokens
    seq, checked, rejected = list(PROMPT), 0, 0
    for e in trunc.tokens(PROMPT, max_new_tokens=40, method="speculative"):
        seq.append(e.token)
        if e.from_draft:
            continue                                   # mid-round: check at the end of a round
        L = trunc.drafter.length
        assert L <= len(seq) - 1
        if L > len(PROMPT) and L > checked:
            prefill(ref.draft, T, seq[:L])
            for mine, fresh in zip(trunc.draft.cache.keys + trunc.draft.cache.values,
                                   ref.draft.cache.keys + ref.draft.cache.values):
                np.testing.assert_allclose(mine[0, :, :L], fresh[0, :, :L], atol=1e-4, rtol=1e-4)
            checked = L
    m = trunc.last_metrics
    rejected = m.drafted - m.accepted
    assert checked > len(PROMPT) + 10 and rejected > 0, (checked, m.as_dict())


def test_the_adaptive_estimate_recovers_within_a_few_good_rounds():
    """Old rejections are forgotten: after a long run of rejected drafts, eight fully accepted
    rounds bring the draft back (an estimate that never forgets would stay on plain steps)."""
    costs = StepCosts(decode=1.0, verify=1.3, draft=0.15)
    p = AdaptiveK(costs, 4, prior=0.8)
    for _ in range(100):
        p.observe("draft", 4, 0)
    assert p.choose(4)[0] == "plain"
    for _ in range(8):
        p.observe("draft", 4, 4)
    assert p.draft.mean > 0.75 and p.choose(4)[0] == "draft", p.draft.mean
