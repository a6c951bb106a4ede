"""Static Q/DQ INT8 in TensorRT's form (`specrt qdq`) on the tiny models: the output
passes the rules check, a hand-made asymmetric graph fails it, parity is stated, and
the output folder never swallows a user's files."""
from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from specrt.calibration import qdq, qdq_rules
from specrt.errors import BuildOutputError, ConfigError, SpecrtError

SMALL = qdq.QDQSpec(prompts=3, eval_prompts=2, decode_steps=6)


@pytest.fixture(scope="module")
def qdq_out(tiny_engines, tmp_path_factory):
    out = tmp_path_factory.mktemp("qdq") / "out"
    info = qdq.make_qdq(tiny_engines, out, SMALL, progress=lambda s: None)
    return out, info


def test_output_passes_tensorrt_rules(qdq_out):
    out, info = qdq_out
    assert info["rules"]["passed"] and info["rules"]["problems"] == []
    for g in ("prefill", "decode", "verify"):
        model = onnx.load(str(out / info["graphs"][g]["file"]))
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


def test_parity_is_stated_and_close_on_the_tiny_model(qdq_out):
    out, info = qdq_out
    saved = json.loads((out / "qdq.json").read_text())
    assert saved["format"] == "specrt-qdq" and saved["source"]["manifest_sha256"]
    par = saved["parity"]
    assert set(par["graphs"]) == {"prefill", "decode", "verify"} and par["prompts"] == 2
    for r in par["graphs"].values():
        assert r["positions"] > 0 and all(math.isfinite(v) for v in r.values())
        assert r["top1_agreement"] >= 0.7 and r["mean_kl"] < 0.5
    # one set of activation scales for every graph: verify rows round as decode rows do
    # (up to the float down projection's kernel differences between T=1 and T=k+1)
    assert abs(par["graphs"]["decode"]["top1_agreement"] - par["graphs"]["verify"]["top1_agreement"]) <= 0.1
    assert abs(par["graphs"]["decode"]["mean_kl"] - par["graphs"]["verify"]["mean_kl"]) < 0.02
    assert set(saved["calibration"]["regimes"]) == {"prefill", "decode", "verify"}
    assert all(v > 0 for v in saved["calibration"]["regimes"].values())
    for t in saved["timing"]["graphs"].values():
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
        qdq.make_qdq(tiny_engines, tmp_path / "out", qdq.QDQSpec(graphs=("decode",), prompts=1, eval_prompts=1,
                                                                   decode_steps=2), progress=lambda s: None)
    assert isinstance(qdq.QDQRuleError("x"), SpecrtError)
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_out_folder_refuses_user_files_and_reuses_its_own(qdq_out, tiny_engines, tmp_path):
    out, _ = qdq_out
    qdq.check_out(out)                                   # a previous qdq output: accepted
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep me")
    with pytest.raises(BuildOutputError, match="not a previous `specrt qdq` output"):
        qdq.make_qdq(tiny_engines, user, SMALL, progress=lambda s: None)
    assert (user / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(BuildOutputError):
        qdq.check_out(tmp_path / "file")
    extra = tmp_path / "extra"
    extra.mkdir()
    for f in out.iterdir():
        (extra / f.name).write_bytes(f.read_bytes())
    (extra / "mine.onnx").write_text("user's")
    with pytest.raises(BuildOutputError, match="mine.onnx"):
        qdq.check_out(extra)
    with pytest.raises(ConfigError):
        qdq.QDQSpec(graphs=("draft",))


def test_cli_rewrites_a_previous_output_for_chosen_graphs(tiny_engines, tmp_path, capsys):
    from specrt.cli import main
    out = tmp_path / "q"
    args = ["qdq", str(tiny_engines), "--out", str(out), "--graphs", "decode,verify", "--prompts", "2",
            "--eval-prompts", "1", "--decode-steps", "4", "--keep-float", ".down,lm_head", "--quiet"]
    assert main(args) == 0
    assert main(args) == 0                               # its own previous output is replaced
    text = capsys.readouterr().out
    assert "rules passed" in text and "decode" in text and "prefill " not in text
    info = json.loads((out / "qdq.json").read_text())
    assert sorted(info["graphs"]) == ["decode", "verify"]
    assert info["quantization"]["keep_float"] == [".down", "lm_head"]
    assert sorted(p.name for p in out.iterdir()) == ["decode.onnx", "qdq.json", "verify.onnx", "weights.bin"]
    assert main(["qdq", str(tiny_engines), "--out", str(tmp_path / "r"), "--graphs", "decode,draft"]) == 2


def test_portable_graph_keeps_attention_float(tiny_matrix, tmp_path):
    """The standard-op attention's MatMuls (scores, values against the cache) and the rotary
    permutation MatMul stay float; only the learned weights are quantized."""
    info = qdq.make_qdq(tiny_matrix("none", "portable"), tmp_path / "p",
                        qdq.QDQSpec(graphs=("decode",), prompts=2, eval_prompts=1, decode_steps=4, keep_float=()),
                        progress=lambda s: None)
    model = onnx.load(str(tmp_path / "p" / "decode.onnx"))
    inits = {i.name for i in model.graph.initializer}
    produced_by = {o: n for n in model.graph.node for o in n.output}
    quantized = [n for n in model.graph.node if n.op_type == "MatMul"
                 and produced_by.get(n.input[1]) is not None and produced_by[n.input[1]].op_type == "DequantizeLinear"]
    floats = [n for n in model.graph.node if n.op_type == "MatMul" and n not in quantized]
    assert len(quantized) == 13 and info["rules"]["passed"]    # keep_float=() below: every learned weight
    assert any(n.input[1] == "rot" for n in floats)
    assert any(n.input[1] not in inits for n in floats)   # activation x activation: attention
