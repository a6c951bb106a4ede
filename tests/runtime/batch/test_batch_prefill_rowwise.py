"""`specrt build --batch --batch-prefill rowwise` (the int4 default, `auto`): the batched model
gets a second graph, "prefill" (the same batched graph with int8 per-channel weights, ONNX
Runtime's int8 GEMM), that runs prompt chunks, while decode steps stay in "step" (int4
MatMulNBits). A request's tokens still do not depend on what else is in the batch: prompt
chunks run one row at a time through the same graph, whatever the batch."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from specrt.errors import ConfigError, ManifestError
from specrt.runtime.batch.generator import open_batch

PROMPTS = ["hello there", "a b c d e f g h i j k l m n o p q r s t u v w x y z and then some more words",
           "the quick brown fox", "x", "one two three four five six seven eight nine ten eleven twelve",
           "to be or not to be", "a"]
NEW = 20


@pytest.fixture(scope="module", params=["gqa step", "rows step, gqa prompt"])
def engines(request):
    # int4 --batch: a rowwise prompt graph by default; beside a GroupQueryAttention step graph
    # (--batch-attention gqa) and beside a "rows" one (the default), where it attends with
    # GroupQueryAttention over the rows graph's cache (rowwise-gqa, test_prefill_gqa.py)
    return request.getfixturevalue("tiny_batch_engines" if request.param == "gqa step" else "tiny_batch_int4_engines")


@pytest.fixture(scope="module")
def gen(engines):
    g = open_batch(engines, max_num_seqs=3)
    yield g
    g.close()


def _ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_the_build_records_two_graphs_one_weights_file_and_invariance(engines):
    b = json.loads((engines / "manifest.json").read_text())["models"]["batch"]
    assert set(b["graphs"]) - {"draft"} == {"step", "prefill"}
    assert all(b["graphs"][g]["batch"] == "dynamic" and b["graphs"][g]["dynamic_tokens"] for g in ("step", "prefill"))
    assert b["weights"]["file"] == "batch/weights.bin"
    assert "MatMulNBits" in _ops(engines / "batch/step.onnx")
    assert "MatMulIntegerToFloat" in _ops(engines / "batch/prefill.onnx")
    assert "MatMulNBits" not in _ops(engines / "batch/prefill.onnx")
    assert b["source"]["prefill_graph"]["method"].startswith("rowwise int8")
    inv = b["parity"]["batch_invariance"]
    assert inv["equal"] is True and inv["prefill_last_position_delta"] == 0.0


def test_inspect_shows_both_graphs_and_the_prefill_quantization(engines):
    from specrt.manifest import load
    from specrt.tools.describe import describe
    text = describe(load(engines))
    assert "graph    step     T=any  batch/step.onnx  (rows: any)" in text
    assert "graph    prefill  T=any  batch/prefill.onnx  (rows: any)" in text
    assert "prefill  rowwise int8 (MatMulIntegerToFloat)" in text


def test_prompt_chunks_run_the_prefill_graph_and_decode_steps_the_step_graph(gen):
    gen.generate(PROMPTS[1], max_new_tokens=4)
    m = gen.engine.target
    assert m._file_of["prefill"].endswith("prefill.onnx") and m._file_of["decode"].endswith("step.onnx")
    used = {(k[0].rsplit("/", 1)[-1], k[3] > 1) for k in m._bindings}      # (file, several tokens a row)
    assert ("prefill.onnx", True) in used and ("prefill.onnx", False) not in used
    if m.multi_token_rows is not None:      # a GroupQueryAttention step graph: one-token steps only
        assert used - {("prefill.onnx", True)} == {("step.onnx", False)}
    else:                                   # a rows step graph: plain steps or verify windows
        assert {f for f, _ in used} == {"prefill.onnx", "step.onnx"}


def test_greedy_and_seeded_rows_equal_the_request_alone(gen):
    from specrt.runtime.sampling import SamplingParams
    alone = [gen.generate(p, max_new_tokens=NEW).tokens for p in PROMPTS]
    assert [c.tokens for c in gen.generate_batch(PROMPTS, max_new_tokens=NEW)] == alone
    hot = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    solo = gen.generate(PROMPTS[2], max_new_tokens=NEW, sampling=hot).tokens
    others = [gen.submit(p, max_new_tokens=NEW, sampling=SamplingParams(temperature=0.7, seed=i))
              for i, p in enumerate(PROMPTS[3:])]
    assert gen.submit(PROMPTS[2], max_new_tokens=NEW, sampling=hot).result().tokens == solo
    for h in others:
        h.result()


def test_the_prefill_graph_writes_the_cache_the_decode_graph_reads(engines, gen):
    """The first decode step after a rowwise prefill reads the K/V that graph wrote: its
    logits equal those of the same prompt prefilled token by token through "step"."""
    m = gen.engine.target
    ids = np.arange(5, 21, dtype=np.int64)[None, :]          # 16 prompt tokens
    m.step("prefill", ids, np.zeros(1, np.int64), 0)
    a = m.step("decode", np.array([[7]], np.int64), np.array([16]), 0).copy()
    for t in range(16):                                        # the same prompt through "step", row 1
        m.step("decode", ids[:, t:t + 1], np.array([t]), 1)
    b_int4 = m.step("decode", np.array([[7]], np.int64), np.array([16]), 1).copy()
    for kv in m.cache.keys + m.cache.values:                  # row 2: a prompt never written (zeros)
        kv[2] = 0
    c = m.step("decode", np.array([[7]], np.int64), np.array([16]), 2).copy()
    # different weights wrote the caches of rows 0 and 1 (int8 vs int4): near, not equal; a
    # decode step that did not read what prefill wrote would be as far as the empty row
    assert np.linalg.norm(a - b_int4) < 0.5 * np.linalg.norm(a - c)


def test_the_option_needs_batch_and_a_known_kind(tiny_pair, tmp_path):
    from specrt.builder.config import BuildConfig
    target, _ = tiny_pair
    with pytest.raises(ConfigError, match="add --batch"):
        BuildConfig(target=str(target), out=str(tmp_path / "x"), batch_prefill="rowwise")
    with pytest.raises(ConfigError, match="same, rowwise"):
        BuildConfig(target=str(target), out=str(tmp_path / "x"), batch=True, batch_prefill="int2")


def test_auto_is_rowwise_for_int4_only_and_same_keeps_one_graph(tiny_batch_same_engines):
    from specrt.builder.config import BuildConfig
    graph = {(prec, batch, choice): BuildConfig(target="t", out="o", precision=prec, batch=batch,
                                                batch_prefill=choice).batch_prefill_graph
             for prec in ("fp32", "int8", "int4") for batch in (False, True) for choice in ("auto", "same")}
    assert {k for k, v in graph.items() if v != "same"} == {("int4", True, "auto")}
    assert graph["int4", True, "auto"] == "rowwise-gqa"
    assert BuildConfig(target="t", out="o", precision="int4", batch=True,
                       hidden_layers=(0,)).batch_prefill_graph == "rowwise"     # the gqa prompt graph has none
    assert BuildConfig(target="t", out="o", precision="fp32", batch=True,
                       batch_prefill="rowwise").batch_prefill_graph == "rowwise"
    b = json.loads((tiny_batch_same_engines / "manifest.json").read_text())["models"]["batch"]
    assert set(b["graphs"]) == {"step"} and "prefill_graph" not in b["source"]


def test_device_buckets_refuse_two_graph_files_naming_the_fix(engines):
    from specrt.runtime.backends.device_batch import DeviceBatchModel
    from specrt.manifest import load
    man = load(engines)
    with pytest.raises(ManifestError, match="--batch-prefill same"):
        DeviceBatchModel(engines, man.models["batch"], man.shapes, rows=2, execution="cpu")


def test_the_embedding_lookup_reads_the_table_without_a_copy(engines, tiny_int4_engines, tiny_engines):
    """A tied model gathers its embeddings from the LM head table. Exported as lm_head[:, ids]
    (Transpose(table) + GatherND), ONNX Runtime folds the transpose into a V*C copy in every
    session (~108 MiB each on SmolLM2) and torch folds it into a second table on disk for small
    models. The exporter gathers the [C, V] table's columns (Gather axis 1: fp32 graphs, whose LM
    head MatMul reads the same table); once the head is quantized the table is stored [V, C] and
    gathered by rows (axis 0: a lookup reads its tokens' rows, not a page of every row)."""
    graphs = [(p, True) for p in sorted(engines.rglob("*.onnx")) + sorted(tiny_int4_engines.rglob("*.onnx"))]
    graphs += [(p, False) for p in sorted((tiny_engines / "target").rglob("*.onnx"))]
    assert len(graphs) >= 7
    for path, quantized in graphs:
        g = onnx.load(str(path), load_external_data=False).graph
        inits = {i.name: i for i in g.initializer}
        transposed = [n.input[0] for n in g.node if n.op_type == "Transpose" and n.input[0] in inits]
        assert not transposed, f"{path.name}: Transpose of initializer(s) {transposed}"
        tables = [(n.op_type, {a.name: a.i for a in n.attribute}.get("axis", 0), list(inits[n.input[0]].dims))
                  for n in g.node if n.op_type in ("Gather", "GatherND") and n.input[0] in inits]
        vocab = g.output[0].type.tensor_type.shape.dim[-1].dim_value
        want = ("Gather", 0, 0) if quantized else ("Gather", 1, 1)      # op, axis, the table's vocab dim
        assert len(tables) == 1 and tables[0][:2] == want[:2] and tables[0][2][want[2]] == vocab, (path, tables)
