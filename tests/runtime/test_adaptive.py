"""Rounds chosen by measured cost, with a fallback to plain steps (runtime/batch/policy.py, as the
batch of one runs it on a folder's one-row graphs): the policy's choices follow the costs and the
acceptance it sees, it probes what it passed over, and whatever it chooses the output stays the
target's: greedy identical to plain decoding, sampling exact, a seed reproducible."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specrt.errors import ConfigError
from specrt.runtime import SamplingParams, SpeculativeGenerator
from specrt.runtime.batch.policy import BatchCosts, BatchPolicy, RoundKind
from specrt.runtime.batch.request import Request, Row
from specrt.runtime.costs import Acceptance, StepCosts, expected_tokens
from specrt.runtime.proposers import Proposal

PROMPTS = [[5, 6, 7], [40, 50, 60, 70, 80, 90, 100], list(range(10, 40))]


# --- the policy, on its own -----------------------------------------------------------------

def test_expected_tokens_is_one_plus_the_geometric_series():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.9, 0) == 1.0


def test_a_cheap_accurate_draft_drafts_the_whole_window():
    c = StepCosts(decode=1.0, verify=1.2, draft=0.1)
    assert c.best_k(0.95, 4) == 4
    assert c.predicted_speedup(0.95, 4) > 2.0


def test_a_draft_as_costly_as_the_target_falls_back_to_plain():
    # int4 target with an int8 self-draft, as measured: the draft costs more than a decode step
    c = StepCosts(decode=7.9, verify=12.1, draft=8.6)
    assert c.best_k(0.68, 4) == 0
    assert all(c.predicted_speedup(0.68, k) < 1.0 for k in range(1, 5))


def test_ties_prefer_the_shorter_round():
    c = StepCosts(decode=2.0, verify=1.0, draft=1.0)      # a=0: every k emits one token
    assert c.best_k(0.0, 4, allow_plain=False) == 1


def test_a_position_no_round_reached_has_the_pooled_estimate():
    """Before any verdict, and at positions past the longest round seen, E(k) is the geometric
    series of the pooled mean (the i.i.d. model): shorter rounds never make longer ones look worse."""
    a = Acceptance(0.8, 4.0, 0.9)
    assert [a.expected(k) for k in range(5)] == pytest.approx([expected_tokens(a.mean, k) for k in range(5)])
    for _ in range(6):
        a.observe(1, 1)                              # rounds of one proposal, all accepted
    assert a.at(1) == pytest.approx(a.mean) and a.at(3) == pytest.approx(a.mean)
    assert a.at(0) > a.mean > 0.8


@pytest.mark.parametrize("pattern, tokens", [([3], 4.0), ([2, 3], 3.5), ([1], 2.0), ([0, 4, 4, 4], 4.0)])
def test_expected_tokens_are_what_the_rounds_emit(pattern, tokens):
    """Rounds of 4 proposals with these accepted counts, repeated: E(4) from the positions'
    estimates is the tokens such rounds emit on average (1 + accepted). The pooled mean's
    geometric series is pulled down by the rejections that end rounds late: a draft right about
    its first 3 proposals every time ([3]) would be worth 3.05 tokens a round, not 4, and lose to
    plain steps it beats (the fp32 folder's self-draft, 2026-12-06)."""
    a = Acceptance(0.8, 4.0, 0.9)
    for _ in range(40):
        for accepted in pattern:
            a.observe(4, accepted)
    assert a.expected(4) == pytest.approx(tokens, abs=0.25)
    if pattern in ([3], [2, 3]):
        assert expected_tokens(a.mean, 4) < tokens - 0.6


def test_the_policy_drafts_the_rounds_the_positions_say_pay():
    """A draft right about its first 3 proposals and wrong about the 4th, round after round: the
    positions say 3 tokens a round are nearly free (E(3) = 4), the pooled rate (0.75) would say
    E(3) = 2.7 and draft 1 token a round. Flat 10 ms target passes, 6 ms draft steps."""
    costs = BatchCosts({T: {1: 10.0} for T in range(1, K + 2)}, {1: 6.0})
    p = BatchPolicy(costs, K, draft=True, pair=False, priors={"draft": 0.8})
    row = _row(p, 64)
    for _ in range(20):
        p.observe(row, RoundKind.DRAFT, 4, 3)
    assert row.accept["draft"].mean == pytest.approx(0.75, abs=0.03)
    got = p.choose([row], lambda graph, want, n: want)
    assert (got.kind, got.k) == (RoundKind.DRAFT, 3), got


def test_a_good_draft_in_rounds_of_one_is_not_pulled_toward_one_half():
    """Rounds of one proposal, 24 of every 25 accepted (0.96): the estimate stays near 0.96. A
    lasting pseudo-count at 1/2 (Beta(s + 1, f + 1)) against the ~10 rounds forgetting keeps read
    0.88, and short rounds then looked worse than they are (the fp32 folder, 2026-12-06)."""
    a = Acceptance(0.9, 4.0, 0.9)
    seen = []
    for i in range(500):
        a.observe(1, 0 if i % 25 == 24 else 1)
        seen.append(a.mean)
    assert np.mean(seen[-250:]) == pytest.approx(0.96, abs=0.015)


def test_a_position_shorter_rounds_no_longer_reach_drifts_back_to_the_pooled_estimate():
    a = Acceptance(0.8, 4.0, 0.9)
    for _ in range(10):
        a.observe(4, 3)                              # position 3 always rejected
    assert a.at(3) < 0.25
    for _ in range(40):
        a.observe(2, 2)                              # then rounds of 2, all accepted
    assert a.at(3) == pytest.approx(a.mean, abs=0.06) and a.at(3) > 0.85


def test_a_draft_round_of_an_unmeasured_window_is_priced_between_the_measured_ones():
    """The build measures T = 1, 2 and k + 1; a round of 2 proposals runs T = 3. Priced at the
    nearest measured T (2, a pair round's cost), it looked cheap enough that a draft accepted 95%
    of the time drafted 2 tokens a round where 4 paid (fp32 folder, 2026-12-06)."""
    costs = BatchCosts({1: {1: 11.2}, 2: {1: 13.4}, 5: {1: 17.3}}, {1: 6.4})
    assert costs.target(1, 3) == pytest.approx(13.4 + 3.9 / 3)
    assert costs.target(1, 4) == pytest.approx(13.4 + 2 * 3.9 / 3)
    assert costs.target(1, 7) == 17.3 and costs.target(1, 1) == 11.2      # beyond: the nearest measured
    p = BatchPolicy(costs, K, draft=True, pair=False, priors={"draft": 0.8})
    row = _row(p, 64)
    for _ in range(10):                          # 95% of a round's proposals accepted
        for _ in range(19):
            p.observe(row, RoundKind.DRAFT, 4, 4)
        p.observe(row, RoundKind.DRAFT, 4, 2)
    got = p.choose([row], lambda graph, want, n: want)
    assert (got.kind, got.k, got.tokens) == (RoundKind.DRAFT, 4, 5), got


# --- the engine's policy (runtime/batch/policy.py) on one row, as a batch of one runs it ------------

K = 4
GUESS = np.array([7, 8, 9, 10], np.int64)


class _Guess:
    """A guesser with a fixed guess of up to `size` tokens (0: none)."""
    name = "fixed"

    def __init__(self, size: int):
        self.size = size

    def propose(self, seq, k):
        return Proposal(GUESS[:min(self.size, k)])


def _policy(c: StepCosts, *, prior=0.8, lookup=0, lookup_prior=0.5, **kw) -> tuple[BatchPolicy, Row]:
    costs = BatchCosts({1: {1: c.decode}, K + 1: {1: c.verify}}, {1: c.draft})
    p = BatchPolicy(costs, K, lookup=_Guess(lookup) if lookup else None, draft=True, pair=False,
                    priors={"draft": prior, "lookup": lookup_prior}, **kw)
    return p, _row(p, 64)


def _row(p: BatchPolicy, budget: int) -> Row:
    return Row(Request([1, 2, 3], budget, SamplingParams(), 0), budget, None, p.priors, K)


def _graph_t(graph, want, n):
    return 1 if graph == "decode" else K + 1        # the one-row graphs' static windows


def _choose(p: BatchPolicy, row: Row) -> tuple[str, int]:
    c = p.choose([row], _graph_t)
    return c.kind.value, (c.k if c.kind is RoundKind.DRAFT else len(c.proposals[0]))


def _observe(p, row, how: str, k: int, accepted: int) -> None:
    p.observe(row, RoundKind(how), k, accepted)


def test_rejections_lower_the_estimate_and_acceptances_raise_it():
    p, row = _policy(StepCosts(1.0, 1.2, 0.2), prior=0.8)
    start = row.accept["draft"].mean
    for _ in range(5):
        _observe(p, row, "draft", 4, 0)
    low = row.accept["draft"].mean
    assert low < start
    for _ in range(5):
        _observe(p, row, "draft", 4, 4)
    assert row.accept["draft"].mean > low
    before = row.accept["draft"].mean
    _observe(p, row, "lookup", 3, 0)             # lookup verdicts do not move the draft's estimate
    assert row.accept["draft"].mean == before


def test_a_bad_stretch_moves_the_choice_to_plain_and_a_probe_comes_back():
    p, row = _policy(StepCosts(decode=1.0, verify=1.3, draft=0.3), prior=0.9, cooldown=5)
    how, k = _choose(p, row)
    assert how == "draft" and k >= 3
    for _ in range(10):
        _observe(p, row, "draft", 4, 0)          # every draft token rejected
    assert _choose(p, row) == ("plain", 0)
    rounds = []
    for _ in range(6):
        how, k = _choose(p, row)
        rounds.append(how)
        _observe(p, row, how, k, k)              # the probe round is fully accepted
    assert rounds == ["plain"] * 5 + ["draft"], rounds


def test_in_a_batch_a_probe_waits_until_every_row_is_due():
    """A probe makes every row of the step pay for the draft's steps and the verify window, so in a
    batch it runs only when every row that could draft is due, each after n times its gap in a
    batch of n (one row: AdaptiveK's rule)."""
    p, a = _policy(StepCosts(decode=5.6, verify=10.0, draft=3.0), prior=0.68, cooldown=4)
    b = _row(p, 64)

    def kind():
        return p.choose([a, b], _graph_t).kind.value
    a.plain_run, b.plain_run = 8, 1
    assert kind() == "plain"
    b.plain_run = 4                      # due alone, not in a batch of two
    assert kind() == "plain"
    assert p.choose([b], _graph_t).kind.value == "draft"
    b.plain_run = 8
    assert kind() == "draft"
    b.budget = b.emitted + 1             # a row with no room to draft takes no part
    b.plain_run = 0
    assert kind() == "draft"


def test_a_draft_that_pays_alone_but_not_in_the_batch_backs_off_there():
    """The probe's verdict prices the draft at the step's row count: verify windows over 4 rows
    cost about twice a plain step (fp32 folder), so a draft that pays for one row does not for
    four, and its probes there come ever more rarely. A draft round the rates chose is not a
    probe, whatever the row's plain run."""
    costs = BatchCosts({1: {1: 11.2, 4: 15.6}, 2: {1: 13.4, 4: 22.6}, 5: {1: 17.3, 4: 32.8}}, {1: 6.4, 4: 14.0})
    p = BatchPolicy(costs, K, draft=True, pair=False, priors={"draft": 0.9})
    row = _row(p, 64)
    for _ in range(20):
        p.observe(row, RoundKind.DRAFT, 4, 4, probe=False)
    assert p._draft_pays(row, 1) and not p._draft_pays(row, 4)
    row.plain_run = 64
    p.observe(row, RoundKind.DRAFT, 3, 3, probe=True, rows=4)
    assert row.probe_gap == 32                   # doubled from 16: probed, and it does not pay here
    row.plain_run = 64
    p.observe(row, RoundKind.DRAFT, 3, 3, probe=False, rows=4)
    assert row.probe_gap == 32                   # chosen by rate: no verdict on the gap
    p.observe(row, RoundKind.DRAFT, 3, 3, probe=True, rows=1)
    assert row.probe_gap == 16                   # alone it pays: the gap resets


def test_the_probes_verdict_prices_a_draft_round_as_the_choice_does():
    """Whether the draft pays after a probe (observe: reset or double the gap) uses the window the
    round really runs (the one-row verify graph's static T), as choose() does: a draft that choose()
    passes over does not 'pay' because a short window was priced at a plain step's cost."""
    p, row = _policy(StepCosts(decode=1.0, verify=1.3, draft=0.5), prior=0.63)
    assert _choose(p, row) == ("plain", 0)
    assert not p._draft_pays(row)
    cheap, row = _policy(StepCosts(decode=1.0, verify=1.3, draft=0.05), prior=0.63)
    assert _choose(cheap, row)[0] == "draft" and cheap._draft_pays(row)


def test_the_budget_caps_k_and_no_room_is_a_plain_step():
    p, _ = _policy(StepCosts(1.0, 1.1, 0.05), prior=0.95, lookup=3)
    assert _choose(p, _row(p, 3)) == ("draft", 2)      # room for 2 proposals (and the target's token)
    assert _choose(p, _row(p, 1)) == ("plain", 0)


def test_a_free_lookup_guess_wins_over_a_costly_draft_and_loses_once_it_keeps_failing():
    c = StepCosts(decode=7.9, verify=12.1, draft=8.6)
    p, row = _policy(c, prior=0.68, lookup_prior=0.8)
    assert _choose(p, row) == ("plain", 0)
    p, row = _policy(c, prior=0.68, lookup=3, lookup_prior=0.8)
    assert _choose(p, row) == ("lookup", 3)
    for _ in range(8):
        _observe(p, row, "lookup", 3, 0)
    assert _choose(p, row) == ("plain", 0)


def test_a_lookup_guess_passed_over_a_few_times_is_tried_again():
    p, row = _policy(StepCosts(decode=7.9, verify=12.1, draft=8.6), prior=0.68, lookup=3, lookup_prior=0.8,
                     lookup_cooldown=3)
    for _ in range(8):
        _observe(p, row, "lookup", 3, 0)
    rounds = [_choose(p, row)[0] for _ in range(4)]
    assert rounds == ["plain", "plain", "plain", "lookup"], rounds


def test_in_a_batch_a_lookup_guess_passed_over_is_not_retried():
    """A retried lookup guess would make every row of the batch pay a verify window for one
    row's guess (int4 folder, 4 and 8 rows: x0.92-0.93 of plain steps, 2026-12-06)."""
    p, row = _policy(StepCosts(decode=7.9, verify=12.1, draft=8.6), prior=0.68, lookup=3, lookup_prior=0.8,
                     lookup_cooldown=3)
    other = _row(p, 64)
    for _ in range(8):
        _observe(p, row, "lookup", 3, 0)
        _observe(p, other, "lookup", 3, 0)
    assert [p.choose([row, other], _graph_t).kind.value for _ in range(8)] == ["plain"] * 8


def test_lookup_never_proposes_more_than_the_budget_allows():
    p, _ = _policy(StepCosts(decode=1.0, verify=1.0, draft=5.0), lookup=4, lookup_prior=0.9)
    assert _choose(p, _row(p, 3)) == ("lookup", 2)


def test_costs_come_from_the_manifest_or_not_at_all():
    spec = {"costs_ms": {"target_decode": 20.0, "target_verify": 24.0, "draft_decode": 8.0}}
    assert StepCosts.from_manifest(spec) == StepCosts(20.0, 24.0, 8.0)
    assert StepCosts.from_manifest(None) is None
    assert StepCosts.from_manifest({"costs_ms": {"target_decode": 1.0}}) is None
    with pytest.raises(ValueError):
        StepCosts(0.0, 1.0, 1.0)


# --- through the generator ------------------------------------------------------------------

def _with_costs(src, dst, **costs_ms) -> str:
    """A copy of built engines whose manifest carries the given build-time step costs."""
    shutil.copytree(src, dst)
    path = dst / "manifest.json"
    man = json.loads(path.read_text())
    man["build"]["speculation"] = {"costs_ms": {"target_decode": 1.0, "target_verify": 1.2, "draft_decode": 0.2,
                                                **costs_ms}}
    path.write_text(json.dumps(man))
    return str(dst)


def _tokens(g, ids, n, method="speculative", **kw):
    return [e.token for e in g.tokens(ids, max_new_tokens=n, method=method, **kw)]


@pytest.fixture(scope="module")
def costly_draft(tiny_engines, tmp_path_factory):
    return _with_costs(tiny_engines, tmp_path_factory.mktemp("adaptive") / "costly", draft_decode=5.0)


@pytest.fixture(scope="module")
def cheap_draft(tiny_self_engines, tmp_path_factory):
    return _with_costs(tiny_self_engines, tmp_path_factory.mktemp("adaptive") / "cheap", draft_decode=0.05)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_falling_back_to_plain_keeps_greedy_output_identical(costly_draft, prompt):
    g = SpeculativeGenerator(costly_draft)
    assert g.adaptive
    plain = _tokens(g, prompt, 40, "plain")
    assert _tokens(g, prompt, 40) == plain
    m = g.last_metrics
    assert m.plain_steps > 20, m.as_dict()            # the policy fell back (probes: the policy tests)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_draft_worth_it_keeps_drafting(cheap_draft, prompt):
    g = SpeculativeGenerator(cheap_draft)
    plain = _tokens(g, prompt, 40, "plain")
    assert _tokens(g, prompt, 40) == plain
    m = g.last_metrics
    # at most one plain step: the last token, when only one remains (no room for a draft)
    assert m.plain_steps <= 1 and m.drafted >= 25, m.as_dict()


REPEATS = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9]


def test_prompt_lookup_rounds_keep_greedy_output_identical(costly_draft):
    g = SpeculativeGenerator(costly_draft)
    for prompt in (REPEATS, PROMPTS[2]):
        plain = _tokens(g, prompt, 40, "plain")
        assert _tokens(g, prompt, 40, ngram=1) == plain
        assert _tokens(g, prompt, 40, ngram=0) == plain
        assert g.last_metrics.lookup_rounds == 0       # ngram=0: no lookup
    _tokens(g, REPEATS, 40, ngram=1)
    assert g.last_metrics.lookup_rounds > 0, g.last_metrics.as_dict()


def test_adaptive_is_off_for_an_explicit_k_without_costs_or_when_asked(costly_draft, tiny_engines):
    assert not SpeculativeGenerator(costly_draft, k=2).adaptive
    assert not SpeculativeGenerator(costly_draft, adaptive=False).adaptive
    assert not SpeculativeGenerator(tiny_engines, k=3, adaptive=None).adaptive
    g = SpeculativeGenerator(costly_draft, adaptive=False)
    _tokens(g, PROMPTS[1], 30)
    # every round drafts k, however costly; at most the last token is a plain step (no room to draft)
    assert g.last_metrics.plain_steps <= 1 and g.last_metrics.drafted >= 3 * 27, g.last_metrics.as_dict()


def test_a_calls_adaptive_overrides_an_explicit_k(costly_draft):
    g = SpeculativeGenerator(costly_draft, k=2)            # an explicit k: fixed rounds by default
    _tokens(g, PROMPTS[1], 40)
    assert g.last_metrics.plain_steps <= 1
    _tokens(g, PROMPTS[1], 40, adaptive=True)             # this call by cost: the costly draft falls back
    assert g.last_metrics.plain_steps > 20, g.last_metrics.as_dict()
    spec_only = SpeculativeGenerator(costly_draft, methods=("speculative",))
    with pytest.raises(ConfigError, match="plain"):
        spec_only.tokens(PROMPTS[1], adaptive=True)


def test_adaptive_refuses_what_it_cannot_do(costly_draft, tiny_engines):
    with pytest.raises(ConfigError, match="plain"):
        SpeculativeGenerator(costly_draft, adaptive=True, methods=("speculative",))
    with pytest.raises(ConfigError, match="rebuild"):
        SpeculativeGenerator(tiny_engines, adaptive=True)
    with pytest.raises(ConfigError):
        SpeculativeGenerator(costly_draft, adaptive="yes")


def test_seeded_sampling_with_adaptive_k_is_reproducible(costly_draft):
    g = SpeculativeGenerator(costly_draft)
    sp = SamplingParams(temperature=1.2, top_k=20, seed=11)
    a = _tokens(g, PROMPTS[2], 40, sampling=sp)
    b = _tokens(g, PROMPTS[2], 40, sampling=sp)
    assert a == b
    assert g.last_metrics.plain_steps > 0


def test_stopping_early_in_a_plain_round_leaves_the_cache_at_what_was_emitted(costly_draft):
    g = SpeculativeGenerator(costly_draft)
    it = g.tokens(PROMPTS[1], max_new_tokens=40)
    got = [next(it).token for _ in range(9)]
    it.close()
    assert g.one.engine.idle()                       # the request left its row
    assert _tokens(g, PROMPTS[1], 9, "plain") == got


# --- the build's plan ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def planned(tmp_path_factory, tiny_pair):
    from conftest import build_tiny
    return build_tiny(tmp_path_factory.mktemp("planned") / "e", tiny_pair[0], "int8", measure_costs=True,
                      max_context=256)   # room for the bench's built-in chat prompts


def test_a_build_times_its_graphs_and_records_the_plan_that_turns_adaptive_k_on(planned):
    out = planned
    spec = json.loads((out / "manifest.json").read_text())["build"]["speculation"]
    costs = spec["costs_ms"]
    assert all(costs[g] > 0 for g in ("target_decode", "target_verify", "draft_decode")), costs
    assert set(spec["predicted"]) == {"k=1", "k=2", "k=3"}
    assert 0.0 < spec["acceptance"] <= 1.0
    best = max(spec["predicted"].values())
    chosen = spec["chosen"]
    assert (chosen["method"], chosen["predicted_speedup"]) == (("speculative", best) if best > 1.0 else ("plain", 1.0))
    g = SpeculativeGenerator(out)
    one = StepCosts.from_manifest(spec)
    assert g.adaptive and (g.costs.target(1, 1), g.costs.target(1, 4), g.costs.draft(1)) == \
        (one.decode, one.verify, one.draft)
    assert _tokens(g, PROMPTS[1], 30) == _tokens(g, PROMPTS[1], 30, "plain")


def test_a_build_without_timings_has_no_plan_and_a_fixed_k(tiny_engines):
    assert "speculation" not in json.loads((tiny_engines / "manifest.json").read_text())["build"]
    assert not SpeculativeGenerator(tiny_engines).adaptive


def test_a_call_can_override_the_instances_setting(planned, tiny_engines):
    g = SpeculativeGenerator(planned)
    _tokens(g, PROMPTS[2], 30, adaptive=False)
    # fixed-k rounds: all draft rounds but the last token's (no room to draft)
    assert g.last_metrics.plain_steps <= 1 and g.last_metrics.lookup_rounds == 0
    with pytest.raises(ConfigError, match="rebuild"):
        _tokens(SpeculativeGenerator(tiny_engines), PROMPTS[2], 30, adaptive=True)


def test_bench_runs_fixed_and_adaptive_k_side_by_side(planned):
    from specrt.tools.bench import run_bench
    lines = []
    report = run_bench(str(planned), prompts=2, max_new_tokens=12, out=lines.append)
    ad = report["variants"][0]["adaptive"]
    assert ad["identical"] and ad["tok_s"] > 0 and ad["build_plan"]["method"] in ("speculative", "plain")
    assert report["identical"]
    assert any(line.startswith("adaptive k + prompt lookup " + str(planned)) for line in lines), lines


def test_backend_options_the_backend_does_not_take_are_a_config_error(tiny_engines):
    with pytest.raises(ConfigError, match="ort-cpu backend does not take"):
        SpeculativeGenerator(tiny_engines, backend_options={"cuda_graphs": False})


def test_a_draft_that_could_not_pay_even_if_always_right_is_never_probed():
    """An int4 target's int8 self-draft: a draft step costs more than a plain step, so no
    acceptance makes a draft round pay, and a probe is pure cost."""
    p, row = _policy(StepCosts(decode=5.6, verify=10.0, draft=8.3), prior=0.68, cooldown=16)
    kinds = set()
    for _ in range(700):
        how, k = _choose(p, row)
        _observe(p, row, how, k, 0)
        kinds.add(how)
    assert kinds == {"plain"}, kinds


def test_probes_of_a_draft_that_never_pays_come_ever_more_rarely_and_reset_when_it_pays():
    """A draft that would pay at a high acceptance but whose every token is rejected."""
    p, row = _policy(StepCosts(decode=5.6, verify=10.0, draft=3.0), prior=0.68, cooldown=16, max_cooldown=128)
    probes = []
    for i in range(700):
        how, k = _choose(p, row)
        _observe(p, row, how, k, 0)          # every drafted token rejected
        if how == "draft":
            probes.append(i)
    gaps = [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[:4] == [32, 64, 128, 128], (probes, gaps)      # the first probe after 16, then doubling, capped
    cheap, row = _policy(StepCosts(decode=5.6, verify=6.0, draft=0.1), prior=0.05, cooldown=16)
    row.probe_gap = row.plain_run = 128
    how, k = _choose(cheap, row)
    assert how == "draft"
    _observe(cheap, row, "draft", k, k)      # all accepted: the draft pays now
    assert row.probe_gap == 16
