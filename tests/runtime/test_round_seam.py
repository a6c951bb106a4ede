"""The proposer seam and the one round skeleton (runtime/batch/engine.py, runtime/proposers/),
here on a folder's one-row graphs as the batch of one runs them: every guesser implements one
protocol, a new one needs no change to the engine, and the state each round leaves behind (the
position and seed it verified with, a draft's own cache, the policy's estimate) is the right one."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from specrt.errors import SamplingParamsError
from specrt.runtime import SamplingParams, SpeculativeGenerator
from specrt.runtime.batch import engine as engine_mod
from specrt.runtime.batch.one_row import prefill
from specrt.runtime.batch.policy import BatchCosts, BatchPolicy, RoundKind, StepChoice
from specrt.runtime.batch.request import Delta, Request, Row
from specrt.runtime.costs import StepCosts
from specrt.runtime.methods import Method
from specrt.runtime.ngrams import NgramTable
from specrt.runtime.proposers import Chain, OneGram, PromptLookup, Proposal, Proposer, TableGuess

PROMPT = [5, 9, 17, 33, 2, 5, 9, 17, 40, 41]


@pytest.fixture(scope="module")
def trunc(tiny_truncated_engines):
    """The tiny target with its own first two layers as draft (its own cache; drafts both
    accepted and rejected)."""
    return SpeculativeGenerator(tiny_truncated_engines)


def test_every_proposer_implements_the_protocol(trunc):
    table = NgramTable({1: {(3,): 4}})
    for p in (PromptLookup(2, 4), OneGram(), TableGuess(table), Chain([OneGram(), TableGuess(table)])):
        assert isinstance(p, Proposer), p
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
    """A guesser that knows the answer: one more file is all a new proposer needs."""
    name = "oracle"

    def __init__(self, answer: list[int], prompt_len: int):
        self.answer, self.at0 = answer, prompt_len
        self.proposed = 0

    def propose(self, seq, k):
        i = len(seq) - self.at0               # tokens of the answer already in seq
        got = np.asarray(self.answer[i:i + k], np.int64)
        self.proposed += len(got)
        return Proposal(got)


def _drive(gen, policy, prompt, n, sampling=None, seed=0):
    """A request on the generator's engine under `policy`: (tokens, metrics)."""
    eng = gen.one.engine
    eng.policy = policy
    events = list(eng.drive(Request(list(prompt), n, sampling or SamplingParams(), seed)))
    return [t for ev in events if isinstance(ev, Delta) for t in ev.tokens], events[-1].metrics


def test_a_new_proposer_plugs_into_the_engine_without_changing_it(trunc):
    plain = [e.token for e in trunc.tokens(PROMPT, max_new_tokens=24, method="plain")]
    oracle = Oracle(plain, len(PROMPT))
    assert isinstance(oracle, Proposer)
    got, m = _drive(trunc, BatchPolicy(None, trunc.k, lookup=oracle, fixed=True), PROMPT, 24)
    assert got == plain
    assert m.accepted == m.drafted == oracle.proposed and m.iterations < 24 / trunc.k + 2   # k+1 tokens a round


class Scripted(BatchPolicy):
    """A policy that plays a fixed cycle of rounds: a draft round of k, then a lookup round."""

    def __init__(self, k: int, lookup):
        super().__init__(None, k, lookup=lookup, draft=True, priors={"draft": 0.5})
        self.i = 0

    def choose(self, rows, graph_t):
        (row,) = rows
        room = max(min(self.k_max, row.room), 0)
        self.i += 1
        if self.i % 2 and room:
            return StepChoice(RoundKind.DRAFT, graph_t("verify", self.k_max + 1, 1), [np.zeros(0, np.int64)],
                              k=self.k_max)
        guess = self.lookup.propose(row.seq, room).tokens.copy() if room else np.zeros(0, np.int64)
        if len(guess):
            return StepChoice(RoundKind.LOOKUP, graph_t("verify", 1 + len(guess), 1), [guess])
        return StepChoice(RoundKind.PLAIN, graph_t("decode", 1, 1), [np.zeros(0, np.int64)])


def test_a_lookup_round_after_a_draft_round_verifies_with_the_same_rule(trunc, monkeypatch):
    """Proposals carry tokens only, so nothing of a draft round (its distributions) can reach the
    next guess's verification: every sampled round, draft, lookup or plain, is verified by the
    one rule (choice.first_mismatch) with the request's seed at the position of its first new
    token, and those positions follow the emitted text."""
    assert [f.name for f in dataclasses.fields(Proposal)] == ["tokens"]
    calls = []
    real = engine_mod.first_mismatch

    def spy(logits, proposal, params, seed, position, scratch):
        n, nxt = real(logits, proposal, params, seed, position, scratch)
        calls.append((len(proposal), seed, position, n))
        return n, nxt

    monkeypatch.setattr(engine_mod, "first_mismatch", spy)
    prompt = PROMPT * 3                                   # text that repeats: lookup has guesses
    looked = drafted = 0
    for seed in (0, 1, 7, 2**40 + 3, 2**62 + 5, 99):
        calls.clear()
        sp = SamplingParams(temperature=1.0, seed=seed)
        toks, m = _drive(trunc, Scripted(trunc.k, PromptLookup(1, trunc.k)), prompt, 30, sp, seed)
        # one verification a target pass, and one of the prefill's last row (the first token)
        assert len(calls) == m.iterations + 1, (len(calls), m.as_dict())
        at = len(prompt)                # the first token, at len(prompt), from the prefill's row
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
    eng = trunc.one.engine
    for e in trunc.tokens(PROMPT, max_new_tokens=40, method="speculative", adaptive=False):
        seq.append(e.token)
        if e.from_draft or not eng.rows:
            continue                                   # mid-round: check at the end of a round
        L = eng.rows[0].draft_len
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
    c = StepCosts(decode=1.0, verify=1.3, draft=0.15)
    p = BatchPolicy(BatchCosts({1: {1: c.decode}, 5: {1: c.verify}}, {1: c.draft}), 4, draft=True,
                    priors={"draft": 0.8})
    row = Row(Request([1, 2, 3], 64, SamplingParams(), 0), 64, None, p.priors, 4)

    def choose():
        row.plain_run = 0                          # no probe: the estimate alone decides
        return p.choose([row], lambda graph, want, n: 1 if graph == "decode" else 5).kind
    for _ in range(100):
        p.observe(row, RoundKind.DRAFT, 4, 0)
    assert choose() is RoundKind.PLAIN
    for _ in range(8):
        p.observe(row, RoundKind.DRAFT, 4, 4)
    assert row.accept["draft"].mean > 0.75 and choose() is RoundKind.DRAFT, row.accept["draft"].mean
