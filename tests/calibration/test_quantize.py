"""Weight-only quantization (calibration/quantize.py) leaves the rotary rotate-half MatMul in
fp32 whatever the method: it is a signed permutation, not a learned weight, and the int8-activation
kernels would round q and k before the rotation."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specrt.calibration import quantize

D = 64


def _rotate_half(d: int) -> np.ndarray:
    """x @ R = concat(-x[d/2:], x[:d/2]), as the portable/standard graphs build it."""
    r = np.zeros((d, d), np.float32)
    h = d // 2
    r[h:, :h] = -np.eye(h, dtype=np.float32)
    r[:h, h:] = np.eye(h, dtype=np.float32)
    return r


def _graph(path):
    """x -> MatMul(w, learned) -> MatMul(rotate-half) -> y."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), "w_learned")
    r = numpy_helper.from_array(_rotate_half(D), "w_rot")
    nodes = [helper.make_node("MatMul", ["x", "w_learned"], ["h"], name="proj"),
             helper.make_node("MatMul", ["h", "w_rot"], ["y"], name="rope_rotate")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, D])], [w, r])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_only_an_exact_signed_permutation_counts_as_the_rotation():
    assert quantize.is_signed_permutation(numpy_helper.from_array(_rotate_half(8)))
    assert not quantize.is_signed_permutation(numpy_helper.from_array(np.eye(8, dtype=np.float32) * 2))
    assert not quantize.is_signed_permutation(numpy_helper.from_array(np.ones((8, 8), np.float32)))
    assert not quantize.is_signed_permutation(numpy_helper.from_array(np.eye(8, 4, dtype=np.float32)))


@pytest.mark.parametrize("spec", [quantize.QuantSpec(bits=4), quantize.QuantSpec(bits=8),
                                  quantize.QuantSpec(method="dynamic"), quantize.QuantSpec(method="rowwise")],
                         ids=["int4", "int8-nbits", "dynamic", "rowwise"])
def test_every_method_quantizes_the_learned_weight_and_keeps_the_rotation_fp32(tmp_path, spec):
    _graph(tmp_path / "src.onnx")
    quantize.quantize_graph(tmp_path / "src.onnx", tmp_path / "q.onnx", spec, vocab=1000)
    m = onnx.load(str(tmp_path / "q.onnx"))
    by_name = {n.name: n for n in m.graph.node}
    rot = by_name.get("rope_rotate")
    assert rot is not None and rot.op_type == "MatMul", [(n.name, n.op_type) for n in m.graph.node]
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    np.testing.assert_array_equal(inits[rot.input[1]], _rotate_half(D))
    assert "proj" not in by_name or by_name["proj"].op_type != "MatMul"      # the learned one is quantized
    assert any(n.op_type != "MatMul" for n in m.graph.node)


def test_the_exported_portable_graph_keeps_one_fp32_rotation_per_layer_in_int4(tiny_matrix, tmp_path):
    """The real exporter's rotate-half (the tiny target, `--attention portable`), quantized to
    int4: every layer keeps its rotation as an fp32 MatMul; the learned weights are MatMulNBits."""
    import json
    eng = tiny_matrix("none", "portable")
    man = json.loads((eng / "manifest.json").read_text())
    src = eng / man["models"]["target"]["graphs"]["decode"]["file"]
    before = quantize.rotary_nodes(onnx.load(str(src)))
    assert len(before) == man["models"]["target"]["dims"]["layers"]
    quantize.quantize_graph(src, tmp_path / "q.onnx", quantize.QuantSpec(bits=4, block_size=16),
                            vocab=man["models"]["target"]["dims"]["vocab"])
    m = onnx.load(str(tmp_path / "q.onnx"))
    assert quantize.rotary_nodes(m) == before
    assert sum(n.op_type == "MatMulNBits" for n in m.graph.node) > 0


def test_the_lm_head_can_keep_its_own_block(tmp_path):
    """QuantSpec.lm_head_block_size (the batched graph of --batch-block-size keeps the target's
    block for the LM head): the body MatMul in one block size, the [hidden, vocab] head in the
    other, the rotation untouched."""
    rng = np.random.default_rng(0)
    vocab = 96
    inits = [numpy_helper.from_array(rng.standard_normal((D, D)).astype(np.float32), "w_body"),
             numpy_helper.from_array(_rotate_half(D), "w_rot"),
             numpy_helper.from_array(rng.standard_normal((D, vocab)).astype(np.float32), "w_head")]
    nodes = [helper.make_node("MatMul", ["x", "w_body"], ["h"], name="body"),
             helper.make_node("MatMul", ["h", "w_rot"], ["r"], name="rope_rotate"),
             helper.make_node("MatMul", ["r", "w_head"], ["y"], name="head")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, D])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, vocab])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "src.onnx"))
    spec = quantize.QuantSpec(bits=4, block_size=64, lm_head_block_size=32)
    quantize.quantize_graph(tmp_path / "src.onnx", tmp_path / "q.onnx", spec, vocab=vocab)
    m = onnx.load(str(tmp_path / "q.onnx"))
    blocks = {n.name.split("_Q4")[0]: {a.name: a.i for a in n.attribute}.get("block_size")
              for n in m.graph.node if n.op_type == "MatMulNBits"}
    assert sorted(blocks.values()) == [32, 64], blocks
    assert {a.name: a.i for n in m.graph.node if n.op_type == "MatMulNBits" and
            {a.name: a.i for a in n.attribute}.get("N") == vocab for a in n.attribute}["block_size"] == 32
    assert [n.op_type for n in m.graph.node if n.name == "rope_rotate"] == ["MatMul"]
    assert spec.describe()["lm_head_block_size"] == 32
    assert "lm_head_block_size" not in quantize.QuantSpec(bits=4).describe()


def _lookup_graph(table: np.ndarray, head_reads_table: bool) -> onnx.ModelProto:
    """ids [N] -> Gather(table [C, V], axis 1) -> Transpose -> [N, C] (the tied embedding
    lookup as exported), and optionally an fp32 LM head MatMul reading the same table."""
    C, V = table.shape
    nodes = [helper.make_node("Gather", ["table", "ids"], ["cols"], axis=1),
             helper.make_node("Transpose", ["cols"], ["x"], perm=[1, 0])]
    outs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C])]
    if head_reads_table:
        nodes.append(helper.make_node("MatMul", ["x", "table"], ["logits"]))
        outs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", V]))
    graph = helper.make_graph(nodes, "lookup", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
                              outs, [numpy_helper.from_array(table, "table")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_gather_rows_stores_a_lookup_only_table_by_rows_with_the_same_values():
    import onnxruntime as ort

    from specrt.runtime.backends.ort_cpu import session_options
    table = np.random.default_rng(0).standard_normal((8, 50)).astype(np.float32)     # [C, V]
    ids = np.array([3, 0, 49, 3, 17], np.int64)
    model = _lookup_graph(table, head_reads_table=False)

    def run(m):
        return ort.InferenceSession(m.SerializeToString(), session_options(2), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})

    before = run(model)
    assert quantize.gather_rows(model) == ["table"]
    inits = {i.name: i for i in model.graph.initializer}
    assert list(inits) == ["table.rows"] and list(inits["table.rows"].dims) == [50, 8]
    assert [(n.op_type, [a.i for a in n.attribute]) for n in model.graph.node] == [("Gather", [0]), ("Identity", [])]
    onnx.checker.check_model(model)
    after = run(model)
    assert after[0].tobytes() == before[0].tobytes() == table[:, ids].T.tobytes()


def test_gather_rows_leaves_a_table_the_lm_head_also_reads():
    model = _lookup_graph(np.ones((8, 50), np.float32), head_reads_table=True)
    assert quantize.gather_rows(model) == []
    assert [i.name for i in model.graph.initializer] == ["table"]
    assert [n.op_type for n in model.graph.node] == ["Gather", "Transpose", "MatMul"]
