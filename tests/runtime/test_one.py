"""One engine, one answer: `SpeculativeGenerator` on a folder with a batched model (the tiny
fp32 target with `--draft int8 --batch --batch-attention rows`, and a `gqa` one) runs every
request on that model as a batch of one (runtime/one.py), so its tokens are the batched
server's: greedy and seeded, whatever else shares the server's batch, with every method.
"""
from __future__ import annotations

import threading

import pytest
from bad_input_helpers import copy_engines, edit_manifest

from specrt.errors import ConcurrentUseError, ConfigError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.sampling import SamplingParams

PROMPTS = ["a b a b a b a b a b", "the cat the cat the cat", "hello there", "x y z x y z x y z",
           "one two three one two three"]
NEW = 24
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=11)


@pytest.fixture(scope="module")
def gen(tiny_batch_rows_draft_engines):
    return SpeculativeGenerator(tiny_batch_rows_draft_engines)


@pytest.fixture(scope="module")
def served(tiny_batch_rows_draft_engines):
    """The batched engine's answers, all prompts at once on 3 rows (rows join and leave)."""
    with open_batch(tiny_batch_rows_draft_engines, max_num_seqs=3) as g:
        return {name: [(c.tokens, c.finish_reason) for c in g.generate_batch(PROMPTS, max_new_tokens=NEW, sampling=sp)]
                for name, sp in (("greedy", SamplingParams()), ("seeded", SEEDED))}


def test_the_generator_runs_the_folders_batched_model(gen):
    assert gen.one is not None and gen.target is None            # the one-row graphs are not loaded
    assert gen.one.has_draft                                      # the int8 self-draft inside the batch


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_generate_gives_the_batched_servers_answers(gen, served, mode):
    sp = SamplingParams() if mode == "greedy" else SEEDED
    got = [(c.tokens, c.finish_reason) for c in (gen.generate(p, max_new_tokens=NEW, sampling=sp) for p in PROMPTS)]
    assert got == served[mode]


@pytest.mark.parametrize("method", ["plain", "lookup", "speculative"])
def test_every_method_gives_the_same_greedy_tokens(gen, served, method):
    got = [gen.generate(p, max_new_tokens=NEW, method=method).tokens for p in PROMPTS]
    assert got == [t for t, _ in served["greedy"]]
    assert gen.last_metrics.method == method


def test_a_stop_string_ends_the_answer_and_the_next_request_is_exact(gen, served):
    full = gen.generate(PROMPTS[0], max_new_tokens=NEW)
    stop = full.text[3:6]
    c = gen.generate(PROMPTS[0], max_new_tokens=NEW, stop=[stop])
    assert c.finish_reason == "stop" and stop not in c.text and full.text.startswith(c.text)
    assert gen.one.engine.idle()                                # the stopped request left its row
    assert gen.generate(PROMPTS[1], max_new_tokens=NEW).tokens == served["greedy"][1][0]


def test_closing_a_stream_early_frees_the_row(gen, served):
    stream = gen.stream(PROMPTS[2], max_new_tokens=NEW)
    next(stream)
    stream.close()
    assert gen.one.engine.idle()
    assert gen.generate(PROMPTS[3], max_new_tokens=NEW).tokens == served["greedy"][3][0]


def test_two_open_streams_are_refused_as_before(gen):
    first = gen.stream(PROMPTS[0], max_new_tokens=NEW)
    next(first)
    with pytest.raises(ConcurrentUseError):
        next(gen.stream(PROMPTS[1], max_new_tokens=NEW))
    first.close()
    done = threading.Event()
    threading.Thread(target=lambda: (gen.generate(PROMPTS[1], max_new_tokens=4), done.set())).start()
    assert done.wait(60)


def test_one_row_options_are_refused_with_the_fix(tiny_batch_rows_draft_engines, tmp_path):
    for kw in ({"memory": "shared"}, {"profile_dir": tmp_path}, {"backend_options": {"x": 1}}, {"adaptive": False}):
        with pytest.raises(ConfigError, match="engine='one-row'"):
            SpeculativeGenerator(tiny_batch_rows_draft_engines, **kw)
    with pytest.raises(ConfigError, match="engine="):
        SpeculativeGenerator(tiny_batch_rows_draft_engines, engine="batch")


def test_engine_one_row_runs_the_one_row_graphs(tiny_batch_rows_draft_engines, gen):
    one_row = SpeculativeGenerator(tiny_batch_rows_draft_engines, engine="one-row", methods=("plain",))
    # the same engine, one row, over the one-row graphs (runtime/batch/one_row.py)
    assert one_row.target is not None and one_row.one.engine.target.runner is one_row.target
    assert list(gen.tokens([1, 2, 3], max_new_tokens=4, adaptive=True))
    with pytest.raises(ConfigError, match="adaptive"):
        gen.tokens([1, 2, 3], max_new_tokens=4, adaptive=False)


def test_a_gqa_folder_runs_plain_steps_as_a_batch_of_one_with_the_servers_answers(tiny_batch_engines):
    """`--batch-attention gqa`: the batched model verifies no windows, so its server decodes one
    token a row per step; the single stream runs the same model the same way (asked to look up,
    it still steps plainly) rather than speculating on its one-row graphs into other tokens."""
    from specrt import manifest as mf
    from specrt.runtime.one import plain_because
    assert "--batch-attention rows" in plain_because(mf.load(tiny_batch_engines))
    gen = SpeculativeGenerator(tiny_batch_engines)
    assert gen.one is not None and gen.target is None
    with open_batch(tiny_batch_engines, max_num_seqs=3) as g:
        served = {name: [c.tokens for c in g.generate_batch(PROMPTS, max_new_tokens=NEW, sampling=sp)]
                  for name, sp in (("greedy", SamplingParams()), ("seeded", SEEDED))}
    for name, sp in (("greedy", SamplingParams()), ("seeded", SEEDED)):
        got = []
        for p in PROMPTS:
            method = "lookup" if sp.greedy else "plain"      # prompt lookup is greedy only
            got.append(gen.generate(p, max_new_tokens=NEW, sampling=sp, method=method).tokens)
            m = gen.last_metrics
            assert m.drafted == 0 and m.plain_steps == m.iterations      # no window was verified
        assert got == served[name]


def _edited(src, tmp_path, edit):
    dst = copy_engines(src, tmp_path)
    edit_manifest(dst, edit)
    return dst


def _no_draft_graph(man):
    b = man["models"]["batch"]
    b["graphs"].pop("draft")
    b["source"].pop("draft_graph")


def _no_batch_costs(man):
    man["build"]["speculation"].pop("batch_costs_ms")


@pytest.mark.parametrize("edit", [_no_draft_graph, _no_batch_costs])
def test_a_batch_that_speculates_less_than_the_one_row_graphs_still_runs_every_request(
        tiny_batch_rows_draft_engines, tmp_path, served, edit):
    """A folder with a draft but no batched draft graph (an older build, a separate draft model,
    --draft-vocab), or without batched step costs: the batch of one speculates less than the
    one-row graphs would (lookup and pair rounds, or plain steps), and keeps the server's answers."""
    from specrt import manifest as mf
    from specrt.runtime.one import draft_left_out, plain_because
    folder = _edited(tiny_batch_rows_draft_engines, tmp_path, edit)
    man = mf.load(folder)
    assert draft_left_out(man) is (edit is _no_draft_graph)
    assert (plain_because(man) is None) is (edit is _no_draft_graph)
    gen = SpeculativeGenerator(folder, verify="none")
    assert gen.one is not None and gen.draft is None and not gen.one.has_draft
    for mode, sp in (("greedy", SamplingParams()), ("seeded", SEEDED)):
        got = [(c.tokens, c.finish_reason) for c in (gen.generate(p, max_new_tokens=NEW, sampling=sp) for p in PROMPTS)]
        assert got == served[mode]
        if edit is _no_batch_costs:
            assert gen.last_metrics.drafted == 0


def test_a_damaged_window_record_is_refused_not_ignored(tiny_batch_rows_draft_engines, tmp_path):
    from specrt.errors import ManifestError

    def edit(man):
        man["models"]["batch"]["parity"]["window_invariance"] = [True]
    with pytest.raises(ManifestError, match="window_invariance"):
        SpeculativeGenerator(_edited(tiny_batch_rows_draft_engines, tmp_path, edit), verify="none")


def test_metrics_count_the_tokens_the_caller_saw(gen):
    from specrt.runtime.batch.policy import BatchCosts
    full = gen.one.full
    saved = full.costs
    full.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)}, draft={1: 0.01, 8: 0.01})   # draft rounds
    try:
        ids = gen.encode_prompt(PROMPTS[0])
        for n in (2, 3, 4, 5, 6):               # some stop inside a round that emitted several tokens
            stream = gen.tokens(ids, max_new_tokens=NEW)
            seen = [next(stream) for _ in range(n)]
            stream.close()
            m = gen.last_metrics
            assert m.tokens == len(seen) == n and m.finish_reason is None
            assert m.accepted > 0
    finally:
        full.costs = saved


def test_inspect_says_which_engine_every_request_runs(tiny_batch_rows_draft_engines, tiny_batch_engines,
                                                      tiny_self_engines):
    from specrt import manifest as mf
    from specrt.tools.describe import describe

    def runs(folder):
        return next(line for line in describe(mf.load(folder)).splitlines() if line.startswith("runs "))
    assert "batched model" in runs(tiny_batch_rows_draft_engines) and "speculating" in runs(tiny_batch_rows_draft_engines)
    assert "plain steps only" in runs(tiny_batch_engines) and "--batch-attention rows" in runs(tiny_batch_engines)
    assert "one-row graphs" in runs(tiny_self_engines)


def test_bench_times_what_generate_runs_beside_the_one_row_graphs(tiny_batch_rows_draft_engines, tiny_self_engines,
                                                                  monkeypatch):
    import specrt.tools.bench
    from specrt.tools.bench import run_bench
    monkeypatch.setattr(specrt.tools.bench, "PROMPTS", PROMPTS)      # the tiny engines' context is short
    lines = []
    report = run_bench(str(tiny_batch_rows_draft_engines), prompts=2, max_new_tokens=12, out=lines.append)
    en = report["variants"][0]["engine"]
    assert en["tok_s"] > 0 and en["of"] == 2 and 0 <= en["same_as_one_row_plain"] <= 2
    assert any(line.startswith("what generate runs on ") for line in lines), lines
    report = run_bench(str(tiny_self_engines), prompts=1, max_new_tokens=8, out=lambda _: None)
    assert "engine" not in report["variants"][0]          # no batched model: generate runs the one-row graphs


def test_specrt_generate_runs_the_batch_of_one_unless_asked_for_the_one_row_graphs(tiny_batch_rows_draft_engines,
                                                                                   monkeypatch, capsys):
    import specrt.runtime
    from specrt.cli import main
    opened = []

    class Spy(SpeculativeGenerator):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            opened.append(self.target is None)         # the batched model: no one-row graphs
    monkeypatch.setattr(specrt.runtime, "SpeculativeGenerator", Spy)
    for engine in (None, "one-row"):
        argv = ["generate", str(tiny_batch_rows_draft_engines), PROMPTS[0], "--raw", "--max-new-tokens", "4"]
        assert main(argv + (["--engine", engine] if engine else [])) == 0
    assert opened == [True, False]
    capsys.readouterr()


@pytest.fixture(scope="module")
def drafting(tiny_batch_rows_draft_engines, tmp_path_factory):
    """The folder with a draft step a quarter of a target step (its costs edited): the policy
    drafts whatever this machine's load was when the build timed the tiny folder (timed beside
    other work, the tiny draft's step came out at x0.95 a target step, and no round drafted)."""
    eng = copy_engines(tiny_batch_rows_draft_engines, tmp_path_factory.mktemp("one") / "drafting")

    def cheap(raw):
        b = raw["build"]["speculation"]["batch_costs_ms"]
        b["draft"] = {n: round(ms / 4, 4) for n, ms in b["target"]["1"].items()}
    edit_manifest(eng, cheap)
    return SpeculativeGenerator(eng)


def test_a_batch_of_one_s_requests_share_what_the_draft_s_verdicts_taught(drafting):
    """Each request of the single stream gets a policy of its own (method, lookup n-gram), all
    over one pooled estimate of the draft (BatchPolicy.row_accept), so a request starts where
    the ones before it left the draft, not at the build's prior."""
    gen = drafting
    gen.generate(PROMPTS[0], max_new_tokens=NEW)
    first = gen.one.engine.policy
    pooled = first.pooled["draft"]
    seen = pooled.successes + pooled.failures
    gen.generate(PROMPTS[1], max_new_tokens=NEW)
    second = gen.one.engine.policy
    assert second is not first and second.pooled is first.pooled is gen.one.full.pooled
    assert pooled.successes + pooled.failures != seen          # the second request's verdicts went in too
