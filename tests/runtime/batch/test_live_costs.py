"""The cost table corrected in the loop (policy.py BatchCosts.observe, live_costs.py LiveCorrection): each
shape's price follows the running median of its observed / table ratio, shapes never observed
follow the machine's overall factor, outliers move an estimate one step only, and the policy's
choices follow the corrected prices. Observations here are synthetic (seeded), so nothing
depends on this machine's clock; the engine test checks which shapes the loop reports, not
their times."""
from __future__ import annotations

import math

import numpy as np
import pytest

from specrt.runtime.batch.live_costs import LiveCorrection, live_costs_default
from specrt.runtime.batch.policy import BatchCosts, BatchPolicy, RoundKind
from specrt.runtime.batch.request import Request, Row
from specrt.runtime.sampling import SamplingParams

K_MAX = 3


def rows(policy: BatchPolicy, n: int, room: int = 50) -> list[Row]:
    return [Row(Request([1, 2, 3], room + 1, SamplingParams(), i), room + 1, None, policy.priors, K_MAX)
            for i in range(n)]


def as_asked(graph: str, tokens: int, n: int) -> int:
    return tokens


def test_a_shape_converges_to_the_median_of_its_ratios_whatever_its_outliers():
    """Ratios scattered around 1.5 (+-10 %), one call in ten 8x slower (a page fault, a
    preempted thread): the shape's factor ends within a few per cent of 1.5, where a mean
    would sit near 2.2."""
    rng = np.random.default_rng(0)
    live = LiveCorrection()
    xs = []
    for i in range(400):
        r = 1.5 * math.exp(rng.uniform(-0.1, 0.1)) * (8.0 if i % 10 == 3 else 1.0)
        xs.append(r)
        live.observe(("target", 2, 1), r)
    assert np.mean(xs) > 2.0
    assert live.factor(("target", 2, 1)) == pytest.approx(1.5, rel=0.08)
    assert live.counts[("target", 2, 1)] == 400


def test_unobserved_shapes_follow_the_overall_factor_observed_ones_their_own():
    """The machine twice as slow as the build for T = 1 and 3x for T = 2: each observed shape
    gets its own factor; T = 5, never run, the overall one (between them), so the table's shape
    stands where the loop has no evidence against it."""
    live = LiveCorrection()
    for _ in range(300):
        live.observe(("target", 1, 1), 2.0)
        live.observe(("target", 2, 1), 3.0)
    assert live.factor(("target", 1, 1)) == pytest.approx(2.0, rel=0.05)
    assert live.factor(("target", 2, 1)) == pytest.approx(3.0, rel=0.05)
    assert 2.0 * 0.95 <= live.factor(("target", 5, 1)) <= 3.0 * 1.05
    assert live.factor(("target", 5, 1)) == pytest.approx(math.exp(live.overall))


def test_nothing_observed_is_the_table_and_bad_observations_are_dropped():
    c = BatchCosts({1: {1: 10.0}, 2: {1: 12.0}}, draft={1: 2.0})
    assert (c.target(1, 1), c.target(1, 2), c.draft(1)) == (10.0, 12.0, 2.0)
    for ms in (float("nan"), float("inf"), 0.0, -3.0, 10.0 * 20, 10.0 / 20):   # not a time / past 16x
        c.observe(1, 1, ms)
    assert not c.live.counts and c.target(1, 1) == 10.0
    c.observe_draft(1, 0, 5.0)                 # a round of no draft steps: nothing to price
    assert not c.live.counts


def test_a_draft_round_is_priced_per_step_and_the_target_per_shape():
    """A 3-step draft round taking 18 ms on a table of 2 ms a step is a ratio of 3 per step;
    target passes of 2 rows x 4 tokens observed at 1.5x the table's interpolated price."""
    c = BatchCosts({1: {1: 10.0, 4: 16.0}, 4: {1: 14.0, 4: 24.0}}, draft={1: 2.0, 4: 5.0})
    for _ in range(200):
        c.observe_draft(2, 3, 3 * 3.0 * 3.0)          # d(2) = 3 ms in the table, 9 ms a step observed
        c.observe(2, 4, 1.5 * c.table_target(2, 4))
    assert c.draft(2) == pytest.approx(9.0, rel=0.05)
    assert c.target(2, 4) == pytest.approx(1.5 * c.table_target(2, 4), rel=0.05)
    assert set(c.live.counts) == {("draft", 2), ("target", 4, 2)}
    assert c.table_target(2, 4) == pytest.approx(14.0 + 10.0 / 3)      # the table itself is untouched


def test_the_policy_follows_the_corrected_prices():
    """A table that prices a pair round (T = 2) as a plain step makes the policy verify the
    1-gram guess every step; the loop measuring T = 2 at twice a plain step turns it back to
    plain steps (the pair guess kept 0.3 of the time is then worth less than its price)."""
    from specrt.runtime.proposers import OneGram
    costs = BatchCosts({1: {1: 10.0}, 2: {1: 10.0}})
    policy = BatchPolicy(costs, K_MAX, pair_guess=OneGram(), priors={"pair": 0.3})
    rs = rows(policy, 1)
    rs[0].seq.extend([1, 2, 3, 1, 2])                 # a 1-gram match: a one-token guess
    assert policy.choose(rs, as_asked).kind is RoundKind.PAIR
    for _ in range(100):
        costs.observe(1, 1, 10.0)
        costs.observe(1, 2, 20.0)
    assert policy.choose(rs, as_asked).kind is RoundKind.PLAIN


@pytest.mark.parametrize("value,want", [("1", True), ("", True), ("on", True), ("0", False), ("off", False)])
def test_the_environment_switch(monkeypatch, value, want):
    monkeypatch.setenv("SPECRT_LIVE_COSTS", value)
    assert live_costs_default() is want


def test_an_unknown_environment_value_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("SPECRT_LIVE_COSTS", "sometimes")
    with pytest.raises(ValueError, match="SPECRT_LIVE_COSTS=.*expected 1"):
        live_costs_default()


@pytest.mark.parametrize("live", [True, False])
def test_the_loop_reports_every_pass_it_runs_under_its_shape(tiny_batch_rows_engines, monkeypatch, live):
    """A speculating batch on the tiny rows build: with live costs on, every target pass of a
    round is observed under its own (T, rows), as many times as it ran, and the tokens are the
    ones the same engine gives with the table alone; off, nothing is observed. (Which rounds
    run depends on the costs; what is checked is that each one that ran was reported.)"""
    from fake_batch import hold_until_added

    from specrt.runtime.batch.generator import open_batch
    prompts = ["a b a b a b a b a b", "the cat the cat the cat", "hello there", "x y z x y z x y z"]
    with open_batch(tiny_batch_rows_engines, max_num_seqs=3) as g:
        eng = g.engine
        plain = [g.generate(p, max_new_tokens=16).tokens for p in prompts]
        eng.policy.costs = costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)})
        eng.live_costs = live
        ran: dict[tuple, int] = {}
        step = eng.target.step

        def spy(graph, toks, *a, **kw):
            if graph != "prefill":
                key = ("target", toks.shape[1], toks.shape[0])
                ran[key] = ran.get(key, 0) + 1
            return step(graph, toks, *a, **kw)
        monkeypatch.setattr(eng.target, "step", spy)
        hold_until_added(eng, len(prompts), monkeypatch)
        got = [c.tokens for c in g.generate_batch(prompts, max_new_tokens=16)]
    assert got == plain
    assert sum(ran.values()) > len(prompts)
    assert costs.live.counts == (ran if live else {})


def test_a_snapshot_beside_the_engine_thread_adding_shapes_never_fails():
    """The server's /metrics reads the corrections (snapshot) on its own thread while the engine
    thread observes new shapes; every snapshot is whole: each shape it lists has its factor."""
    import threading
    live = LiveCorrection()
    done = threading.Event()

    def engine():
        for i in range(3000):
            live.observe(("target", i % 97 + 1, i // 97 + 1), 1.1)
        done.set()
    t = threading.Thread(target=engine)
    t.start()
    snaps = 0
    while not done.is_set() or snaps == 0:
        s = live.snapshot()
        assert all(f > 0 and c > 0 for f, c in s["shapes"].values())
        snaps += 1
    t.join()
    assert len(live.snapshot()["shapes"]) == len(live.counts) > 200
