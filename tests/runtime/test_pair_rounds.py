"""Pair rounds: a quantized target's decode graph runs two rows (calibration/rows.py), so a
plain step can carry one guessed token in its second row for free. The policy prefers
such a round to a plain step, greedy output stays the target's plain output, the round
runs through the decode graph (not the verify pass), and a target whose decode graph has
one row never gets one."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specrt.runtime import SamplingParams, SpeculativeGenerator
from specrt.runtime.batch.policy import BatchCosts, BatchPolicy, RoundKind
from specrt.runtime.batch.request import Request, Row
from specrt.runtime.costs import StepCosts
from specrt.runtime.proposers import Chain, OneGram, PromptLookup, Proposal

PROMPTS = [[5, 6, 7], [40, 50, 60, 70, 80, 90, 100], list(range(10, 40)), [1, 99]]
REPEATS = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8, 9]
INT4 = StepCosts(decode=5.6, verify=10.0, draft=8.3)   # SmolLM2 int4 on 2 cores, ms (rounded)


# --- the policy (runtime/batch/policy.py) on one row -----------------------------------------

def _policy(c: StepCosts, *, prior=0.68, lookup_prior=0.5, lookup=None, pair_guess=None) -> tuple[BatchPolicy, Row]:
    costs = BatchCosts({2: {1: c.decode}, 5: {1: c.verify}}, {1: c.draft})     # a two-token decode graph
    p = BatchPolicy(costs, 4, lookup=lookup, pair_guess=pair_guess, draft=True,
                    priors={"draft": prior, "lookup": lookup_prior})
    return p, _row(p, [1, 2, 3], 64)


def _row(p, seq, budget):
    return Row(Request(list(seq), budget, SamplingParams(), 0), budget, None, p.priors, 4)


def _graph_t(graph, want, n):
    return 2 if graph == "decode" else 5


class _Guess:
    name = "fixed"

    def __init__(self, tokens):
        self.tokens = np.array(tokens, np.int64)

    def propose(self, seq, k):
        return Proposal(self.tokens[:k])


def _choose(p, row):
    c = p.choose([row], _graph_t)
    return c.kind.value, (c.k if c.kind is RoundKind.DRAFT else [int(t) for t in c.proposals[0]])


def test_a_guess_turns_a_plain_step_into_a_pair_round():
    p, row = _policy(INT4)
    assert _choose(p, row) == ("plain", [])
    p, row = _policy(INT4, pair_guess=_Guess([9]))
    assert _choose(p, row) == ("pair", [9])
    assert _choose(p, _row(p, [1, 2, 3], 1)) == ("plain", [])      # no room for a second token


def test_a_pair_round_competes_with_lookup_on_rate():
    for prior, want in ((0.5, "pair"), (0.9, "lookup")):
        p, row = _policy(INT4, lookup=_Guess([7, 8, 9]), lookup_prior=prior)
        assert _choose(p, row)[0] == want


def test_a_cheap_accurate_draft_beats_a_pair_round():
    p, row = _policy(StepCosts(decode=1.0, verify=1.2, draft=0.05), prior=0.9, pair_guess=_Guess([9]))
    assert _choose(p, row) == ("draft", 4)


def test_pair_verdicts_move_only_the_pair_estimate():
    p, row = _policy(INT4)
    draft, before = row.accept["draft"].mean, row.accept["pair"].mean
    for _ in range(5):
        p.observe(row, RoundKind.PAIR, 1, 1)
    assert row.accept["pair"].mean > before and row.accept["draft"].mean == draft
    for _ in range(10):
        p.observe(row, RoundKind.PAIR, 1, 0)
    assert row.accept["pair"].mean < before and row.accept["draft"].mean == draft


def test_a_pair_round_takes_the_lookup_guess_else_a_one_gram_match():
    p, _ = _policy(INT4, lookup=PromptLookup(2, 4), pair_guess=Chain([OneGram()]), lookup_prior=0.05)

    def plan(seq, room):
        return _choose(p, _row(p, seq, room + 1))
    assert plan([1, 2, 9, 1, 2], 1) == ("pair", [9])    # the 2-gram match continues with one token
    assert plan([4, 5, 6, 4], 4) == ("pair", [5])       # no 2-gram match: the 1-gram match
    assert plan([4, 5, 4, 6, 4], 4) == ("pair", [6])    # the latest earlier occurrence
    assert plan([4, 5, 6], 4)[0] == "plain" and plan([4], 4)[0] == "plain"
    assert plan([1, 2, 9, 1, 2], 0)[0] == "plain"       # no room for a second token


# --- through the generator ------------------------------------------------------------------

@pytest.fixture(scope="module")
def int4_costed(tiny_int4_engines, tmp_path_factory):
    """The tiny int4 engines with build-time costs that make the draft not pay (as on SmolLM2
    int4), so the adaptive policy runs plain, pair and lookup rounds."""
    dst = tmp_path_factory.mktemp("pair") / "int4"
    shutil.copytree(tiny_int4_engines, dst)
    man = json.loads((dst / "manifest.json").read_text())
    man["build"]["speculation"] = {"costs_ms": {"target_decode": 5.6, "target_verify": 10.0, "draft_decode": 8.3}}
    (dst / "manifest.json").write_text(json.dumps(man))
    return dst


def _tokens(g, ids, n, method="speculative", **kw):
    return [e.token for e in g.tokens(ids, max_new_tokens=n, method=method, **kw)]


def _record_graphs(g):
    """(graph, tokens) of every target step after the prefill (the one-row runner's calls: the
    engine pads a plain step to the decode graph's two tokens)."""
    calls, orig = [], g.target.step

    def wrapped(graph, tokens, start):
        if graph != "prefill":
            calls.append((graph, len(tokens)))
        return orig(graph, tokens, start)
    g.target.step = wrapped
    return calls


@pytest.mark.parametrize("method", ["speculative", "lookup"])
def test_pair_rounds_keep_greedy_output_identical_and_run_the_decode_graph(int4_costed, method):
    g = SpeculativeGenerator(int4_costed)
    assert g.pair and g.adaptive
    pairs = accepted = 0
    for prompt in [REPEATS] + PROMPTS:
        plain = _tokens(g, prompt, 40, "plain")
        calls = _record_graphs(g)
        assert _tokens(g, prompt, 40, method, ngram=2) == plain, prompt
        m = g.last_metrics
        # pair rounds run the two-token decode graph, as plain steps do; proposals the verify graph
        assert calls.count(("decode", 2)) == m.pair_rounds + m.plain_steps, (calls, m.as_dict())
        assert calls.count(("decode", 2)) + calls.count(("verify", 4)) == len(calls) == m.iterations
        pairs += m.pair_rounds
        accepted += m.accepted
        g = SpeculativeGenerator(int4_costed)            # unwrapped again
    assert pairs > 20 and accepted > 0, (pairs, accepted)


def test_a_one_row_decode_graph_never_runs_a_pair_round(tiny_self_engines):
    g = SpeculativeGenerator(tiny_self_engines)
    assert json.loads((tiny_self_engines / "manifest.json").read_text())["models"]["target"]["graphs"]["decode"][
        "tokens"] == 1
    assert not g.pair
    _tokens(g, REPEATS, 30, "lookup")
    assert g.last_metrics.pair_rounds == 0 and g.last_metrics.lookup_rounds == 0


def test_the_decode_graph_of_an_int4_build_has_two_rows(tiny_int4_engines):
    import onnx
    man = json.loads((tiny_int4_engines / "manifest.json").read_text())
    entry = man["models"]["target"]["graphs"]["decode"]
    model = onnx.load(str(tiny_int4_engines / entry["file"]), load_external_data=False)
    ids = next(i for i in model.graph.input if i.name == "input_ids")
    assert [d.dim_value for d in ids.type.tensor_type.shape.dim] == [1, 2] == [1, entry["tokens"]]


def test_shared_memory_is_refused_for_a_matmul_nbits_target_with_the_fix(tiny_int4_engines, tiny_self_engines):
    """Unpacked MatMulNBits graphs run ~40x slower (SmolLM2 int4: 265 ms vs 6.3 ms per decode
    step): a quantized target refuses memory='shared' and names memory='fast', through the
    single stream and open_batch alike (the server's `--memory shared`); fp32 takes it."""
    from specrt.errors import ConfigError
    from specrt.runtime.batch.generator import open_batch
    with pytest.raises(ConfigError, match="memory='fast'"):
        SpeculativeGenerator(tiny_int4_engines, memory="shared")
    with pytest.raises(ConfigError, match="memory='fast'"):
        open_batch(tiny_int4_engines, max_num_seqs=1, memory="shared")
    SpeculativeGenerator(tiny_self_engines, memory="shared")
    open_batch(tiny_self_engines, max_num_seqs=1, memory="shared").close()


# --- the target's n-gram table (runtime/ngrams.py, calibration/ngrams.py) -------------------

def test_the_table_keeps_the_most_frequent_next_token_and_guesses_the_longest_suffix(tmp_path):
    from specrt.builder.gates.ngrams import table_of
    from specrt.runtime import ngrams
    tables = table_of([[1, 2, 3, 1, 2, 4, 1, 2, 4], [9, 2, 5]], orders=2)
    assert tables[1][(2,)] == 4 and tables[2][(1, 2)] == 4 and tables[2][(9, 2)] == 5
    assert table_of([[5, 7, 5, 6]], orders=1)[1][(5,)] == 6       # a tie: the smaller id
    path = tmp_path / "ngrams.json"
    path.write_text(ngrams.to_json(tables))
    t = ngrams.NgramTable.load(path)
    assert t.guess([9, 2]) == 5          # the 2-gram (9, 2) before the 1-gram (2,) -> 4
    assert t.guess([0, 2]) == 4 and t.guess([0, 0]) is None and len(t) == len(tables[1]) + len(tables[2])


def test_an_int4_build_ships_its_table_and_the_manifest_names_it(tiny_int4_engines):
    from specrt import manifest as mf
    from specrt.runtime.ngrams import NgramTable
    man = json.loads((tiny_int4_engines / "manifest.json").read_text())
    e = man["proposers"]["ngrams"]
    path = tiny_int4_engines / e["file"]
    assert mf.sha256_file(path) == e["sha256"] and path.stat().st_size == e["bytes"]
    assert e["entries"] == len(NgramTable.load(path)) > 0 and 0 < e["generated_tokens"] <= 512
    assert SpeculativeGenerator(tiny_int4_engines).ngrams is not None
    from specrt.tools.describe import describe
    assert f"ngrams     ngrams.json: {e['entries']} n-grams" in describe(mf.load(tiny_int4_engines))


@pytest.mark.parametrize("damage", ["missing", "edited"])
def test_a_damaged_table_is_refused_at_load(tiny_int4_engines, tmp_path, damage):
    from specrt.errors import GraphFileError
    dst = tmp_path / "int4"
    shutil.copytree(tiny_int4_engines, dst)
    table = dst / "ngrams.json"
    if damage == "missing":
        table.unlink()
    else:
        table.write_text(table.read_text().replace("[", "[1,", 1)[:-2] + "]}")
    with pytest.raises(GraphFileError, match="ngrams.json"):
        SpeculativeGenerator(dst)


def test_pair_rounds_take_the_tables_guess_when_lookup_has_none(int4_costed):
    """An oracle table (the target's own next token) makes every pair round accept, and the
    output is still the plain output: the guess goes where the loop says."""
    g = SpeculativeGenerator(int4_costed)
    prompt = [40, 50, 60, 70]                 # no repeated token: lookup has no guess at first
    plain = _tokens(g, prompt, 30, "plain")

    asked = []

    class Oracle:     # asked only when prompt lookup (n-gram, then 1-gram) has no guess
        def guess(self, seq):
            i = len(seq) - len(prompt)
            asked.append(i)
            return plain[i] if 0 < i < len(plain) else None
    from specrt.runtime.proposers import TableGuess
    next(p for p in g.one.full.pair_guess.proposers if isinstance(p, TableGuess)).table = Oracle()
    assert _tokens(g, prompt, 30, "lookup", ngram=3) == plain
    m = g.last_metrics
    assert len(asked) >= 3 and m.pair_rounds >= len(asked) and m.accepted >= len(asked), (asked, m.as_dict())


def test_a_build_with_ngram_tokens_0_ships_no_table(tmp_path, tiny_pair):
    from conftest import build_tiny

    from specrt.builder.config import BuildConfig
    from specrt.errors import SpecrtError
    out = build_tiny(tmp_path / "int4", tiny_pair[0], "none", precision="int4", block_size=16, ngram_tokens=0)
    assert "proposers" not in json.loads((out / "manifest.json").read_text())
    assert SpeculativeGenerator(out).ngrams is None
    with pytest.raises(SpecrtError, match="ngram_tokens"):
        BuildConfig(target="x", out="y", ngram_tokens=-1)


@pytest.mark.parametrize("prompt", [REPEATS, PROMPTS[2]])
def test_the_lookup_simulation_replays_the_pair_rounds_the_loop_runs(int4_costed, prompt):
    """bench's prediction (simulate_lookup on the plain output) counts the rounds, pair rounds
    and verify passes that method='lookup' actually runs."""
    from specrt.tools.lookup_sim import simulate_lookup
    g = SpeculativeGenerator(int4_costed)
    plain = _tokens(g, prompt, 40, "plain")
    calls = _record_graphs(g)
    _tokens(g, prompt, 40, "lookup", ngram=2)
    m = g.last_metrics
    s = simulate_lookup(prompt, plain, 2, g.k, pair=True, table=g.ngrams)
    assert (s.rounds, s.pair_rounds) == (m.iterations, m.pair_rounds) and s.pair_rounds > 0, (s, m.as_dict())
    assert s.proposal_rounds == sum(graph == "verify" for graph, _ in calls), calls
