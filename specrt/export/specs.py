"""Per-architecture declarations: how a Hugging Face config and state dict map onto
the one decoder that `graph.py` exports.

Differences between families are *declared* here (optimum-style), never branched on
elsewhere: a family is one `ArchSpec` registered under the HF `model_type`s it covers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specrt.errors import ModelSourceError

_REGISTRY: dict[str, "ArchSpec"] = {}


@dataclass(frozen=True)
class ArchSpec:
    family: str
    model_types: tuple[str, ...]
    norm: str                  # "rms" | "layer"
    positions: str             # "rope" | "learned"
    mlp: str                   # "gated_silu" | "gelu_new"
    # HF config attribute names (first one present wins): our name -> candidates
    config_names: dict[str, tuple[str, ...]]
    # state-dict name templates; {i} = layer index
    weights: dict[str, str]
    fused_qkv: bool = False    # GPT-2 c_attn: one [C, 3C] Conv1D
    conv1d: bool = False       # GPT-2 Conv1D stores weights as [in, out]
    qkv_bias: Callable[[object], bool] = lambda cfg: False
    # relative tolerance on logits for torch-vs-ONNX parity (fp32), scaled by max |logit|
    parity_rtol: float = 1e-4
    unsupported: Callable[[object], str | None] = lambda cfg: None

    def read(self, cfg, name: str, default=None):
        for attr in self.config_names.get(name, (name,)):
            val = getattr(cfg, attr, None)
            if val is not None:
                return val
        if default is not None:
            return default
        raise ModelSourceError(f"{self.family}: config has none of {self.config_names.get(name, (name,))}")


def register(spec: ArchSpec) -> ArchSpec:
    for mt in spec.model_types:
        _REGISTRY[mt] = spec
    return spec


def spec_for(model_type: str) -> ArchSpec:
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise ModelSourceError(
            f"architecture {model_type!r} is not supported; supported model_types: "
            f"{', '.join(sorted(_REGISTRY))}") from None


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def _llama_unsupported(cfg) -> str | None:
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.hidden_act!r} (only 'silu' is declared for the Llama family)"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias=True"
    return None


_LLAMA_CONFIG = {
    "hidden": ("hidden_size",),
    "layers": ("num_hidden_layers",),
    "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads", "num_attention_heads"),
    "head_dim": ("head_dim",),
    "vocab": ("vocab_size",),
    "eps": ("rms_norm_eps",),
    "max_positions": ("max_position_embeddings",),
}

_LLAMA_WEIGHTS = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "norm1": "model.layers.{i}.input_layernorm.weight",
    "norm2": "model.layers.{i}.post_attention_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}

LLAMA = register(ArchSpec(
    family="llama", model_types=("llama", "mistral"), norm="rms", positions="rope",
    mlp="gated_silu", config_names=_LLAMA_CONFIG, weights=_LLAMA_WEIGHTS,
    qkv_bias=lambda cfg: bool(getattr(cfg, "attention_bias", False)),
    unsupported=_llama_unsupported,
))

QWEN2 = register(ArchSpec(
    family="qwen2", model_types=("qwen2",), norm="rms", positions="rope",
    mlp="gated_silu", config_names=_LLAMA_CONFIG, weights=_LLAMA_WEIGHTS,
    qkv_bias=lambda cfg: True,  # Qwen2 always has q/k/v bias (and none on o_proj)
    unsupported=_llama_unsupported,
))

GPT2 = register(ArchSpec(
    family="gpt2", model_types=("gpt2",), norm="layer", positions="learned", mlp="gelu_new",
    config_names={
        "hidden": ("n_embd",), "layers": ("n_layer",), "heads": ("n_head",),
        "kv_heads": ("n_head",), "vocab": ("vocab_size",), "eps": ("layer_norm_epsilon",),
        "max_positions": ("n_positions",),
    },
    weights={
        "embed": "transformer.wte.weight",
        "pos_embed": "transformer.wpe.weight",
        "final_norm": "transformer.ln_f.weight",
        "final_norm_bias": "transformer.ln_f.bias",
        "lm_head": "lm_head.weight",
        "norm1": "transformer.h.{i}.ln_1.weight",
        "norm1_bias": "transformer.h.{i}.ln_1.bias",
        "norm2": "transformer.h.{i}.ln_2.weight",
        "norm2_bias": "transformer.h.{i}.ln_2.bias",
        "qkv": "transformer.h.{i}.attn.c_attn.weight",
        "qkv_bias": "transformer.h.{i}.attn.c_attn.bias",
        "o": "transformer.h.{i}.attn.c_proj.weight",
        "o_bias": "transformer.h.{i}.attn.c_proj.bias",
        "fc": "transformer.h.{i}.mlp.c_fc.weight",
        "fc_bias": "transformer.h.{i}.mlp.c_fc.bias",
        "proj": "transformer.h.{i}.mlp.c_proj.weight",
        "proj_bias": "transformer.h.{i}.mlp.c_proj.bias",
    },
    fused_qkv=True, conv1d=True, qkv_bias=lambda cfg: True,
    unsupported=lambda cfg: (f"activation_function={cfg.activation_function!r}"
                             if cfg.activation_function not in ("gelu_new", "gelu_pytorch_tanh") else None),
))


@dataclass(frozen=True)
class Dims:
    """The numbers of one model that the graphs and the KV contract depend on."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    max_positions: int
    qkv_bias: bool
    tied: bool = field(default=False)

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads


def dims_of(spec: ArchSpec, cfg) -> Dims:
    reason = spec.unsupported(cfg)
    if reason:
        raise ModelSourceError(f"{spec.family}: {reason} is not supported by specrt's exporter")
    hidden = int(spec.read(cfg, "hidden"))
    heads = int(spec.read(cfg, "heads"))
    head_dim = getattr(cfg, "head_dim", None) if spec.family != "gpt2" else None
    return Dims(
        layers=int(spec.read(cfg, "layers")), hidden=hidden, heads=heads,
        kv_heads=int(spec.read(cfg, "kv_heads")), head_dim=int(head_dim or hidden // heads),
        vocab=int(spec.read(cfg, "vocab")), eps=float(spec.read(cfg, "eps")),
        max_positions=int(spec.read(cfg, "max_positions")), qkv_bias=spec.qkv_bias(cfg),
        tied=bool(getattr(cfg, "tie_word_embeddings", spec.family == "gpt2")),
    )
