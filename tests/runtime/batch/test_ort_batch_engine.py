"""The batched engine on real graphs: a tiny int4 target built with `--batch --batch-prefill
same` (one ONNX graph with a symbolic row count, GroupQueryAttention, MatMulNBits, for prompt
chunks and decode steps alike), through ONNX Runtime. The int4 default's int8 prompt-chunk graph
(`--batch-prefill auto`) has its own tests (test_batch_prefill_rowwise.py); its prompt K/V
differ from the one-row graphs', so only this build can equal the one-stream runtime.

What a request gets must not depend on what else runs: greedy tokens equal the request run
alone and equal the one-stream runtime's plain decoding; a seeded sample is the same in any
batch; rows join and leave mid-generation (more requests than rows), stop on strings, or
are cancelled, and the others do not notice.
"""
from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from fake_batch import hold_until_added

from specrt.errors import ConfigError, ManifestError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.request import Delta, Done
from specrt.runtime.sampling import SamplingParams

PROMPTS = ["hello there", "a b c d e f g h i j k l m n o p q r s t u v w x y z and then some more words",
           "the quick brown fox", "x", "one two three four five six seven eight nine ten eleven twelve",
           "to be or not to be", "a"]
NEW = 24


@pytest.fixture(scope="module")
def gen(tiny_batch_same_engines):
    g = open_batch(tiny_batch_same_engines, max_num_seqs=3)
    yield g
    g.close()


@pytest.fixture(scope="module")
def alone(gen):
    """Each prompt with the engine to itself (one row)."""
    return [gen.generate(p, max_new_tokens=NEW).tokens for p in PROMPTS]


def test_the_build_records_the_batched_graph_and_its_invariance(tiny_batch_same_engines):
    man = json.loads((tiny_batch_same_engines / "manifest.json").read_text())
    b = man["models"]["batch"]
    assert list(b["graphs"]) == ["step"]
    assert b["graphs"]["step"]["batch"] == "dynamic" and b["graphs"]["step"]["dynamic_tokens"] is True
    inv = b["parity"]["batch_invariance"]
    assert inv["equal"] is True and inv["max_abs_logit_delta"] == 0.0 and inv["rows"] >= 2


def test_greedy_rows_equal_the_request_alone_and_the_one_stream_runtime(gen, alone, tiny_batch_same_engines,
                                                                      monkeypatch):
    # 7 requests on 3 rows: rows fill, finish at different steps (different prompt lengths and
    # EOS), and waiting requests join mid-generation; all 7 wait before the first step, so the
    # steps the rows share do not depend on how fast this thread submits
    st = gen.engine.stats
    steps, rows = st.steps, st.row_steps
    hold_until_added(gen.engine, len(PROMPTS), monkeypatch)
    together = [c.tokens for c in gen.generate_batch(PROMPTS, max_new_tokens=NEW)]
    assert together == alone
    assert (st.row_steps - rows) / (st.steps - steps) > 2.0     # the rows really shared steps
    one = SpeculativeGenerator(tiny_batch_same_engines, methods=("plain",))
    assert [one.generate(p, max_new_tokens=NEW, method="plain").tokens for p in PROMPTS] == alone


def test_rows_with_stop_strings_and_cancelled_rows_leave_the_others_unchanged(gen, alone):
    text0 = gen.tokenizer.decode(alone[0])
    stop = text0[len(text0) // 2:len(text0) // 2 + 2]
    # the cancelled request: one that alone runs to max_new_tokens (no EOS), cancelled from its own
    # sink at its first tokens, on the engine thread, so the cancel lands before its next step
    c = next(i for i in range(1, len(PROMPTS)) if len(alone[i]) == NEW)
    box, events, submitted, ended = {}, [], threading.Event(), threading.Event()

    def sink(ev):
        events.append(ev)
        if isinstance(ev, Delta) and submitted.wait(60):      # (submit() may not have returned yet)
            box["h"].cancel()
        elif isinstance(ev, Done):
            ended.set()

    handles = [gen.submit(p, max_new_tokens=NEW, stop=[stop] if i == 0 else (), sink=sink if i == c else None)
               for i, p in enumerate(PROMPTS)]
    box["h"] = handles[c]
    submitted.set()
    out = [h.result() if i != c else None for i, h in enumerate(handles)]
    assert out[0].finish_reason == "stop" and stop not in out[0].text
    assert all(out[i].tokens == alone[i] for i in range(len(PROMPTS)) if i not in (0, c))
    assert ended.wait(60), events
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "cancelled" and done.completion_tokens < NEW


def test_a_seeded_sample_is_the_same_whatever_else_is_in_the_batch(gen):
    hot = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    solo = gen.generate(PROMPTS[2], max_new_tokens=NEW, sampling=hot).tokens
    others = [gen.submit(p, max_new_tokens=NEW, sampling=SamplingParams(temperature=0.7, seed=i))
              for i, p in enumerate(PROMPTS[3:])]
    mixed = gen.submit(PROMPTS[2], max_new_tokens=NEW, sampling=hot)
    assert mixed.result().tokens == solo
    for h in others:
        h.result()
    unseeded = {tuple(gen.generate(PROMPTS[2], max_new_tokens=NEW, sampling=SamplingParams(temperature=1.0)).tokens)
                for _ in range(3)}
    assert len(unseeded) > 1                 # sampling really samples


def test_requests_from_many_threads(gen, alone):
    out = [None] * len(PROMPTS)

    def one(i):
        out[i] = gen.generate(PROMPTS[i], max_new_tokens=NEW).tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert out == alone


def test_engines_without_a_batched_model_are_refused_more_than_one_row_with_the_fix(tiny_int4_engines):
    with pytest.raises(ConfigError, match="--batch.*max_num_seqs=1"):
        open_batch(tiny_int4_engines)


@pytest.mark.parametrize("fixture", ["tiny_int4_engines", "tiny_truncated_engines"])
def test_a_folder_without_a_batched_model_opens_as_one_row_with_the_generators_answers(request, fixture):
    """open_batch(max_num_seqs=1) on a folder without a batched model: its one-row graphs on the
    same engine (batch/one_row.py), from any thread, with SpeculativeGenerator's tokens, greedy and
    seeded, and the draft (int8 over the target's cache, or a draft model with its own) used."""
    folder = request.getfixturevalue(fixture)
    gen = SpeculativeGenerator(folder)
    seeded = SamplingParams(temperature=0.8, seed=5)
    want = {name: [gen.generate(p, max_new_tokens=NEW, sampling=sp).tokens for p in PROMPTS]
            for name, sp in (("greedy", SamplingParams()), ("seeded", seeded))}
    with open_batch(folder, max_num_seqs=1) as g:
        got = {name: [c.tokens for c in g.generate_batch(PROMPTS, max_new_tokens=NEW, sampling=sp)]
               for name, sp in (("greedy", SamplingParams()), ("seeded", seeded))}
        assert g.engine.stats.choices["draft"] > 0
    assert got == want


def test_a_manifest_that_does_not_show_invariance_is_refused(tiny_batch_same_engines, tmp_path):
    import shutil
    copy = tmp_path / "e"
    shutil.copytree(tiny_batch_same_engines, copy)
    man = json.loads((copy / "manifest.json").read_text())
    man["models"]["batch"]["parity"]["batch_invariance"]["equal"] = False
    (copy / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ConfigError, match="independently"):
        open_batch(copy)
    man["models"]["batch"]["graphs"]["step"]["batch"] = "sometimes"
    (copy / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(ManifestError, match="batch"):
        open_batch(copy)


def test_the_model_refuses_several_tokens_in_several_gqa_rows(gen):
    from specrt.errors import BackendError
    m = gen.engine.target
    assert m.multi_token_rows == 1
    with pytest.raises(BackendError, match="GroupQueryAttention"):
        m.step("step", np.zeros((2, 2), np.int64), np.zeros(2, np.int64), 0)


def test_a_prefill_chunk_computes_the_logits_of_its_last_position_only(gen, tiny_batch_same_engines):
    """The engine binds logit_pos [[last]] for a prefill chunk (the LM head over one row, not
    the chunk), and those logits are the full step's row, bit for bit."""
    m = gen.engine.target
    assert all(m.has_positions.values())
    keys = [k for k in m._bindings if k[3] > 1]          # (file, first_row, n, T, P): multi-token calls
    assert keys and all(k[4] == 1 for k in keys), keys   # prefill chunks: P = 1
    toks = np.arange(3, 19, dtype=np.int64)[None, :]
    full = m.step("step", toks, np.zeros(1, np.int64), 0).copy()           # [1, 16, V]
    got = m.step("step", toks, np.zeros(1, np.int64), 0, np.array([[15, 2]], np.int64)).copy()
    np.testing.assert_array_equal(got[0], full[0, [15, 2]])


def _without_logit_pos(path):
    """Rewrite a batched graph as specrt built it before logit_pos: every position's logits
    (logit_pos computed inside the graph as 0..T-1 in each row)."""
    import onnx
    from onnx import helper, numpy_helper
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    pos = next(i for i in g.input if i.name == "logit_pos")
    g.input.remove(pos)
    g.initializer.extend([numpy_helper.from_array(np.array(1, np.int64), "lp_one"),
                          numpy_helper.from_array(np.array(1, np.int64), "lp_axis")])
    g.node.insert(0, helper.make_node("Shape", ["input_ids"], ["lp_shape"]))
    g.node.insert(1, helper.make_node("ConstantOfShape", ["lp_shape"], ["lp_ones"],
                                      value=numpy_helper.from_array(np.array([1], np.int64))))
    g.node.insert(2, helper.make_node("CumSum", ["lp_ones", "lp_axis"], ["lp_count"]))
    g.node.insert(3, helper.make_node("Sub", ["lp_count", "lp_one"], ["logit_pos"]))
    onnx.save(model, str(path))


def test_graphs_built_before_logit_pos_still_serve_the_same_tokens(tiny_batch_same_engines, alone, tmp_path):
    import shutil
    copy = tmp_path / "old"
    shutil.copytree(tiny_batch_same_engines, copy)
    _without_logit_pos(copy / "batch" / "step.onnx")
    g = open_batch(copy, max_num_seqs=3, verify="none")
    try:
        assert not any(g.engine.target.has_positions.values())
        assert [c.tokens for c in g.generate_batch(PROMPTS, max_new_tokens=NEW)] == alone
    finally:
        g.close()
