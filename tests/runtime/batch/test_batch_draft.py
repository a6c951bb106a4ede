"""The int8 self-draft inside a batch, on real graphs: the tiny fp32 target built with `--draft
int8 --batch --batch-attention rows`. The build gives the batched model a "draft" graph (the
int8 copy of the model, one token a row through GroupQueryAttention over the step graph's
cache), measures its agreement with the batched target and its step
cost; `open_batch` runs it over the target's cache, one token a row per draft step, and every
request still gets exactly the tokens it gets alone without speculation, greedy and seeded,
while rows join and leave.
"""
from __future__ import annotations

import json

import onnx
import pytest
from bad_input_helpers import copy_engines, edit_manifest
from fake_batch import hold_until_added

from specrt.builder.gates.batch import draft_graph_attention, draft_spec
from specrt.errors import ManifestError
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.policy import BatchCosts
from specrt.runtime.batch.policy import RoundKind
from specrt.runtime.sampling import SamplingParams

PROMPTS = ["a b a b a b a b a b", "the cat the cat the cat", "hello there", "x y z x y z x y z",
           "one two three one two three", "to be or not to be", "abcabcabcabc"]
NEW = 24
# every target pass costs the same and a draft step almost nothing: the policy drafts wherever a
# row has room, not where the build's timings (on a machine that may have been busy) favoured it
DRAFT_PAYS = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)}, draft={1: 0.01, 8: 0.01})


@pytest.fixture(scope="module")
def plain_alone(tiny_batch_rows_draft_engines):
    with open_batch(tiny_batch_rows_draft_engines, max_num_seqs=1, speculate=False) as g:
        assert g.engine.draft is None and not g.engine.policy.has_draft
        return [g.generate(p, max_new_tokens=NEW).tokens for p in PROMPTS]


def test_the_build_records_the_batched_draft_its_agreement_and_cost(tiny_batch_rows_draft_engines):
    man = json.loads((tiny_batch_rows_draft_engines / "manifest.json").read_text())
    batch = man["models"]["batch"]
    assert set(batch["graphs"]) == {"step", "draft"}
    assert batch["source"]["draft_graph"]["bits"] == 8
    # one token a row through GroupQueryAttention (the target's one-row attention), over the
    # rows step graph's cache: a symbolic length, written in place
    assert batch["source"]["draft_graph"]["attention"] == "gqa" and batch["graphs"]["draft"]["tokens"] == 1
    graph = onnx.load(str(tiny_batch_rows_draft_engines / batch["graphs"]["draft"]["file"]), load_external_data=False)
    assert sum(n.op_type == "GroupQueryAttention" for n in graph.graph.node) == man["models"]["batch"]["dims"]["layers"]
    assert isinstance(graph.graph.input[3].type.tensor_type.shape.dim[2].dim_param, str) and \
        graph.graph.input[3].type.tensor_type.shape.dim[2].dim_param
    agree = batch["parity"]["draft_agreement"]
    assert agree["positions"] > 0 and 0.5 < agree["top1_agreement"] <= 1.0
    draft = man["build"]["speculation"]["batch_costs_ms"]["draft"]
    assert set(draft) == {"1", "2", "4", "8"} and all(ms > 0 for ms in draft.values())
    with open_batch(tiny_batch_rows_draft_engines, max_num_seqs=2) as g:
        assert g.engine.policy.has_draft and g.engine.draft is not None
        assert g.engine.draft.cache is g.engine.target.cache          # the draft writes the target's rows
        assert g.engine.draft.grows and g.engine.draft.multi_token_rows == 1
        assert g.engine.policy.priors["draft"] == agree["top1_agreement"]


def test_only_a_batch_that_verifies_windows_gets_a_draft_graph():
    class Cfg:
        draft_vocab, draft_kind = None, "int8"
    assert draft_spec(Cfg, "rows") is not None and draft_spec(Cfg, "standard") is not None
    assert draft_spec(Cfg, "gqa") is None            # GroupQueryAttention: no windows in a batch
    Cfg.draft_kind = "none"
    assert draft_spec(Cfg, "rows") is None
    Cfg.draft_kind, Cfg.draft_vocab = "int8", 64    # a cut LM head: not the batched step's copy
    assert draft_spec(Cfg, "rows") is None


def test_the_draft_graph_attends_with_groupqueryattention_beside_a_rows_step_of_a_gqa_target():
    class Cfg:
        attention = "gqa"
    assert draft_graph_attention(Cfg, "rows", {"attention": "gqa"}) == "gqa"    # an fp32 target's export
    assert draft_graph_attention(Cfg, "rows", {}) == "gqa"       # a quantized target's part: the build's attention
    assert draft_graph_attention(Cfg, "rows", {"attention": "portable"}) is None
    assert draft_graph_attention(Cfg, "standard", {}) is None    # standard ops stay standard (no com.microsoft)


def test_the_build_refuses_a_draft_that_writes_before_a_rows_length():
    """check_draft_keeps_the_cache (builder/gates/batch.py): a draft step over the target's cache
    may write each row's position `length` only (the verify pass overwrites it). Fakes: a cache
    of 2 rows x 1 layer; a draft writing at length passes, one writing a position early fails."""
    import numpy as np
    from specrt.builder.gates.batch import check_draft_keeps_the_cache
    from specrt.errors import ParityError

    class Cache:
        keys = [np.arange(2 * 2 * 8 * 4, dtype=np.float32).reshape(2, 2, 8, 4)]
        values = [np.zeros((2, 2, 8, 4), np.float32)]

    class Draft:
        def __init__(self, shift):
            self.shift = shift

        def step(self, graph, toks, starts, first_row):
            for i, s0 in enumerate(starts):
                Cache.keys[0][first_row + i, :, s0 + self.shift] = -1.0
            return np.zeros((len(starts), 1, 5), np.float32)

    class Model:
        cache = Cache
    rows = [[1, 2, 3], [4, 5, 6, 7, 8]]
    check_draft_keeps_the_cache(Model, Draft(0), [9, 9], rows)
    with pytest.raises(ParityError, match="row 0 before the row's length"):
        check_draft_keeps_the_cache(Model, Draft(-1), [9, 9], rows)


def test_the_draft_inside_a_batch_gives_every_request_its_tokens_alone(tiny_batch_rows_draft_engines, plain_alone,
                                                                      monkeypatch):
    # 3 rows for 7 requests: rows join and leave while the draft proposes for the others
    with open_batch(tiny_batch_rows_draft_engines, max_num_seqs=3) as g:
        g.engine.policy.costs = DRAFT_PAYS
        hold_until_added(g.engine, len(PROMPTS), monkeypatch)
        got = [c.tokens for c in g.generate_batch(PROMPTS, max_new_tokens=NEW)]
        st = g.engine.stats
    assert got == plain_alone
    assert st.choices[RoundKind.DRAFT.value] > 0, st.choices
    assert st.tokens > st.row_steps + len(PROMPTS)       # drafted tokens were accepted
    assert st.row_steps / st.steps > 2.0                 # rows shared the steps


def test_a_seeded_sample_is_the_same_alone_and_among_drafted_rows(tiny_batch_rows_draft_engines):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=99)
    with open_batch(tiny_batch_rows_draft_engines, max_num_seqs=1, speculate=False) as g:
        alone = g.generate(PROMPTS[1], max_new_tokens=NEW, sampling=sp).tokens
    with open_batch(tiny_batch_rows_draft_engines, max_num_seqs=4) as g:
        g.engine.policy.costs = DRAFT_PAYS
        others = [g.submit(p, max_new_tokens=NEW, sampling=SamplingParams(temperature=1.0, seed=i))
                  for i, p in enumerate(PROMPTS[2:5])]
        mid = g.submit(PROMPTS[1], max_new_tokens=NEW, sampling=sp)
        assert mid.result().tokens == alone
        for h in others:
            h.result()
        assert g.engine.stats.choices[RoundKind.DRAFT.value] > 0


def _edited(src, tmp_path, edit):
    dst = copy_engines(src, tmp_path)
    edit_manifest(dst, edit)
    return dst


def test_a_draft_graph_without_its_source_record_is_refused(tiny_batch_rows_draft_engines, tmp_path):
    dst = _edited(tiny_batch_rows_draft_engines, tmp_path,
                  lambda m: m["models"]["batch"]["source"].pop("draft_graph"))
    with pytest.raises(ManifestError, match="draft graph"):
        open_batch(dst, max_num_seqs=2, verify="none")


@pytest.mark.parametrize("value", [None, "0.9", 1.5, True])
def test_a_damaged_draft_agreement_is_refused_when_the_batch_opens(tiny_batch_rows_draft_engines, tmp_path, value):
    def edit(m):
        m["models"]["batch"]["parity"]["draft_agreement"] = {"top1_agreement": value}
    dst = _edited(tiny_batch_rows_draft_engines, tmp_path, edit)
    with pytest.raises(ManifestError, match="draft_agreement"):
        open_batch(dst, max_num_seqs=2, verify="none")


@pytest.mark.parametrize("value", ["int8", [1], None])
def test_inspect_survives_a_damaged_draft_record(tiny_batch_rows_draft_engines, tmp_path, value):
    from specrt.manifest import load
    from specrt.tools.describe import describe

    def edit(m):
        m["models"]["batch"]["source"]["draft_graph"] = value
        m["models"]["batch"]["parity"]["draft_agreement"] = value
    text = describe(load(_edited(tiny_batch_rows_draft_engines, tmp_path, edit)))
    assert "[batch]" in text


def test_inspect_says_how_the_draft_graph_attends(tiny_batch_rows_draft_engines):
    from specrt.manifest import load
    from specrt.tools.describe import describe
    assert "8-bit, attention gqa (one token a row):" in describe(load(tiny_batch_rows_draft_engines))
