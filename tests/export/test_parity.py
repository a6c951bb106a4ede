"""Export parity: every declared family, exported under the KV contract, matches the
Hugging Face model within its stated tolerance at real cache offsets."""
from __future__ import annotations

import pytest
from tiny_models import make_tiny_model_dir

from specrt.export import onnx_export, parity, sources
from specrt.manifest import Shapes

SHAPES = Shapes(batch=1, max_context=64, prefill_chunk=16, k=3)


@pytest.mark.parametrize("attention", ["gqa", "portable"])
@pytest.mark.parametrize("family,kw", [
    ("llama", {}),
    ("llama", {"tie_embeddings": False}),
    ("llama", {"heads": 4, "kv_heads": 4}),          # plain multi-head attention
    ("mistral", {}),
    ("qwen2", {}),                                    # q/k/v bias
    ("gpt2", {}),                                     # learned positions, fused qkv, LayerNorm
])
def test_each_family_exports_within_tolerance_at_real_cache_offsets(tmp_path, family, kw, attention):
    src = make_tiny_model_dir(tmp_path / "model", family, layers=2, **kw)
    lm = sources.load_source(src)
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", attention=attention)
    report = parity.check_parity(lm.model, tmp_path / "onnx", part, SHAPES, rtol=lm.spec.parity_rtol)
    graphs = report["graphs"]
    assert set(graphs) == {"prefill", "decode", "verify", "decode_vs_verify"}
    for name in ("prefill", "decode", "verify"):
        assert graphs[name]["max_abs_logit_delta"] < report["tolerance"], (name, graphs[name])
        assert graphs[name]["argmax_agreement"] == 1.0, (name, graphs[name])
    assert graphs["decode_vs_verify"]["max_abs_logit_delta"] < 1e-4


def test_graphs_of_one_model_share_one_weights_file(tmp_path):
    src = make_tiny_model_dir(tmp_path / "model", "llama", layers=2)
    lm = sources.load_source(src)
    onnx_export.export_model(lm, SHAPES, tmp_path / "onnx")
    weight_bytes = sum(p.numel() * 4 for p in lm.model.parameters())   # tied: embedding counted once
    size = (tmp_path / "onnx" / "weights.bin").stat().st_size
    # one copy of the parameters (plus page alignment), not one per graph
    assert weight_bytes * 0.95 < size < weight_bytes * 1.5
    import onnx
    from onnx import numpy_helper
    for g in ("prefill", "decode", "verify"):
        proto = onnx.load(str(tmp_path / "onnx" / f"{g}.onnx"), load_external_data=False)
        external = [i for i in proto.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
        inline = sum(numpy_helper.to_array(i).nbytes for i in proto.graph.initializer if i not in external)
        assert len(external) >= 2 * 2 + 1 and inline < size / 10, (g, len(external), inline)


def test_a_broken_export_fails_parity(tmp_path, monkeypatch):
    """The parity check has teeth: perturb one weight of the exported graph's reference."""
    import torch

    src = make_tiny_model_dir(tmp_path / "model", "llama", layers=2)
    lm = sources.load_source(src)
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "onnx")
    with torch.no_grad():
        lm.model.model.layers[0].mlp.down_proj.weight.add_(0.05)
    from specrt.errors import ParityError
    with pytest.raises(ParityError, match="exceeds the tolerance"):
        parity.check_parity(lm.model, tmp_path / "onnx", part, SHAPES, rtol=lm.spec.parity_rtol)
