"""The fused "gqa" graphs (export/fuse.py): residual Add + RMSNorm as one
SkipSimplifiedLayerNormalization, GroupQueryAttention fed the packed q/k/v (the batched "rows"
graph: the norms only). They hold the
fused ops and fewer nodes, match transformers within the build's tolerance, survive
int4 quantization, and the parity check catches a fusion that computes the wrong thing.
The standard (TensorRT) and portable variants never go through the pass."""
from __future__ import annotations

from collections import Counter

import onnx
import pytest
from tiny_models import make_tiny_model_dir

from specrt.errors import ParityError
from specrt.export import fuse, onnx_export, parity, sources
from specrt.manifest import Shapes

SHAPES = Shapes(batch=1, max_context=64, prefill_chunk=16, k=3)
LAYERS = 2


def _ops(path):
    proto = onnx.load(str(path), load_external_data=False)
    return proto, Counter(n.op_type for n in proto.graph.node)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuse")
    return tmp, sources.load_source(make_tiny_model_dir(tmp / "model", "llama", layers=LAYERS))


@pytest.fixture(scope="module")
def fused_and_unfused(llama):
    tmp, lm = llama
    fused = onnx_export.export_model(lm, SHAPES, tmp / "fused", attention="gqa")
    mp = pytest.MonkeyPatch()
    mp.setattr(onnx_export, "fuses", lambda module: False)        # the export as it was before the pass
    try:
        plain = onnx_export.export_model(lm, SHAPES, tmp / "plain", attention="gqa")
    finally:
        mp.undo()
    return tmp, lm, fused, plain


def test_fused_graphs_hold_the_fused_ops_and_fewer_nodes(fused_and_unfused):
    tmp, _, part, plain = fused_and_unfused
    for g in ("prefill", "decode", "verify"):
        proto, ops = _ops(tmp / "fused" / f"{g}.onnx")
        _, before = _ops(tmp / "plain" / f"{g}.onnx")
        # per layer: 2 norms after a residual Add (the first layer's input norm has none, the final norm has one)
        assert ops["SkipSimplifiedLayerNormalization"] == 2 * LAYERS and before["SkipSimplifiedLayerNormalization"] == 0
        assert ops["Split"] == before["Split"] - LAYERS                # the q/k/v Split of every layer is gone
        assert ops["Pow"] == 1 and before["Pow"] == 2 * LAYERS + 1     # only the first norm is left for ORT
        assert sum(ops.values()) < sum(before.values()) - 6 * 2 * LAYERS
        for n in proto.graph.node:
            if n.op_type == "GroupQueryAttention":
                assert n.input[1] == "" and n.input[2] == "", "key/value omitted: query is the packed q/k/v"
            if n.op_type == "SkipSimplifiedLayerNormalization":
                assert n.domain == "com.microsoft"
                eps = onnx.helper.get_attribute_value(next(a for a in n.attribute if a.name == "epsilon"))
                assert eps == pytest.approx(1e-5)
        assert part["fusions"][g] == {"nodes": len(proto.graph.node), "skip_simplified_layer_norm": 2 * LAYERS,
                                      "packed_qkv_attention": LAYERS}
        assert "fusions" not in plain


def test_fused_graphs_match_transformers_within_the_build_tolerance(fused_and_unfused):
    tmp, lm, part, _ = fused_and_unfused
    report = parity.check_parity(lm.model, tmp / "fused", part, SHAPES, rtol=lm.spec.parity_rtol)
    graphs = report["graphs"]
    for name in ("prefill", "decode", "verify"):
        assert graphs[name]["max_abs_logit_delta"] < report["tolerance"], (name, graphs[name])
        assert graphs[name]["argmax_agreement"] == 1.0, (name, graphs[name])
    assert graphs["decode_vs_verify"]["max_abs_logit_delta"] < 1e-4


@pytest.mark.parametrize("family,kw", [("qwen2", {}), ("llama", {"heads": 4, "kv_heads": 4})])
def test_other_families_fuse_and_stay_within_tolerance(tmp_path, family, kw):
    """q/k/v bias (the Split reads the bias Add) and plain multi-head attention."""
    lm = sources.load_source(make_tiny_model_dir(tmp_path / "model", family, layers=LAYERS, **kw))
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", attention="gqa")
    assert part["fusions"]["decode"]["packed_qkv_attention"] == LAYERS
    assert part["fusions"]["decode"]["skip_simplified_layer_norm"] == 2 * LAYERS
    report = parity.check_parity(lm.model, tmp_path / "onnx", part, SHAPES, rtol=lm.spec.parity_rtol)
    assert all(report["graphs"][g]["max_abs_logit_delta"] < report["tolerance"] for g in ("prefill", "decode", "verify"))


def test_the_int8_compute_decode_graph_is_fused_like_the_others(llama, tmp_path):
    """The quantized target's decode graph is exported for T=2 by export_graph directly
    (builder/gates/rows.py): it must be fused as the verify graph is, or the two paths round
    differently."""
    _, lm = llama
    found = onnx_export.export_graph(onnx_export.build_module(lm, 2, SHAPES.kv_capacity, attention="gqa"),
                                     tmp_path / "t2.onnx")
    assert found["skip_simplified_layer_norm"] == 2 * LAYERS and found["packed_qkv_attention"] == LAYERS
    _, ops = _ops(tmp_path / "t2.onnx")
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * LAYERS


def test_the_batched_rows_graph_gets_the_fused_norms(llama, tmp_path):
    """The "rows" step graph (a batch's windows; no GroupQueryAttention to feed packed q/k/v)
    takes the norm rewrite alone: one SkipSimplifiedLayerNormalization per residual norm, no Add
    of a residual left before a norm; its batch and window invariance are test_batch.py's."""
    _, lm = llama
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "rows", attention="rows", batch="dynamic",
                                    tokens={"step": "dynamic"})
    assert part["fusions"]["step"] == {"nodes": part["fusions"]["step"]["nodes"],
                                       "skip_simplified_layer_norm": 2 * LAYERS, "packed_qkv_attention": 0}
    _, ops = _ops(tmp_path / "rows" / "step.onnx")
    assert ops["SkipSimplifiedLayerNormalization"] == 2 * LAYERS and ops["Pow"] == 1


@pytest.mark.parametrize("attention", ["standard", "portable"])
def test_standard_and_portable_variants_are_untouched(llama, tmp_path, monkeypatch, attention):
    _, lm = llama

    def never(model, *a, **kw):
        raise AssertionError(f"the {attention} variant must not be fused")

    monkeypatch.setattr(fuse, "fuse_model", never)
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", graphs=("decode",), attention=attention)
    assert "fusions" not in part
    proto, ops = _ops(tmp_path / "onnx" / "decode.onnx")
    assert ops["SkipSimplifiedLayerNormalization"] == 0 and ops["Pow"] == 2 * LAYERS + 1
    if attention == "standard":
        assert {n.domain for n in proto.graph.node} <= {""}, "TensorRT's parser reads standard ops only"


def test_fusions_survive_int4_quantization(fused_and_unfused, tmp_path):
    from specrt.calibration import quantize
    from specrt.builder.config import PRECISIONS
    src, _, part, _ = fused_and_unfused
    q = quantize.quantize_graphs(src / "fused", part, tmp_path / "int4", ("decode", "verify"),
                                 quantize.QuantSpec(**PRECISIONS["int4"]))
    for g in q["graphs"]:
        proto, ops = _ops(tmp_path / "int4" / f"{g}.onnx")
        assert ops["MatMulNBits"] == 4 * LAYERS + 1                  # qkv, o, gate_up, down per layer + LM head
        assert ops["SkipSimplifiedLayerNormalization"] == 2 * LAYERS
        assert fuse.describe(proto)["packed_qkv_attention"] == LAYERS


def _break_first_norm(how):
    """A fuse_model that fuses and then gets one fused norm wrong."""
    real = fuse.fuse_model

    def broken(model, *a, **kw):
        model = real(model, *a, **kw)
        node = next(n for n in model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization")
        if how == "epsilon":             # 1e-5 -> 1e-2: the tiny model's mean(x²) is ~1e-3
            for a in node.attribute:
                if a.name == "epsilon":
                    a.f = 1e-2
        elif how == "residual":          # normalise the sublayer's output alone: the residual is skipped
            node.input[0] = node.input[1]
        elif how == "weight":            # the next norm's gamma
            gammas = [n.input[2] for n in model.graph.node if n.op_type == "SkipSimplifiedLayerNormalization"]
            node.input[2] = gammas[1]
        return model
    return broken


@pytest.mark.parametrize("how", ["epsilon", "residual", "weight"])
def test_a_broken_fusion_fails_the_parity_check(llama, tmp_path, monkeypatch, how):
    _, lm = llama
    monkeypatch.setattr(fuse, "fuse_model", _break_first_norm(how))
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", attention="gqa")
    with pytest.raises(ParityError, match="exceeds the tolerance"):
        parity.check_parity(lm.model, tmp_path / "onnx", part, SHAPES, rtol=lm.spec.parity_rtol)


def test_a_graph_the_patterns_do_not_match_is_left_alone():
    """No residual Add before the norm, or a Split that is not q/k/v: nothing is rewritten."""
    from onnx import TensorProto, helper, numpy_helper
    import numpy as np
    c = lambda name, v: numpy_helper.from_array(np.array(v, np.float32 if isinstance(v, float) else np.int64), name)  # noqa: E731
    nodes = [helper.make_node("Pow", ["x", "two"], ["p"]),
             helper.make_node("ReduceMean", ["p", "axes"], ["m"], keepdims=1),
             helper.make_node("Add", ["m", "eps"], ["me"]),
             helper.make_node("Sqrt", ["me"], ["r"]),
             helper.make_node("Div", ["x", "r"], ["d"]),
             helper.make_node("Mul", ["d", "w"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4])],
                          [c("two", 2.0), c("axes", [-1]), c("eps", 1e-5),
                           numpy_helper.from_array(np.ones(4, np.float32), "w")])
    model = fuse.fuse_model(helper.make_model(g))
    assert [n.op_type for n in model.graph.node] == [n.op_type for n in nodes]
    assert fuse.describe(model)["skip_simplified_layer_norm"] == 0


def test_a_build_records_its_fusions_in_the_manifest(tiny_engines):
    from specrt import manifest as mf
    man = mf.load(tiny_engines)
    fusions = man.target.source["export_fusions"]
    layers = man.target.layers
    assert set(fusions) == {"prefill", "decode", "verify"}
    assert all(f["packed_qkv_attention"] == layers for f in fusions.values()), fusions
