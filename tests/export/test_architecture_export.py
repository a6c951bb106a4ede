"""The declared architectures at the export boundary, on tiny random models made from
transformers configs (tests/tiny_models.py ARCHITECTURE_CASES; no download).

- parity: the exported graphs match transformers within the spec's tolerance at real cache
  offsets, for the variants the runtime tests do not build ("standard", the TensorRT graph)
  and for the cases they do not run (sliding windows on Mistral, Qwen2 and Qwen3, Phi-3 longrope);
- every declared feature is needed: the decoder rebuilt in torch matches transformers, and
  with any one feature switched off it does not (so the tiny models exercise each one);
- what cannot be exported is refused with a typed error that names the fix.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import ARCHITECTURE_CASES, LLAMA3_ROPE, make_tiny_model_dir

from specrt.errors import ExportError, ModelSourceError, SpecrtError
from specrt.export import onnx_export, parity, sources, specs
from specrt.export.graph import StaticDecoder
from specrt.manifest import Shapes

SHAPES = Shapes(batch=1, max_context=64, prefill_chunk=16, k=3)

PARITY = [
    *[(case, "standard") for case in ("qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "smollm3")],
    *[(case, att) for case in ("mistral_window", "qwen2_window", "qwen3_window")
      for att in ("gqa", "portable", "standard")],
    ("phi3_longrope", "gqa"), ("phi3_longrope", "portable"),
]

# what each case's tiny config makes bite: switching the feature off must change the logits
# (gemma3_text's soft-caps are off in its config, as in the released Gemma 3)
BITES = {
    "qwen3": ("qk_norm",),
    "gemma": ("norm_offset", "embed_scale"),
    "gemma2": ("norm_offset", "embed_scale", "sandwich_norm", "softcap", "query_pre_attn_scalar", "sliding"),
    "gemma3_text": ("qk_norm", "norm_offset", "embed_scale", "sandwich_norm", "query_pre_attn_scalar", "sliding",
                    "rope_local_base"),
    "smollm3": ("no_rope_layers",),
    "mistral_window": ("sliding",),
    "qwen2_window": ("sliding",),
    "qwen3_window": ("sliding",),
}
LAYOUTS = ("fused_gate_up",)    # how weights are stored: checked by parity (phi3), not switchable


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    memo = {}

    def get(case: str):
        if case not in memo:
            family, extra = ARCHITECTURE_CASES[case]
            d = make_tiny_model_dir(tmp_path_factory.mktemp(case), family, layers=3, extra=extra)
            memo[case] = sources.load_source(d)
        return memo[case]

    return get


@pytest.mark.parametrize(("case", "attention"), PARITY, ids=[f"{c}-{a}" for c, a in PARITY])
def test_exported_graphs_match_transformers_at_real_cache_offsets(tmp_path, loaded, case, attention):
    lm = loaded(case)
    part = onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", attention=attention)
    report = parity.check_parity(lm.model, tmp_path / "onnx", part, SHAPES, rtol=lm.spec.parity_rtol)
    graphs = report["graphs"]
    for name in ("prefill", "decode", "verify"):
        assert graphs[name]["max_abs_logit_delta"] < report["tolerance"], (name, graphs[name])
        assert graphs[name]["argmax_agreement"] == 1.0, (name, graphs[name])
    assert graphs["decode_vs_verify"]["max_abs_logit_delta"] < 1e-4


def _torch_logits(lm, spec, ids: list[int]) -> torch.Tensor:
    """The portable decoder in torch (no ONNX), built under `spec`: logits [T, V] of a prefill."""
    dims = specs.dims_of(spec, lm.model.config)
    M = len(ids) + 8
    module = StaticDecoder(spec, dims, lm.model.state_dict(), tokens=len(ids), kv_capacity=M,
                           inv_freq=lm.inv_freq, attention_scaling=lm.attention_scaling,
                           local_rope=lm.local_rope).eval()
    past = [torch.zeros(1, dims.kv_heads, M, dims.head_dim) for _ in range(2 * dims.layers)]
    with torch.no_grad():
        return module(torch.tensor([ids]), torch.tensor([0]), *past)[0][0]


@pytest.mark.parametrize("case", list(BITES))
def test_each_declared_feature_is_needed_to_match_transformers(loaded, case):
    lm = loaded(case)
    ids = [(7 * i + 3) % 120 + 5 for i in range(24)]              # longer than every tiny sliding window
    with torch.no_grad():
        want = lm.model(torch.tensor([ids])).logits[0]
    tol = parity.ATOL + lm.spec.parity_rtol * float(want.abs().max())
    assert float((_torch_logits(lm, lm.spec, ids) - want).abs().max()) < tol
    defaults = {f.name: f.default for f in dataclasses.fields(specs.ArchSpec)}
    for feature in BITES[case]:
        assert getattr(lm.spec, feature) != defaults[feature], (case, feature)
        off = dataclasses.replace(lm.spec, **{feature: defaults[feature]})
        delta = float((_torch_logits(lm, off, ids) - want).abs().max())
        assert delta > 10 * tol, f"{case}: switching {feature} off changed the logits by only {delta:.3g}"


def test_every_declared_feature_is_exercised_by_some_case():
    bitten = {f for features in BITES.values() for f in features}
    assert set(specs.FEATURES) == bitten | set(LAYOUTS)
    assert {s.family for s in map(specs.spec_for, specs.supported_model_types()) if s.fused_gate_up} == {"phi3"}


def test_llama3_rope_scaling_is_the_table_transformers_computes(loaded):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    lm = loaded("llama3_rope")
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](lm.model.config, "cpu")
    assert torch.equal(lm.inv_freq, want.float()) and lm.attention_scaling == scale
    d = lm.dims.head_dim
    plain = 1.0 / LLAMA3_ROPE["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    changed = ~torch.isclose(lm.inv_freq, plain)
    assert 0 < int(changed.sum()) < d // 2     # the low frequencies are scaled, the high ones kept
    assert lm.identity["rope"]["global"]["rope_type"] == "llama3"


def test_gemma3_layers_take_their_own_rotary_table_and_window(loaded):
    lm = loaded("gemma3_text")
    assert lm.dims.rotary == ("local", "global", "local")
    assert lm.dims.windows == (6, None, 6)
    assert not torch.allclose(lm.inv_freq, lm.local_rope[0])          # theta 1e6 (x 1/8 linear) vs 1e4


def test_qwen2_windows_exactly_the_layers_transformers_windows(loaded):
    """Qwen2 windows layers max_window_layers.. only when use_sliding_window is true (the
    installed transformers says which, in config.layer_types)."""
    lm = loaded("qwen2_window")
    cfg = lm.model.config
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert lm.dims.windows == (None, 6, 6)
    assert [a.self_attn.sliding_window for a in lm.model.model.layers] == list(lm.dims.windows)


def test_qwen2_with_use_sliding_window_false_has_no_window_whatever_sliding_window_says(tmp_path):
    """Released Qwen2/2.5 configs: use_sliding_window false beside a sliding_window value and
    max_window_layers; transformers attends to the whole context, so must the export."""
    extra = {"use_sliding_window": False, "sliding_window": 6, "max_window_layers": 1}
    lm = sources.load_source(make_tiny_model_dir(tmp_path / "qwen2", "qwen2", layers=3, extra=extra))
    assert lm.dims.windows == (None, None, None)
    ids = [(7 * i + 3) % 120 + 5 for i in range(24)]                # 4x the window it must not apply
    with torch.no_grad():
        want = lm.model(torch.tensor([ids])).logits[0]
    tol = parity.ATOL + lm.spec.parity_rtol * float(want.abs().max())
    assert float((_torch_logits(lm, lm.spec, ids) - want).abs().max()) < tol


def test_partial_rotary_table_ort_cannot_take_is_refused_for_gqa(tmp_path):
    src = make_tiny_model_dir(tmp_path / "phi", "phi3", layers=1, extra={"num_attention_heads": 4,
                                                                          "num_key_value_heads": 2})
    lm = sources.load_source(src)          # head_dim 16, 8 of them rotary: a table 4 wide
    with pytest.raises(ExportError, match="--attention portable"):
        onnx_export.build_module(lm, 1, 32, attention="gqa")
    onnx_export.build_module(lm, 1, 32, attention="portable")       # the portable graph takes it


def test_longrope_past_its_original_length_is_refused_before_any_export(tmp_path, loaded):
    from conftest import build_tiny
    lm = loaded("phi3_longrope")
    assert lm.identity["rope"]["global"]["max_context"] == 64
    # why: past 64 tokens transformers rotates *every* position with the long factors
    ids = torch.tensor([[(5 * i) % 120 + 5 for i in range(80)]])
    with torch.no_grad():
        short, long = lm.model(ids[:, :64]).logits[0, :8], lm.model(ids).logits[0, :8]
    assert float((short - long).abs().max()) > 0.1
    src = lm.identity["source"]
    with pytest.raises(SpecrtError, match="--max-context 64 or less"):
        build_tiny(tmp_path / "out", src, "none", max_context=80)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("case", "change", "words"), [
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("qwen3", {"hidden_act": "gelu_fast"}, "activation 'gelu_fast'"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
    ("gemma2", {"sliding_window": None}, "sliding_window is not set"),
])
def test_config_the_exporter_cannot_follow_is_refused_with_what(loaded, case, change, words):
    import copy
    lm = loaded(case)
    cfg = copy.deepcopy(lm.model.config)
    for k, v in change.items():
        object.__setattr__(cfg, k, v)
    with pytest.raises(ModelSourceError, match=words):
        specs.dims_of(lm.spec, cfg)
