"""Static Q/DQ INT8 in TensorRT's form (`specrt qdq`) on the tiny models: the graphs pass
the rules check, a hand-made asymmetric graph fails it, parity is stated, and the output
is an engine folder (test_qdq_engine.py)."""
from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specrt import manifest as mf
from specrt.builder import qdq_engine
from specrt.calibration import qdq, qdq_rules
from specrt.errors import ConfigError, SpecrtError
from cpu_features import AVX2_ONLY_REASON, INT8_DOT

SMALL = qdq.QDQSpec(prompts=3, eval_prompts=2, decode_steps=6)


@pytest.fixture(scope="module")
def qdq_out(tiny_self_engines, tmp_path_factory):
    """The tiny target with its int8 shared-cache draft, as a Q/DQ engine folder."""
    out = tmp_path_factory.mktemp("qdq") / "out"
    man = qdq_engine.make_qdq(tiny_self_engines, out, SMALL, progress=lambda s: None)
    return out, man


def test_output_passes_tensorrt_rules(qdq_out):
    out, man = qdq_out
    rules = man.target.source["quantization"]["rules"]
    assert rules["passed"] and rules["problems"] == []
    for g in ("prefill", "decode", "verify"):
        model = onnx.load(str(out / man.target.graphs[g].file))
        assert qdq.rule_problems(model) == []
        consts = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
        weights = [n for n in dq if n.input[0] in consts]
        # 3 layers x (qkv, o, gate_up) + the LM head; the down projections stay float (QDQSpec.keep_float)
        assert len(weights) == 10 and not any(".down" in n.input[0] for n in weights)
        for n in dq:
            assert not consts[n.input[2]].any() and consts[n.input[2]].dtype == np.int8
        for n in weights:
            assert consts[n.input[1]].ndim == 1 and {a.name: a.i for a in n.attribute}.get("axis", 1) == 1
        for n in model.graph.node:
            if n.op_type == "QuantizeLinear":
                assert consts[n.input[1]].size == 1          # activations per tensor


@pytest.mark.xfail(not INT8_DOT, reason="static Q/DQ int8 on ONNX Runtime's CPU: " + AVX2_ONLY_REASON, strict=True)
def test_parity_is_stated_and_close_on_the_tiny_model(qdq_out):
    out, man = qdq_out
    saved = mf.load(out).target
    assert saved.source["manifest_sha256"] and saved.source["quantization"]["calibration"]["prompts"] == 3
    par = saved.parity["agreement_with_fp32"]
    assert set(par["graphs"]) == {"prefill", "decode", "verify"} and par["prompts"] == 2
    assert par["positions"] > 0 and 0.7 <= par["top1_agreement"] <= 1
    for r in par["graphs"].values():
        assert r["positions"] > 0 and all(math.isfinite(v) for v in r.values())
        assert r["top1_agreement"] >= 0.7 and r["mean_kl"] < 0.5
    # one set of activation scales for every graph: verify rows round as decode rows do
    # (up to the float down projection's kernel differences between T=1 and T=k+1)
    assert abs(par["graphs"]["decode"]["top1_agreement"] - par["graphs"]["verify"]["top1_agreement"]) <= 0.1
    assert abs(par["graphs"]["decode"]["mean_kl"] - par["graphs"]["verify"]["mean_kl"]) < 0.02
    cal = saved.source["quantization"]["calibration"]
    assert set(cal["regimes"]) == {"prefill", "decode", "verify"} and all(v > 0 for v in cal["regimes"].values())
    for t in mf.load(out).build["timing"]["graphs"].values():
        assert t["fp32_ms"] > 0 and t["qdq_ms"] > 0


def _matmul_graph(zero_point: int = 0, zp_type=TensorProto.INT8, weight_axis: int = 1, act_channels: int = 1):
    """x [2, 4] -> Q/DQ -> MatMul(DQ(w_int8 [4, 3]))."""
    w = numpy_helper.from_array(np.ones((4, 3), np.int8), "w_q")
    n_w = 3 if weight_axis == 1 else 4
    inits = [w, numpy_helper.from_array(np.full(n_w, 0.1, np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(n_w, np.int8), "w_zp"),
             numpy_helper.from_array(np.full(act_channels, 0.05, np.float32).reshape(() if act_channels == 1 else -1),
                                     "x_s"),
             helper.make_tensor("x_zp", zp_type, [] if act_channels == 1 else [act_channels],
                                [zero_point] * act_channels)]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_zp"], ["xq"], name="qx"),
             helper.make_node("DequantizeLinear", ["xq", "x_s", "x_zp"], ["xd"], name="dqx"),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["wd"], name="dqw", axis=weight_axis),
             helper.make_node("MatMul", ["xd", "wd"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_rules_check_accepts_a_symmetric_graph_and_rejects_broken_ones():
    assert qdq.rule_problems(_matmul_graph()) == []
    asym = qdq.rule_problems(_matmul_graph(zero_point=3))
    assert asym and any("zero point" in p for p in asym)
    assert any("UINT8" in p for p in qdq.rule_problems(_matmul_graph(zp_type=TensorProto.UINT8)))
    assert any("output channel is axis 1" in p for p in qdq.rule_problems(_matmul_graph(weight_axis=0)))
    assert any("activation" in p for p in qdq.rule_problems(_matmul_graph(act_channels=4)))
    assert not qdq.check_rules({"decode": _matmul_graph(zero_point=3)})["passed"]


def test_a_broken_rule_is_a_typed_error_and_writes_nothing(tiny_engines, tmp_path, monkeypatch):
    monkeypatch.setattr(qdq_rules, "rule_problems", lambda m: ["QuantizeLinear 'x': zero point must be constant 0"])
    with pytest.raises(qdq.QDQRuleError, match="TensorRT's INT8 rules"):
        qdq_engine.make_qdq(tiny_engines, tmp_path / "out", qdq.QDQSpec(prompts=1, eval_prompts=1, decode_steps=2),
                            progress=lambda s: None)
    assert isinstance(qdq.QDQRuleError("x"), SpecrtError)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_spec_refuses_nonsense():
    with pytest.raises(ConfigError):
        qdq.QDQSpec(prompts=0)


def test_portable_graph_keeps_attention_float(tiny_matrix, tmp_path):
    """The standard-op attention's MatMuls (scores, values against the cache) and the rotary
    permutation MatMul stay float; only the learned weights are quantized."""
    man = qdq_engine.make_qdq(tiny_matrix("none", "portable"), tmp_path / "p",
                              qdq.QDQSpec(prompts=2, eval_prompts=1, decode_steps=4, keep_float=()),
                              progress=lambda s: None)
    assert man.draft is None and man.target.kv["update"] == "returned"
    model = onnx.load(str(tmp_path / "p" / man.target.graphs["decode"].file))
    inits = {i.name for i in model.graph.initializer}
    produced_by = {o: n for n in model.graph.node for o in n.output}
    quantized = [n for n in model.graph.node if n.op_type == "MatMul"
                 and produced_by.get(n.input[1]) is not None and produced_by[n.input[1]].op_type == "DequantizeLinear"]
    floats = [n for n in model.graph.node if n.op_type == "MatMul" and n not in quantized]
    assert len(quantized) == 13 and man.target.source["quantization"]["rules"]["passed"]   # keep_float=()
    assert any(n.input[1] == "rot" for n in floats)
    assert any(n.input[1] not in inits for n in floats)   # activation x activation: attention
