"""Graphs with a batch dimension (export/batch.py): B rows of T tokens, each row at its own
past length. Row b of a batched call gives, bit for bit, what today's one-row graph gives
that row alone (logits and the K/V it writes), for every attention variant, rows of
different lengths, T=1 and T>1; the dims are symbolic, or a static bucket; quantizers keep
them; and the default export is still today's graph."""
from __future__ import annotations


import numpy as np
import onnx
import onnxruntime as ort
import pytest
from tiny_models import make_tiny_model_dir

from specrt.export import onnx_export, sources
from specrt.manifest import Shapes
from specrt.runtime.backends.ort_cpu import session_options
from cpu_features import AVX2_ONLY_REASON, INT8_DOT

# MatMulNBits with int8 compute: its rows are invariant with VNNI/AMX kernels only
AVX2_XFAIL = pytest.mark.xfail(not INT8_DOT, reason=AVX2_ONLY_REASON, strict=True)

SHAPES = Shapes(batch=1, max_context=64, prefill_chunk=16, k=3)     # kv capacity M = 80
LAYERS = 2
LENS = [0, 7, 30, 3, 60]           # rows' past lengths: empty, short, long, ...
ONE_ROW = {1: "decode", 4: "verify", 16: "prefill"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batch")
    return tmp, sources.load_source(make_tiny_model_dir(tmp / "model", "llama", layers=LAYERS))


@pytest.fixture(scope="module")
def exports(llama):
    """attention -> (folder of today's one-row graphs, folder of the batched graph "step")."""
    tmp, lm = llama
    out = {}
    for att in ("gqa", "portable", "standard"):
        onnx_export.export_model(lm, SHAPES, tmp / f"one-{att}", attention=att)
        part = onnx_export.export_model(lm, SHAPES, tmp / f"batched-{att}", attention=att, batch="dynamic",
                                        tokens={"step": "dynamic"})
        out[att] = (tmp / f"one-{att}", tmp / f"batched-{att}", part)
    return out


class _Session:
    """An InferenceSession that binds logit_pos (batched graphs) to every position unless the
    feeds name it, so a batched call compares with the one-row graphs' [T, V] logits."""

    def __init__(self, path):
        self.path = path
        self.sess = ort.InferenceSession(str(path), session_options(2), providers=["CPUExecutionProvider"])
        self.positions = any(i.name == "logit_pos" for i in self.sess.get_inputs())

    def run(self, names, feeds):
        if self.positions and "logit_pos" not in feeds:
            B, T = feeds["input_ids"].shape
            feeds = {**feeds, "logit_pos": np.tile(np.arange(T, dtype=np.int64), (B, 1))}
        return self.sess.run(names, feeds)

    def get_outputs(self):
        return self.sess.get_outputs()


def _session(path):
    return _Session(path)


def _feeds(ids, lens, caches):
    f = {"input_ids": np.asarray(ids, np.int64), "past_len": np.asarray(lens, np.int64)}
    for i in range(LAYERS):
        f[f"past_k_{i}"], f[f"past_v_{i}"] = caches[2 * i], caches[2 * i + 1]
    return f


def _random_rows(B, T, seed=0, kv_heads=2):
    """B rows: random caches (rows past each length hold junk the graph must not read), ids."""
    rng = np.random.default_rng(seed)
    caches = [rng.standard_normal((B, kv_heads, SHAPES.kv_capacity, 16)).astype(np.float32)
              for _ in range(2 * LAYERS)]
    return rng.integers(5, 128, (B, T)), caches


def _check_rows_against_one_row_graph(one_dir, batched, lens, T, seed=0, kv_heads=2):
    """Every output of row b of one B-row call == the one-row graph's output for row b alone."""
    ids, caches = _random_rows(len(lens), T, seed, kv_heads)
    got = batched.run(None, _feeds(ids, lens, caches))
    one = _session(one_dir / f"{ONE_ROW[T]}.onnx")
    for b in range(len(lens)):
        want = one.run(None, _feeds(ids[b:b + 1], lens[b:b + 1], [c[b:b + 1] for c in caches]))
        for name, g, w in zip([o.name for o in one.get_outputs()], got, want):
            np.testing.assert_array_equal(g[b], w[0], err_msg=f"row {b} (past_len {lens[b]}, T={T}): {name}")


@pytest.mark.parametrize("att", ["portable", "standard"])
@pytest.mark.parametrize("T", [1, 4, 16])
def test_each_row_of_a_batched_call_is_the_one_row_graph_bit_for_bit(exports, att, T):
    one_dir, batched_dir, _ = exports[att]
    _check_rows_against_one_row_graph(one_dir, _session(batched_dir / "step.onnx"), LENS, T)


def test_gqa_batched_decode_rows_of_different_lengths_are_the_one_row_graph(exports):
    one_dir, batched_dir, _ = exports["gqa"]
    batched = _session(batched_dir / "step.onnx")
    _check_rows_against_one_row_graph(one_dir, batched, LENS, 1)
    # windows of several tokens: one row at any length, or many rows that all start empty
    _check_rows_against_one_row_graph(one_dir, batched, [30], 4)
    _check_rows_against_one_row_graph(one_dir, batched, [0, 0, 0], 16)


def test_gqa_refuses_many_rows_of_several_tokens_over_a_cache(exports):
    """ONNX Runtime's CPU GroupQueryAttention (1.32) runs B > 1 with T > 1 only when every row
    starts empty: batched verify windows and prefill chunks need the standard or portable
    graph (or one row per call). The refusal is loud, never a wrong row."""
    _, batched_dir, _ = exports["gqa"]
    ids, caches = _random_rows(2, 4)
    with pytest.raises(Exception, match="batch_size must be 1 when sequence_length > 1"):
        _session(batched_dir / "step.onnx").run(None, _feeds(ids, [3, 5], caches))


def test_a_row_ignores_the_other_rows_contents_and_lengths(exports):
    _, batched_dir, _ = exports["standard"]
    batched = _session(batched_dir / "step.onnx")
    ids, caches = _random_rows(4, 4, seed=1)
    first = batched.run(None, _feeds(ids, [9, 2, 40, 11], caches))
    ids2, caches2 = _random_rows(4, 4, seed=2)
    ids2[0], caches2 = ids[0], [np.concatenate([c[:1], c2[1:]]) for c, c2 in zip(caches, caches2)]
    second = batched.run(None, _feeds(ids2, [9, 30, 0, 55], caches2))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a[0], b[0])


def test_batched_graphs_have_symbolic_batch_and_tokens(exports):
    for att, (_, batched_dir, part) in exports.items():
        proto = onnx.load(str(batched_dir / "step.onnx"), load_external_data=False)
        dims = {t.name: [d.dim_param or d.dim_value for d in t.type.tensor_type.shape.dim]
                for t in [*proto.graph.input, *proto.graph.output]}
        M = SHAPES.kv_capacity
        assert dims["input_ids"] == ["batch", "tokens"] and dims["past_len"] == ["batch"], att
        assert dims["past_k_1"] == ["batch", 2, M, 16] and dims["logits"] == ["batch", "positions", 128], att
        assert dims["logit_pos"] == ["batch", "positions"], att
        out = "new_v_1" if att == "portable" else "present_v_1"
        assert dims[out] == (["batch", 2, "tokens", 16] if att == "portable" else ["batch", 2, M, 16]), att
        assert part["batch"] == "dynamic" and part["graphs"]["step"]["tokens"] == "dynamic"


@pytest.mark.parametrize("att", ["gqa", "portable", "standard"])
def test_logit_pos_gives_the_logits_of_those_positions_bit_for_bit(exports, att):
    """A prefill chunk asks for its last position only: the rows it names are the rows every
    position's logits give, whatever P, and the K/V written are unchanged."""
    _, batched_dir, _ = exports[att]
    sess = _session(batched_dir / "step.onnx")
    lens = [7] if att == "gqa" else [7, 0, 33]      # CPU GQA: several tokens for one row only
    ids, caches = _random_rows(len(lens), 16, seed=4)
    full = sess.run(None, _feeds(ids, lens, [c.copy() for c in caches]))
    for pos in ([[15]], [[14, 15]], [[3, 0, 9]]):
        pos = np.repeat(np.asarray(pos, np.int64), len(lens), axis=0)
        got = sess.run(None, {**_feeds(ids, lens, [c.copy() for c in caches]), "logit_pos": pos})
        assert got[0].shape == (len(lens), pos.shape[1], 128)
        np.testing.assert_array_equal(got[0], np.take_along_axis(full[0], pos[:, :, None], axis=1))
        for g, w in zip(got[1:], full[1:]):
            np.testing.assert_array_equal(g, w)


def test_fusions_still_match_on_the_batched_gqa_graph(exports):
    part = exports["gqa"][2]
    assert part["fusions"]["step"]["skip_simplified_layer_norm"] == 2 * LAYERS
    assert part["fusions"]["step"]["packed_qkv_attention"] == LAYERS


def test_a_static_batch_bucket_has_fixed_shapes_and_the_same_rows(llama, exports):
    tmp, lm = llama
    part = onnx_export.export_model(lm, SHAPES, tmp / "bucket3", attention="standard", batch=3, tokens={"verify": 4})
    proto = onnx.load(str(tmp / "bucket3" / "verify.onnx"), load_external_data=False)
    assert [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim] == [3, 4]
    assert part["batch"] == 3
    ids, caches = _random_rows(3, 4)
    lens = [5, 0, 33]
    got = _session(tmp / "bucket3" / "verify.onnx").run(None, _feeds(ids, lens, caches))
    want = _session(exports["standard"][1] / "step.onnx").run(None, _feeds(ids, lens, caches))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_a_gqa_draft_graph_beside_rows_reads_a_cache_of_any_length_as_the_one_row_graph(llama, exports, tmp_path):
    """The batched int8 self-draft's graph (builder/gates/batch.py): one token a row through
    GroupQueryAttention, over the "rows" step graph's cache, whose length is symbolic (the
    runtime binds the positions its rows use, not the capacity). Each row's logits and the K/V
    it writes are the one-row gqa decode graph's, reading the whole capacity, bit for bit."""
    one_dir = exports["gqa"][0]
    part = onnx_export.export_model(llama[1], SHAPES, tmp_path, attention="rows", batch="dynamic",
                                    tokens={"step": "dynamic", "draft": 1}, graph_attention={"draft": "gqa"})
    assert part["graph_attention"] == {"draft": "gqa"} and part["attention"] == "rows"
    draft = _session(tmp_path / "draft.onnx")
    assert [i.shape[2] for i in draft.sess.get_inputs()[3:]] == ["kv_len"] * 2 * LAYERS
    ids, caches = _random_rows(len(LENS), 1)
    L = 64                                                   # < the capacity, 80; > every row's length
    # as the runtime binds it: past and present one buffer (in place); each row's positions from
    # its length on hold NaN, which the step must neither read nor keep (it writes `length` only)
    bound = [np.ascontiguousarray(c[:, :, :L]) for c in caches]
    for c in bound:
        for b, n in enumerate(LENS):
            c[b, :, n:] = np.nan
    values = [ort.OrtValue.ortvalue_from_numpy(c) for c in bound]
    io = draft.sess.io_binding()
    for name, v in _feeds(ids, LENS, bound).items():
        if name.startswith("past_k") or name.startswith("past_v"):
            continue
        io.bind_cpu_input(name, v)
    io.bind_cpu_input("logit_pos", np.zeros((len(LENS), 1), np.int64))
    io.bind_output("logits", "cpu")
    for i, v in enumerate(values):
        kv = ("k", "v")[i % 2]
        io.bind_ortvalue_input(f"past_{kv}_{i // 2}", v)
        io.bind_ortvalue_output(f"present_{kv}_{i // 2}", v)
    draft.sess.run_with_iobinding(io)
    logits = io.copy_outputs_to_cpu()[0]
    one = _session(one_dir / "decode.onnx")
    for b in range(len(LENS)):
        want = one.run(None, _feeds(ids[b:b + 1], LENS[b:b + 1], [c[b:b + 1] for c in caches]))
        np.testing.assert_array_equal(logits[b], want[0][0], err_msg=f"row {b}: logits")
        for j, (g, w) in enumerate(zip(bound, want[1:])):
            np.testing.assert_array_equal(g[b][:, :LENS[b] + 1], w[0][:, :LENS[b] + 1], err_msg=f"row {b}: cache {j}")
            assert np.isnan(g[b][:, LENS[b] + 1:]).all(), f"row {b}: cache {j} written past the row's position"


def test_per_graph_attention_must_update_the_cache_as_the_model_does(llama, tmp_path):
    from specrt.errors import ExportError
    with pytest.raises(ExportError, match="same cache the same way"):
        onnx_export.export_model(llama[1], SHAPES, tmp_path, attention="rows", batch="dynamic",
                                 tokens={"step": "dynamic", "draft": 1}, graph_attention={"draft": "portable"})
    with pytest.raises(ExportError, match="symbolic length"):
        onnx_export.build_module(llama[1], 1, SHAPES.kv_capacity, attention="standard", batch="dynamic",
                                 grow_cache=True)


def test_dynamic_tokens_needs_the_per_row_contract(llama, tmp_path):
    from specrt.errors import ExportError
    with pytest.raises(ExportError, match="batch="):
        onnx_export.export_model(llama[1], SHAPES, tmp_path, tokens={"step": "dynamic"})


def test_learned_positions_and_layer_norm_rows_are_batch_invariant(tmp_path):
    """GPT-2: positions come from a table per row, LayerNorm with bias, fused q/k/v with bias.
    Row b of a 5-row call is the same graph's one-row result bit for bit. Against today's
    one-row graph it agrees within float rounding only: ONNX Runtime fuses that graph's 2-D
    MatMul + bias into Gemm and its tanh GELU into Gelu, the batched graph's into MatMul + Add
    and FastGelu (measured ~3e-6 on logits; with optimizations off the two are equal)."""
    lm = sources.load_source(make_tiny_model_dir(tmp_path / "model", "gpt2", layers=LAYERS))
    onnx_export.export_model(lm, SHAPES, tmp_path / "one", attention="portable", graphs=("verify",))
    onnx_export.export_model(lm, SHAPES, tmp_path / "batched", attention="portable", batch="dynamic",
                             tokens={"step": "dynamic"})
    batched, one = _session(tmp_path / "batched" / "step.onnx"), _session(tmp_path / "one" / "verify.onnx")
    ids, caches = _random_rows(len(LENS), 4, kv_heads=4)      # GPT-2: plain multi-head attention
    got = batched.run(None, _feeds(ids, LENS, caches))
    for b in range(len(LENS)):
        row = (ids[b:b + 1], LENS[b:b + 1], [c[b:b + 1] for c in caches])
        for g, w in zip(got, batched.run(None, _feeds(*row))):
            np.testing.assert_array_equal(g[b], w[0], err_msg=f"row {b}")
        np.testing.assert_allclose(got[0][b], one.run(None, _feeds(*row))[0][0], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def quantized(exports, tmp_path_factory):
    """The batched gqa graph through both quantizers the builds use."""
    import json

    from specrt.calibration.int8 import SPECS
    from specrt.calibration.quantize import QuantSpec, quantize_graphs
    from specrt.builder.config import PRECISIONS
    tmp = tmp_path_factory.mktemp("batchq")
    out = {}
    for att in ("gqa", "standard"):
        _, batched_dir, part = exports[att]
        part = json.loads(json.dumps(part))
        for name, spec in (("int4", QuantSpec(**PRECISIONS["int4"])), ("int8-dynamic", SPECS["dynamic"]),
                           ("rowwise", QuantSpec("rowwise"))):
            if att == "standard" and name != "rowwise":
                continue
            quantize_graphs(batched_dir, part, tmp / f"{name}-{att}", ("step",), spec)
            out[name if att == "gqa" else f"{name}-{att}"] = tmp / f"{name}-{att}" / "step.onnx"
    return out


@pytest.mark.parametrize("name,op", [pytest.param("int4", "MatMulNBits", marks=AVX2_XFAIL),
                                     ("int8-dynamic", "DynamicQuantizeMatMul"), ("rowwise", "MatMulIntegerToFloat")])
def test_quantizers_keep_the_symbolic_dims(quantized, name, op):
    proto = onnx.load(str(quantized[name]), load_external_data=False)
    ops = {n.op_type for n in proto.graph.node}
    assert op in ops or (op == "DynamicQuantizeMatMul" and "MatMulInteger" in ops), ops
    ins = {t.name: [d.dim_param or d.dim_value for d in t.type.tensor_type.shape.dim] for t in proto.graph.input}
    assert ins["input_ids"] == ["batch", "tokens"] and ins["past_k_0"][0] == "batch"
    sess = _session(quantized[name])
    for B, T, lens in ((3, 1, [4, 0, 20]), (1, 4, [9])):
        ids, caches = _random_rows(B, T)
        assert sess.run(None, _feeds(ids, lens, caches))[0].shape == (B, T, 128)
        if name == "int8-dynamic":      # one activation scale per call: its rows depend on each other anyway
            continue
        # the LM head over the last position only (a prefill chunk): the same row, bit for bit
        last = sess.run(None, {**_feeds(ids, lens, caches), "logit_pos": np.full((B, 1), T - 1, np.int64)})[0]
        np.testing.assert_array_equal(last[:, 0], sess.run(None, _feeds(ids, lens, caches))[0][:, T - 1])


def _rows_alone(sess, ids, lens, caches):
    return [sess.run(None, _feeds(ids[b:b + 1], lens[b:b + 1], [c[b:b + 1] for c in caches])) for b in range(len(lens))]


@pytest.mark.parametrize("name,T", [("rowwise", 1), ("rowwise-standard", 4), pytest.param("int4", 1, marks=AVX2_XFAIL)])
def test_quantized_rows_are_batch_invariant_bit_for_bit(quantized, name, T):
    """Row-wise int8 sums integers exactly; MatMulNBits with int8 compute quantizes each row (in
    blocks) on its own: a row's logits and K/V do not depend on the rows beside it."""
    sess = _session(quantized[name])
    ids, caches = _random_rows(len(LENS), T, seed=3)
    got = sess.run(None, _feeds(ids, LENS, caches))
    for b, want in enumerate(_rows_alone(sess, ids, LENS, caches)):
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g[b], w[0], err_msg=f"{name}: row {b}")


def test_rowwise_int8_is_one_scale_per_row_and_per_channel_weights():
    """One MatMul through calibration/rowwise.py vs the formula in numpy, and every row of an
    M-row call equal to the same row alone (M = 1 included: the exact integer sum)."""
    from onnx import TensorProto, helper, numpy_helper

    from specrt.calibration import rowwise
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((64, 48)) * 0.1).astype(np.float32)
    q, ws = rowwise.quantize_weight(w)
    assert q.dtype == np.int8 and np.abs(q).max() == rowwise.WEIGHT_MAX and ws.shape == (48,)
    assert np.abs(q * ws - w).max() <= ws.max() / 2 + 1e-7
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", 48])],
                          [numpy_helper.from_array(w, "w")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    assert rowwise.quantize_model(model) == 1
    sess = ort.InferenceSession(model.SerializeToString(), session_options(2), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((9, 64)).astype(np.float32) * np.arange(1, 10, dtype=np.float32)[:, None]
    y = sess.run(None, {"x": x})[0]
    s = np.abs(x).max(1, keepdims=True) / 127
    xq = np.round(x / s)
    np.testing.assert_allclose(y, (xq @ q.astype(np.float32)) * s * ws, rtol=1e-5, atol=1e-6)
    for i in range(9):
        np.testing.assert_array_equal(sess.run(None, {"x": x[i:i + 1]})[0][0], y[i])


@pytest.fixture(scope="module", params=["gemma3_text"])
def windowed(request, tmp_path_factory):
    """A tiny model with sliding-window layers (window 6, shorter than most rows' lengths) and
    global ones, each with its own rotary table: attention -> (one-row graphs, batched graph)."""
    tmp = tmp_path_factory.mktemp(f"window-{request.param}")
    lm = sources.load_source(make_tiny_model_dir(tmp / "model", request.param, layers=LAYERS))
    assert any(lm.dims.window(i) for i in range(LAYERS))
    out = {}
    for att, graphs in (("gqa", ("decode",)), ("standard", ("prefill", "decode", "verify"))):
        onnx_export.export_model(lm, SHAPES, tmp / f"one-{att}", attention=att, graphs=graphs)
        onnx_export.export_model(lm, SHAPES, tmp / f"batched-{att}", attention=att, batch="dynamic",
                                 tokens={"step": "dynamic"})
        out[att] = (tmp / f"one-{att}", _session(tmp / f"batched-{att}" / "step.onnx"))
    return lm, out


@pytest.mark.parametrize("T", [1, 4, 16])
def test_sliding_window_rows_are_the_one_row_graph_bit_for_bit(windowed, T):
    _, out = windowed
    one_dir, batched = out["standard"]
    _check_rows_against_one_row_graph(one_dir, batched, LENS, T)
    if T == 1:       # CPU GQA runs several rows of one token (local_window_size, above)
        _check_rows_against_one_row_graph(*out["gqa"], LENS, T)


def test_the_portable_batched_graph_refuses_sliding_windows(windowed, tmp_path):
    from specrt.errors import ExportError
    with pytest.raises(ExportError, match="--attention gqa"):
        onnx_export.export_model(windowed[0], SHAPES, tmp_path, attention="portable", batch="dynamic",
                                 tokens={"step": "dynamic"})


# --- "rows": plain ops over a cache of the L positions bound (a batch verifies windows) ---

@pytest.fixture(scope="module")
def rows_graph(llama):
    tmp, lm = llama
    part = onnx_export.export_model(lm, SHAPES, tmp / "batched-rows", attention="rows", batch="dynamic",
                                    tokens={"step": "dynamic"})
    return _session(tmp / "batched-rows" / "step.onnx"), part


def _rows_feeds(ids, lens, caches, L):
    """The caches' first L positions (what the runtime binds: the positions its rows use)."""
    return _feeds(ids, lens, [np.ascontiguousarray(c[:, :, :L]) for c in caches])


def test_rows_exists_only_in_the_batched_graph(llama, tmp_path):
    from specrt.errors import ExportError
    with pytest.raises(ExportError, match="only in the batched graph"):
        onnx_export.export_model(llama[1], SHAPES, tmp_path, attention="rows")


def test_rows_graph_takes_a_cache_of_any_length_and_attends_to_all_of_it_without_a_copy(rows_graph):
    """The cache's position axis is symbolic (the runtime binds the positions its rows use) and
    no Slice copies a prefix of what TensorScatter wrote: ONNX Runtime has no strided views."""
    sess, part = rows_graph
    ins = {i.name: i.shape for i in sess.sess.get_inputs()}
    assert "kv_pos" not in ins and ins["input_ids"] == ["batch", "tokens"]
    assert ins["past_k_0"][:3] == ["batch", 2, "kv_len"] and ins["past_v_0"][:3] == ["batch", 2, "kv_len"]
    assert part["kv_update"] == "in_place" and part["attention"] == "rows"
    nodes = onnx.load(str(sess.path), load_external_data=False).graph.node
    scattered = {o for n in nodes if n.op_type == "TensorScatter" for o in n.output}
    assert len(scattered) == 2 * LAYERS
    assert not [n.name for n in nodes if n.op_type == "Slice" and n.input[0] in scattered]


@pytest.mark.parametrize("T", [1, 4, 16])
def test_rows_graph_is_the_portable_graph_within_rounding_and_its_rows_are_batch_invariant(exports, rows_graph, T):
    """Row b of a B-row call, bit for bit, is the same row alone (with its own, shorter cache);
    and the arithmetic is the portable graph's (within float rounding: another order of sums)."""
    sess, _ = rows_graph
    ids, caches = _random_rows(len(LENS), T, seed=5)
    L = SHAPES.kv_capacity
    got = sess.run(None, _rows_feeds(ids, LENS, caches, L))
    portable = _session(exports["portable"][1] / "step.onnx").run(None, _feeds(ids, LENS, caches))
    np.testing.assert_allclose(got[0], portable[0], rtol=0, atol=1e-4)
    for b in range(len(LENS)):
        alone = sess.run(None, _rows_feeds(ids[b:b + 1], LENS[b:b + 1], [c[b:b + 1] for c in caches],
                                           LENS[b] + T))
        np.testing.assert_array_equal(got[0][b], alone[0][0], err_msg=f"row {b} (past_len {LENS[b]}, T={T})")
        for g, w in zip(got[1:], alone[1:]):         # the cache it wrote, over the positions the row has
            np.testing.assert_array_equal(g[b][:, :LENS[b] + T], w[0], err_msg=f"row {b} cache")
        # the K/V it wrote: the portable graph's new rows, at the row's own offset
        for i in range(LAYERS):
            s = LENS[b]
            np.testing.assert_allclose(got[1 + 2 * i][b][:, s:s + T], portable[1 + 2 * i][b], rtol=0, atol=1e-5)


def test_rows_graph_does_not_depend_on_how_much_cache_it_reads(rows_graph):
    """The cache may have any length >= the longest row's length + T (the runtime rounds it up
    and the batch's longest row sets it): a row's logits, and the cache it writes, are the same
    bit for bit."""
    sess, _ = rows_graph
    lens, T = [3, 20, 9], 4
    ids, caches = _random_rows(len(lens), T, seed=6)
    outs = [sess.run(None, _rows_feeds(ids, lens, caches, L)) for L in (24, 31, 64, SHAPES.kv_capacity)]
    for other in outs[1:]:
        np.testing.assert_array_equal(other[0], outs[0][0])
        for g, w in zip(other[1:], outs[0][1:]):
            np.testing.assert_array_equal(g[:, :, :24], w)


def test_rows_graph_positions_agree_whatever_window_they_are_computed_in(rows_graph):
    """What lets a batch speculate: a position's logits are the same in a one-token step, a
    two-token step or a 4-token verify window (the gate's window_invariance, on the tiny model)."""
    sess, _ = rows_graph
    lens = [5, 17, 0]
    ids, caches = _random_rows(len(lens), 4, seed=7)
    window = sess.run(None, _rows_feeds(ids, lens, caches, 40))
    steps = [np.ascontiguousarray(c[:, :, :40]) for c in caches]
    for t in range(4):
        out = sess.run(None, _feeds(ids[:, t:t + 1], [x + t for x in lens], steps))
        np.testing.assert_array_equal(out[0][:, 0], window[0][:, t], err_msg=f"position {t}")
        steps = out[1:]


@pytest.mark.parametrize("case", ["gemma3_text", "phi3", "gpt2"])
def test_rows_graph_of_each_family_is_its_reference_graph_and_batch_invariant(case, tmp_path):
    """What each family brings to the rows graph: sliding windows with local and global rotary
    tables (Gemma 3), a partial rotary (Phi-3), learned positions and plain
    multi-head attention (GPT-2: one query head per kv head, whose one-token rows are doubled).
    The rows graph is the standard (windows) or portable batched graph within float rounding,
    and each of its rows is the row alone (with its own, shorter cache), bit for bit."""
    from tiny_models import ARCHITECTURE_CASES
    family, extra = ARCHITECTURE_CASES.get(case, (case, None))
    lm = sources.load_source(make_tiny_model_dir(tmp_path / "model", family, layers=LAYERS, extra=extra))
    windowed = any(lm.dims.window(i) for i in range(LAYERS))
    ref_att = "standard" if windowed else "portable"
    for att in (ref_att, "rows"):
        onnx_export.export_model(lm, SHAPES, tmp_path / att, attention=att, batch="dynamic", tokens={"step": "dynamic"})
    rows, ref = _session(tmp_path / "rows" / "step.onnx"), _session(tmp_path / ref_att / "step.onnx")
    d = lm.dims
    rng = np.random.default_rng(8)
    for T in (1, 4):
        caches = [rng.standard_normal((len(LENS), d.kv_heads, SHAPES.kv_capacity, d.head_dim)).astype(np.float32)
                  for _ in range(2 * LAYERS)]
        ids = rng.integers(5, 128, (len(LENS), T))
        got = rows.run(None, _rows_feeds(ids, LENS, caches, SHAPES.kv_capacity))
        want = ref.run(None, _feeds(ids, LENS, caches))
        np.testing.assert_allclose(got[0], want[0], rtol=0, atol=2e-4, err_msg=f"{case} T={T}")
        for b in range(len(LENS)):
            alone = rows.run(None, _rows_feeds(ids[b:b + 1], LENS[b:b + 1], [c[b:b + 1] for c in caches],
                                               LENS[b] + T))
            np.testing.assert_array_equal(got[0][b], alone[0][0], err_msg=f"{case} row {b} T={T}")
