"""The batched policy's cost model on its own (policy.py): a draft round of k steps is charged
k draft steps on top of its verify pass, and a cost table measured at some row counts is
read at other counts by the documented rule (one count: in proportion to the rows; several:
linear between the nearest, the last segment extended beyond them). Pure arithmetic: the
expected rates are written out here from the module docstring's formulas."""
from __future__ import annotations

import pytest

from specrt.runtime.batch.policy import BatchCosts, BatchPolicy
from specrt.runtime.batch.request import Request, Row
from specrt.runtime.batch.policy import RoundKind
from specrt.runtime.sampling import SamplingParams

K_MAX = 3


def rows(policy: BatchPolicy, n: int, room: int = 50) -> list[Row]:
    return [Row(Request([1, 2, 3], room + 1, SamplingParams(), i), room + 1, None, policy.priors, K_MAX)
            for i in range(n)]


def verify_tokens(graph: str, tokens: int, n: int) -> int:
    return tokens                   # every T runs as asked: decode graphs of any T, verify windows of k + 1


def expected(a: float, k: int) -> float:
    """Tokens a round of k proposals emits in expectation: 1 + a + ... + a^k."""
    return sum(a ** i for i in range(k + 1))


def draft_rates(rs: list[Row], k_max: int, d: float, c: float) -> dict[int, float]:
    """{k: expected tokens per ms} of a draft round: k draft steps (d each) then one verify pass (c)."""
    return {k: sum(expected(r.accept["draft"].mean, min(k, r.room)) for r in rs) / (k * d + c)
            for k in range(1, k_max + 1)}


@pytest.mark.parametrize("d", [0.5, 3.0, 5.0])
def test_a_draft_round_of_k_steps_is_charged_k_draft_steps(d):
    """Flat target costs (10 ms whatever T and n), a draft step of d ms: the policy picks the k
    whose rate n E(a, k) / (k d + 10) is best and reports that rate. Cheap draft steps favour
    k_max, dear ones k = 1; a policy that charged one draft step whatever k would always take
    k_max, at a rate too high by (k d + 10) / (d + 10)."""
    costs = BatchCosts({T: {1: 10.0, 8: 10.0} for T in (1, 2, 3, 4)}, draft={1: d, 8: d})
    policy = BatchPolicy(costs, K_MAX, draft=True, priors={"draft": 0.8})
    rs = rows(policy, 2)
    want = draft_rates(rs, K_MAX, d, 10.0)
    best_k = max(want, key=want.get)
    got = policy.choose(rs, verify_tokens)
    assert (got.kind, got.k) == (RoundKind.DRAFT, best_k), (got, want)
    assert got.rate == pytest.approx(want[best_k], rel=1e-12), (got, want)
    assert got.tokens == best_k + 1


def test_the_chosen_k_moves_from_k_max_to_one_as_draft_steps_get_dearer():
    """The same rows, dearer and dearer draft steps: k never grows and passes through every
    value down to plain steps (one draft step charged whatever k would stay at k_max)."""
    ks = []
    for d in (0.25, 1.0, 2.0, 4.0, 6.0, 8.0):
        costs = BatchCosts({T: {1: 10.0, 8: 10.0} for T in (1, 2, 3, 4)}, draft={1: d, 8: d})
        got = BatchPolicy(costs, K_MAX, draft=True, priors={"draft": 0.8}).choose(
            rows(BatchPolicy(None, K_MAX), 2), verify_tokens)
        ks.append(got.k if got.kind is RoundKind.DRAFT else 0)
    assert ks == sorted(ks, reverse=True) and set(ks) == set(range(K_MAX + 1)), ks


def test_a_draft_dearer_than_what_it_saves_loses_to_plain_steps():
    costs = BatchCosts({T: {1: 10.0, 8: 10.0} for T in (1, 2, 3, 4)}, draft={1: 20.0, 8: 20.0})
    policy = BatchPolicy(costs, K_MAX, draft=True, priors={"draft": 0.8})
    rs = rows(policy, 3)
    got = policy.choose(rs, verify_tokens)
    assert max(draft_rates(rs, K_MAX, 20.0, 10.0).values()) < 3 / 10.0      # the arithmetic: plain pays more
    assert (got.kind, got.rate) == (RoundKind.PLAIN, pytest.approx(3 / 10.0)), got


def test_a_table_measured_at_one_row_count_scales_in_proportion_to_the_rows():
    c = BatchCosts({1: {4: 8.0}, 4: {4: 12.0}}, draft={2: 3.0})
    assert [c.target(n, 1) for n in (1, 2, 4, 8)] == [2.0, 4.0, 8.0, 16.0]
    assert [c.target(n, 4) for n in (1, 4, 6)] == [3.0, 12.0, 18.0]
    assert [c.draft(n) for n in (1, 2, 6)] == [1.5, 3.0, 9.0]


def test_a_table_measured_at_several_row_counts_interpolates_and_extends_its_last_segment():
    c = BatchCosts({1: {1: 10.0, 4: 16.0, 8: 20.0}}, draft={1: 2.0, 8: 9.0})
    assert c.target(4, 1) == 16.0                              # measured: as measured
    assert c.target(2, 1) == pytest.approx(12.0)               # 10 + (16 - 10) * (2 - 1) / (4 - 1)
    assert c.target(6, 1) == pytest.approx(18.0)               # between 4 and 8
    assert c.target(16, 1) == pytest.approx(28.0)              # beyond 8: the 4..8 slope, 1 ms a row
    assert c.draft(4) == pytest.approx(5.0)                    # 2 + 7 * 3 / 7
    assert c.draft(12) == pytest.approx(13.0)                  # beyond 8: 1 ms a row


def test_the_policy_charges_a_draft_measured_at_one_row_for_every_row_it_runs():
    """Target and draft measured at different single row counts, four rows running: the draft
    round costs k d(4) + c(4) with d(4) = 4 d(1) and c(4) = c(2) * 2."""
    costs = BatchCosts({T: {2: 10.0} for T in (1, 2, 3, 4)}, draft={1: 1.0})
    policy = BatchPolicy(costs, K_MAX, draft=True, priors={"draft": 0.8})
    rs = rows(policy, 4)
    want = draft_rates(rs, K_MAX, 4.0, 20.0)
    best_k = max(want, key=want.get)
    got = policy.choose(rs, verify_tokens)
    assert (got.kind, got.k) == (RoundKind.DRAFT, best_k) and got.rate == pytest.approx(want[best_k], rel=1e-12), \
        (got, want)


@pytest.mark.parametrize("guess,emitted,observed", [
    ([5, 6, 7, 8], [5, 6, 9], (4, 2)),           # differs at the third: 2 kept, then a rejection
    ([5, 6, 7, 8], [4], (4, 0)),                 # differs at the first
    ([5, 6, 7, 8], [5, 6, 7, 8, 9], (4, 4)),     # all of it, with a token to spare
    ([5, 6, 7, 8], [5, 6], (2, 2)),              # agrees with all that was emitted: at least 2
    ([5, 6], [5, 6], (2, 2)),
])
def test_an_unverified_lookup_guess_is_scored_against_what_the_row_emitted(guess, emitted, observed):
    """policy.observe_guess: lookup would have kept the guess's prefix that equals the emitted
    tokens (a row's tokens do not depend on the round), so that is what its estimate sees."""
    import numpy as np
    policy = BatchPolicy(None, 4)
    row = rows(policy, 1)[0]
    seen = []
    row.accept["lookup"].observe = lambda k, a: seen.append((k, a))
    row.unverified = np.array(guess, np.int64)
    policy.observe_guess(row, emitted)
    assert seen == [observed] and len(row.unverified) == 0
    policy.observe_guess(row, emitted)           # scored once
    assert seen == [observed]


def test_a_new_row_starts_from_every_row_s_verdicts_scaled_to_a_few_rounds():
    """policy.row_accept: the pooled estimate's mean and its per-position structure, with at
    most ROW_WEIGHT rounds of evidence, so a row's own verdicts soon outweigh it. Before any
    verdict it is the build's prior, as a fresh row's was."""
    from specrt.runtime.batch.policy import ROW_WEIGHT
    from specrt.runtime.costs import Acceptance
    policy = BatchPolicy(None, 4, priors={"draft": 0.9})
    fresh = Acceptance(0.9, 4.0, 0.9)
    first = policy.row_accept()["draft"]
    assert (first.successes, first.failures, first.mean) == pytest.approx((fresh.successes, fresh.failures, fresh.mean))
    r = rows(policy, 1)[0]
    for _ in range(60):                  # rounds of 4: the first two kept, the third rejected
        policy.observe(r, RoundKind.DRAFT, 4, 2)
    pooled, new = policy.pooled["draft"], policy.row_accept()["draft"]
    assert new.successes + new.failures == pytest.approx(ROW_WEIGHT)
    assert new.successes / new.failures == pytest.approx(pooled.successes / pooled.failures)
    assert new.at(2) < 0.5 < new.at(1)           # the position that fails, from the pooled evidence
    assert pooled.at(2) < new.at(2) and fresh.at(2) > 0.8      # (scaled down: nearer the row's mean)
    assert BatchPolicy(None, 4, pooled=policy.pooled).pooled is policy.pooled   # a batch of one's requests share it
    assert policy.row_accept()["lookup"].mean == pytest.approx(Acceptance(0.5, 4.0, 0.9).mean)   # lookup: its prior


def test_the_engine_starts_each_request_from_the_pooled_estimates(tiny_batch_rows_engines, monkeypatch):
    """A second request's row begins where the policy's pooled estimate of the draft is (here
    made to say the draft is never right), not at the build's prior; prompt lookup's at its
    prior (0.5)."""
    from specrt.runtime.batch.generator import open_batch
    from specrt.runtime.costs import Acceptance
    with open_batch(tiny_batch_rows_engines, max_num_seqs=1) as g:
        pol = g.engine.policy
        pol.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)})
        wrong = Acceptance(0.5, 0.0, 0.98)
        wrong.failures = 50.0
        pol.pooled["draft"] = wrong
        seen = []
        choose = pol.choose
        monkeypatch.setattr(pol, "choose", lambda rs, t: seen.append(
            (rs[0].accept["draft"].mean, rs[0].accept["lookup"].mean)) or choose(rs, t))
        g.generate("a b a b a b a b", max_new_tokens=4)
    assert seen and seen[0][0] < 0.2 and seen[0][1] == pytest.approx(0.5), seen
