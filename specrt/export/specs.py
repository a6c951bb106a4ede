"""Per-architecture declarations: how a Hugging Face config and state dict map onto
the one decoder that `graph.py` exports.

Differences between families are *declared* here (optimum-style), never branched on
elsewhere: a family is one `ArchSpec` registered under the HF `model_type`s it covers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Callable

from specrt.errors import ModelSourceError

_REGISTRY: dict[str, "ArchSpec"] = {}


@dataclass(frozen=True)
class ArchSpec:
    family: str
    model_types: tuple[str, ...]
    norm: str                  # "rms" | "layer"
    positions: str             # "rope" | "learned"
    mlp: str                   # "gated": act(gate) * up -> down | "plain": fc -> act -> proj (GPT-2)
    # HF config attribute names (first one present wins): our name -> candidates
    config_names: dict[str, tuple[str, ...]]
    # state-dict name templates; {i} = layer index
    weights: dict[str, str]
    fused_qkv: bool = False    # one q/k/v projection (GPT-2 c_attn, Phi-3 qkv_proj)
    conv1d: bool = False       # GPT-2 Conv1D stores weights as [in, out]
    qkv_bias: Callable[[object], bool] = lambda cfg: False
    # relative tolerance on logits for torch-vs-ONNX parity (fp32), scaled by max |logit|
    parity_rtol: float = 1e-4
    unsupported: Callable[[object], str | None] = lambda cfg: None
    # -- what differs between families, each off by default (FEATURES; docs/architectures.md) --
    fused_gate_up: bool = False        # one gate/up projection, gate first (Phi-3 gate_up_proj)
    qk_norm: bool = False              # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    norm_offset: float = 0.0           # RMSNorms scale by (norm_offset + w): Gemma's (1 + w)
    embed_scale: str = "none"          # "sqrt_hidden": embeddings times sqrt(hidden) (Gemma)
    sandwich_norm: bool = False        # norms on the attention and MLP outputs too (Gemma 2/3)
    softcap: bool = False              # tanh soft-caps: config final_/attn_logit_softcapping (Gemma 2)
    query_pre_attn_scalar: bool = False   # attention scale config.query_pre_attn_scalar ** -0.5
    # which layers attend through a sliding window of config.sliding_window tokens:
    # "none" | "uniform" (every layer, Mistral, Phi-3) | "layer_types" (config.layer_types)
    sliding: str = "none"
    rope_local_base: bool = False      # sliding layers' own rotary table (rope_parameters[layer type]: Gemma 3)
    no_rope_layers: bool = False       # config.no_rope_layers[i] == 0: layer i has no rotary (SmolLM3)

    def read(self, cfg, name: str, default=None):
        for attr in self.config_names.get(name, (name,)):
            val = getattr(cfg, attr, None)
            if val is not None:
                return val
        if default is not None:
            return default
        raise ModelSourceError(f"{self.family}: config has none of {self.config_names.get(name, (name,))}")

    def declared(self) -> tuple[str, ...]:
        """What this family declares, as the support table lists it: the base layout, then
        each FEATURES field that differs from its default (`name` for a flag, `name=value`)."""
        out = [f"norm={self.norm}", f"positions={self.positions}", f"mlp={self.mlp}"]
        out += [name for name in ("fused_qkv", "conv1d") if getattr(self, name)]
        for f in fields(self):
            if f.name in FEATURES and getattr(self, f.name) != f.default:
                v = getattr(self, f.name)
                out.append(f.name if v is True else f"{f.name}={v}")
        return tuple(out)


# the declared differences, in ArchSpec field order
FEATURES = ("fused_gate_up", "qk_norm", "norm_offset", "embed_scale", "sandwich_norm", "softcap",
            "query_pre_attn_scalar", "sliding", "rope_local_base", "no_rope_layers")


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
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias=True"
    return None


def _gemma_unsupported(cfg) -> str | None:
    if getattr(cfg, "use_bidirectional_attention", False):
        return "use_bidirectional_attention=True (an encoder-style mask, not a causal decoder)"
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
    "act": ("hidden_act",),
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
    "o_bias": "model.layers.{i}.self_attn.o_proj.bias",        # attention_bias=True (Llama, Qwen3, Gemma)
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
_QK_NORM_WEIGHTS = {
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",      # [head_dim], shared by all heads
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
}
# Gemma 2/3 name their four norms differently from Llama: post_attention_layernorm is the
# norm of the attention *output*, pre_feedforward_layernorm the MLP's input norm
_SANDWICH_WEIGHTS = {
    **_LLAMA_WEIGHTS,
    "norm2": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "attn_out_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "mlp_out_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
}
_attention_bias = lambda cfg: bool(getattr(cfg, "attention_bias", False))  # noqa: E731

LLAMA = register(ArchSpec(
    family="llama", model_types=("llama", "mistral"), norm="rms", positions="rope",
    mlp="gated", config_names=_LLAMA_CONFIG, weights=_LLAMA_WEIGHTS,
    qkv_bias=_attention_bias, unsupported=_llama_unsupported, sliding="uniform",
))

QWEN2 = register(ArchSpec(
    family="qwen2", model_types=("qwen2",), norm="rms", positions="rope",
    mlp="gated", config_names=_LLAMA_CONFIG, weights=_LLAMA_WEIGHTS,
    qkv_bias=lambda cfg: True,  # Qwen2 always has q/k/v bias (and none on o_proj)
    unsupported=_llama_unsupported, sliding="layer_types",
))

QWEN3 = register(ArchSpec(
    family="qwen3", model_types=("qwen3",), norm="rms", positions="rope",
    mlp="gated", config_names=_LLAMA_CONFIG, weights={**_LLAMA_WEIGHTS, **_QK_NORM_WEIGHTS},
    qkv_bias=_attention_bias, unsupported=_llama_unsupported, qk_norm=True, sliding="layer_types",
))

GEMMA = register(ArchSpec(
    family="gemma", model_types=("gemma",), norm="rms", positions="rope",
    mlp="gated", config_names=_LLAMA_CONFIG, weights=_LLAMA_WEIGHTS,
    qkv_bias=_attention_bias, norm_offset=1.0, embed_scale="sqrt_hidden",
))

_GEMMA2_CONFIG = {**_LLAMA_CONFIG, "act": ("hidden_activation",)}

GEMMA2 = register(ArchSpec(
    family="gemma2", model_types=("gemma2",), norm="rms", positions="rope",
    mlp="gated", config_names=_GEMMA2_CONFIG, weights=_SANDWICH_WEIGHTS,
    qkv_bias=_attention_bias, unsupported=_gemma_unsupported, norm_offset=1.0, embed_scale="sqrt_hidden",
    sandwich_norm=True, softcap=True, query_pre_attn_scalar=True, sliding="layer_types",
))

GEMMA3 = register(ArchSpec(
    family="gemma3", model_types=("gemma3_text",), norm="rms", positions="rope",
    mlp="gated", config_names=_GEMMA2_CONFIG, weights={**_SANDWICH_WEIGHTS, **_QK_NORM_WEIGHTS},
    qkv_bias=_attention_bias, unsupported=_gemma_unsupported, norm_offset=1.0, embed_scale="sqrt_hidden",
    sandwich_norm=True, softcap=True, query_pre_attn_scalar=True, sliding="layer_types", qk_norm=True,
    rope_local_base=True,
))

PHI3 = register(ArchSpec(
    family="phi3", model_types=("phi3",), norm="rms", positions="rope", mlp="gated",
    config_names=_LLAMA_CONFIG,
    weights={**{k: v for k, v in _LLAMA_WEIGHTS.items() if k not in ("q", "k", "v", "gate", "up")},
             "qkv": "model.layers.{i}.self_attn.qkv_proj.weight",        # [(H + 2KVH) * D, C]: q, k, v
             "gate_up": "model.layers.{i}.mlp.gate_up_proj.weight"},     # [2I, C]: gate, then up
    fused_qkv=True, fused_gate_up=True, sliding="uniform",
))

SMOLLM3 = register(ArchSpec(
    family="smollm3", model_types=("smollm3",), norm="rms", positions="rope",
    mlp="gated", config_names=_LLAMA_CONFIG, weights=_LLAMA_WEIGHTS,
    qkv_bias=_attention_bias, unsupported=_llama_unsupported, sliding="layer_types", no_rope_layers=True,
))

GPT2 = register(ArchSpec(
    family="gpt2", model_types=("gpt2",), norm="layer", positions="learned", mlp="plain",
    config_names={
        "hidden": ("n_embd",), "layers": ("n_layer",), "heads": ("n_head",),
        "kv_heads": ("n_head",), "vocab": ("vocab_size",), "eps": ("layer_norm_epsilon",),
        "max_positions": ("n_positions",), "act": ("activation_function",),
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
))

# the activations graph.py implements (Hugging Face ACT2FN names)
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
LAYER_TYPES = ("full_attention", "sliding_attention")


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
    act: str = "silu"
    attn_scale: float | None = None          # None: head_dim ** -0.5
    embed_scale: float = 1.0
    final_softcap: float | None = None       # logits = cap * tanh(logits / cap)
    attn_softcap: float | None = None        # scores = cap * tanh(scores / cap), before the mask
    # per layer: the sliding window (a query sees the last `window` positions, itself included)
    # or None, and the rotary table: "global", "local" (Gemma 3 sliding layers) or "none"
    windows: tuple = ()
    rotary: tuple = ()

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def window(self, i: int) -> int | None:
        return self.windows[i] if self.windows else None

    def rotary_of(self, i: int) -> str:
        return self.rotary[i] if self.rotary else "global"


def dims_of(spec: ArchSpec, cfg) -> Dims:
    reason = spec.unsupported(cfg)
    if reason:
        raise ModelSourceError(f"{spec.family}: {reason} is not supported by specrt's exporter")
    hidden = int(spec.read(cfg, "hidden"))
    heads = int(spec.read(cfg, "heads"))
    head_dim = getattr(cfg, "head_dim", None) if spec.family != "gpt2" else None
    head_dim = int(head_dim or hidden // heads)
    layers = int(spec.read(cfg, "layers"))
    act = spec.read(cfg, "act", "silu")
    if act not in ACTIVATIONS:
        raise ModelSourceError(f"{spec.family}: activation {act!r} is not supported by specrt's exporter "
                               f"(supported: {', '.join(ACTIVATIONS)})")
    cap = (lambda name: getattr(cfg, name, None)) if spec.softcap else (lambda name: None)  # noqa: E731
    return Dims(
        layers=layers, hidden=hidden, heads=heads,
        kv_heads=int(spec.read(cfg, "kv_heads")), head_dim=head_dim,
        vocab=int(spec.read(cfg, "vocab")), eps=float(spec.read(cfg, "eps")),
        max_positions=int(spec.read(cfg, "max_positions")), qkv_bias=spec.qkv_bias(cfg),
        tied=bool(getattr(cfg, "tie_word_embeddings", spec.family == "gpt2")),
        act=act,
        attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5 if spec.query_pre_attn_scalar else None,
        embed_scale=hidden ** 0.5 if spec.embed_scale == "sqrt_hidden" else 1.0,
        final_softcap=cap("final_logit_softcapping"), attn_softcap=cap("attn_logit_softcapping"),
        windows=_windows(spec, cfg, layers), rotary=_rotary(spec, cfg, layers),
    )


def _layer_types(spec: ArchSpec, cfg, layers: int) -> list[str]:
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * layers)
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad or len(types) < layers:
        raise ModelSourceError(f"{spec.family}: config.layer_types {bad or types} is not supported by specrt's "
                               f"exporter (only {', '.join(LAYER_TYPES)}, one per layer)")
    return types[:layers]


def _windows(spec: ArchSpec, cfg, layers: int) -> tuple:
    window = getattr(cfg, "sliding_window", None) if spec.sliding != "none" else None
    if spec.sliding == "layer_types":
        types = _layer_types(spec, cfg, layers)
        if "sliding_attention" in types and not window:
            raise ModelSourceError(f"{spec.family}: config.layer_types has sliding_attention layers but "
                                   "sliding_window is not set")
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return (int(window) if window else None,) * layers


def _rotary(spec: ArchSpec, cfg, layers: int) -> tuple:
    if spec.positions != "rope":
        return ("none",) * layers
    kinds = ["global"] * layers
    if spec.rope_local_base:
        kinds = ["local" if t == "sliding_attention" else "global" for t in _layer_types(spec, cfg, layers)]
    if spec.no_rope_layers:
        flags = list(getattr(cfg, "no_rope_layers", None) or [1] * layers)   # 1: the layer uses rotary
        kinds = [k if flags[i] else "none" for i, k in enumerate(kinds)]
    return tuple(kinds)
