"""fp16 graphs (the GPU precision) against the fp32 graphs, on ONNX Runtime CPU: logit
parity within precision.FP16_ATOL + FP16_RTOL * max|logit| and greedy agreement. On CPU
ORT runs some fp16 ops in fp32 behind casts; GPU kernels have not run these graphs."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from tiny_models import make_tiny_model_dir

from specrt.builder.gates import precision
from specrt.export import onnx_export, sources
from specrt.manifest import Shapes

SHAPES = Shapes(batch=1, max_context=64, prefill_chunk=16, k=3)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp16")
    return {fam: (tmp / fam, sources.load_source(make_tiny_model_dir(tmp / fam / "model", fam, layers=2)))
            for fam in ("llama", "gpt2")}


def _export(tiny, family, attention):
    root, lm = tiny[family]
    return {p: (root / f"{attention}-{p}",
                onnx_export.export_model(lm, SHAPES, root / f"{attention}-{p}", attention=attention, precision=p))
            for p in ("fp32", "fp16")}


@pytest.mark.parametrize("family,attention", [("llama", "standard"), ("llama", "gqa"), ("gpt2", "standard")])
def test_fp16_graphs_match_fp32_within_the_stated_tolerance_and_agree_greedily(tiny, family, attention):
    (d32, p32), (d16, p16) = _export(tiny, family, attention).values()
    report = precision.compare(d32, p32, d16, p16, SHAPES, prompt=PROMPT, new_tokens=32)
    for g, r in report["graphs"].items():
        assert r["max_abs_logit_delta"] < report["tolerance"], (g, r)
        assert r["argmax_agreement"] == 1.0, (g, r)
    assert report["greedy"]["identical_prefix"] == 32, report["greedy"]
    # the fp16 graph's signature: int64 ids, fp16 KV in and out, fp32 logits
    proto = onnx.load(str(d16 / "decode.onnx"), load_external_data=False)
    T = onnx.TensorProto
    types = {v.name: v.type.tensor_type.elem_type for v in [*proto.graph.input, *proto.graph.output]}
    kv_out = "present_k_0" if p16["kv_update"] == "in_place" else "new_k_0"
    assert (types["input_ids"], types["past_len"], types["past_k_0"], types[kv_out], types["logits"]) == \
        (T.INT64, T.INT64, T.FLOAT16, T.FLOAT16, T.FLOAT)
    assert p16["kv_dtype"] == "float16" and p16["precision"] == "fp16"
    # weights stored as fp16: half the bytes
    assert 0.4 < p16["weights"]["bytes"] / p32["weights"]["bytes"] < 0.6


def test_the_fp16_comparison_has_teeth(tiny, tmp_path):
    """An fp16 graph from different weights fails the comparison."""
    from specrt.errors import ParityError

    root, lm = tiny["llama"]
    p32 = onnx_export.export_model(lm, SHAPES, tmp_path / "fp32", graphs=("prefill", "decode"), attention="standard")
    import torch
    with torch.no_grad():
        lm.model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    try:
        p16 = onnx_export.export_model(lm, SHAPES, tmp_path / "fp16", graphs=("prefill", "decode"),
                                       attention="standard", precision="fp16")
    finally:
        with torch.no_grad():
            lm.model.model.layers[0].mlp.down_proj.weight.mul_(-1.0)
    with pytest.raises(ParityError, match="exceeds the tolerance"):
        precision.compare(tmp_path / "fp32", p32, tmp_path / "fp16", p16, SHAPES, prompt=PROMPT)


def test_rotary_angles_stay_fp32_in_the_fp16_graph(tiny):
    """inv_freq * position reaches max_context radians: it must not be rounded to fp16."""
    root, lm = tiny["llama"]
    m = onnx_export.build_module(lm, 1, SHAPES.kv_capacity, attention="standard", precision="fp16")
    assert m.inv_freq.element_size() == 4 and m.lm_head.element_size() == 2 and m.cos_cache.element_size() == 2
    assert np.isfinite(m.cos_cache.float().numpy()).all()


def test_gqa_with_a_constant_total_sequence_length_matches_transformers(tiny, tmp_path):
    """The ORT CUDA form of the gqa graph (total_sequence_length = buffer length, the real
    length only in seqlens_k) gives the same logits on ORT CPU; capture itself is GPU-only."""
    from specrt.export import parity

    root, lm = tiny["llama"]
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", attention="gqa", static_total=True)
    assert part["total_sequence_length"] == "static"
    proto = onnx.load(str(tmp_path / "onnx" / "verify.onnx"), load_external_data=False)
    gqa = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer
              if i.data_location != onnx.TensorProto.EXTERNAL}
    consts.update({n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t) for n in proto.graph.node
                   if n.op_type == "Constant"})
    assert all(int(consts[n.input[6]]) == SHAPES.kv_capacity for n in gqa)   # a constant, not computed
    report = parity.check_parity(lm.model, tmp_path / "onnx", part, SHAPES, rtol=lm.spec.parity_rtol)
    for g in ("prefill", "decode", "verify"):
        assert report["graphs"][g]["max_abs_logit_delta"] < report["tolerance"]
