"""Tiny, deterministic, randomly initialised Hugging Face causal LMs for tests.

Importable both as ``tiny_models`` (with ``tests/`` on ``sys.path``) and as
``tests.tiny_models``. Does not import pytest. ``torch`` and ``transformers``
are imported lazily inside the model builders, so tokenizer-only callers only
need the ``tokenizers`` library.

API
---
``FAMILIES``                       supported model families.
``make_tokenizer_files(dir, V)``   one-token-per-char ``tokenizer.json`` + ``tokenizer_config.json``.
``make_tiny_model_dir(dir, ...)``  ``config.json`` + ``model.safetensors`` + tokenizer files.
``make_pair(root, ...)``           (target_dir, draft_dir) sharing one tokenizer.
``make_truncated_draft(t, dir)``   the target's first layers as a separate draft model dir.
``make_pickled_only_dir(dir)``     ``config.json`` + ``pytorch_model.bin`` (no safetensors).

Token ids (independent of ``vocab_size``): ``<unk>``=0, ``<s>``=1, ``</s>``=2,
``<|im_start|>``=3, ``<|im_end|>``=4, then one token per character in
``CHARS``, then ``<extra_N>`` fillers up to ``vocab_size``.
"""

from __future__ import annotations

import inspect
import json
import string
from pathlib import Path

__all__ = [
    "FAMILIES",
    "ARCHITECTURE_CASES",
    "SPECIAL_TOKENS",
    "CHARS",
    "UNK_ID",
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "IM_START_ID",
    "IM_END_ID",
    "CHAT_TEMPLATE",
    "make_tokenizer_files",
    "make_tiny_model_dir",
    "make_pair",
    "make_truncated_draft",
    "make_pickled_only_dir",
]

FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "smollm3")

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")
UNK_ID, BOS_ID, DOC_EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
EOS_ID = IM_END_ID  # generation stops at <|im_end|> (ChatML, like SmolLM)
PAD_ID = IM_END_ID

# Every printable ASCII character is its own token (letters, digits,
# punctuation, space), plus newline and tab so ChatML prompts encode cleanly.
CHARS = string.ascii_letters + string.digits + string.punctuation + " \n\t"
MIN_VOCAB = 128

MODEL_MAX_LENGTH = 512

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --------------------------------------------------------------------------- tokenizer


def _byte_level_symbol(ch: str) -> str:
    """The GPT-2 byte-level alphabet symbol for a single ASCII character (' ' -> 'Ġ')."""
    from tokenizers import pre_tokenizers

    ((sym, _),) = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(ch)
    return sym


def _vocab(vocab_size: int) -> dict[str, int]:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be an int >= {MIN_VOCAB}, got {vocab_size!r}")
    tokens = list(SPECIAL_TOKENS) + [_byte_level_symbol(c) for c in CHARS]
    assert len(set(tokens)) == len(tokens)
    n = len(tokens)
    tokens += [f"<extra_{i}>" for i in range(vocab_size - n)]
    return {tok: i for i, tok in enumerate(tokens)}


def make_tokenizer_files(directory: Path, vocab_size: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``.

    The tokenizer is a byte-level BPE with *no merges*: every character of
    ``CHARS`` is exactly one token (space is the token ``'Ġ'``, newline ``'Ċ'``,
    tab ``'ĉ'``, as in GPT-2/Qwen2/SmolLM vocabularies) and the ByteLevel
    decoder maps them back, so ``decode(encode(text)) == text`` for ASCII text.
    Byte-level (rather than a plain char-level WordLevel model) is deliberate:
    transformers 5 ignores the pipeline in tokenizer.json for some model types
    (``qwen2`` always loads ``Qwen2Tokenizer``, which rebuilds a byte-level BPE
    from the vocab/merges), and this layout gives the same ids either way.

    The files depend only on ``vocab_size`` (byte-for-byte deterministic).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = _vocab(vocab_size)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    # Pretty, key-stable JSON so draft/target tokenizers are byte-identical.
    data = json.loads(tok.to_str())
    (directory / "tokenizer.json").write_text(
        json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "unk_token": "<unk>",
        "pad_token": "<|im_end|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": MODEL_MAX_LENGTH,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )


# --------------------------------------------------------------------------- models


# What each newer family's tiny config sets beyond the Llama-like fields: small head_dim
# (the classes default to 128-256), and each family's own features made to bite at tiny
# sizes: a query scale that is not 1/sqrt(head_dim), soft-caps small enough for tanh to
# be non-linear, sliding windows shorter than the test contexts, local and global layers
# with different rotary tables, layers without rotary. Override any of them with `extra`.
_FAMILY_EXTRAS = {
    "qwen3": ("Qwen3Config", dict(head_dim=16, attention_bias=False, use_sliding_window=False)),
    "gemma": ("GemmaConfig", dict(head_dim=16, hidden_act="gelu_pytorch_tanh")),
    "gemma2": ("Gemma2Config", dict(head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                                    sliding_window=6, final_logit_softcapping=20.0, attn_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, sliding_window=6,
        sliding_window_pattern=2,      # layers: local, global, local, ...
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})),
    # head_dim 32, half of it rotary (Phi-4-mini rotates 3/4): GroupQueryAttention takes a partial
    # rotary table whose width R/2 is a multiple of 8
    "phi3": ("Phi3Config", dict(num_attention_heads=2, num_key_value_heads=1,
                                original_max_position_embeddings=512, resid_pdrop=0.0, embd_pdrop=0.0,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.5})),
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2)),    # every second layer without rotary
}


# Llama 3.x rope scaling, sized so that all three of its regimes hold some of the 8 frequencies
# of a 16-dim head: kept (wavelength < 16), smoothed (16..64) and divided by `factor` (> 64)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}
# Phi-3's long-context rotary (Phi-3-mini-128k, Phi-3.5, Phi-4-mini): short factors up to
# original_max_position_embeddings, long ones past it; 8 factors for the 16 rotary dims
PHI3_LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                 "original_max_position_embeddings": 64,
                 "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                 "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}

# architecture cases the tests run (docs/architectures.md names them): name -> (family, extra config)
ARCHITECTURE_CASES = {
    "qwen3": ("qwen3", None),
    "gemma": ("gemma", None),
    "gemma2": ("gemma2", None),
    "gemma3_text": ("gemma3_text", None),
    "phi3": ("phi3", None),
    "smollm3": ("smollm3", None),
    "llama3_rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "mistral_window": ("mistral", {"sliding_window": 5}),
    "qwen3_window": ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    # Qwen2 windows the layers from max_window_layers on, only with use_sliding_window (3 layers: full, 6, 6)
    "qwen2_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "phi3_longrope": ("phi3", {"rope_parameters": PHI3_LONGROPE, "max_position_embeddings": 1024,
                               "original_max_position_embeddings": 64}),   # Phi3Config copies it into the rope
}


def _make_config(family: str, *, layers, vocab_size, hidden, heads, kv_heads, intermediate,
                 max_positions, tie_embeddings, extra=None):
    extra = dict(extra or {})
    common_ids = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if family == "gpt2":
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=max_positions,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_inner=intermediate,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            **common_ids,
            **extra,
        )

    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    llama_like = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        attention_dropout=0.0,
        tie_word_embeddings=tie_embeddings,
        **common_ids,
    )
    if family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**{"attention_bias": False, "mlp_bias": False, **llama_like, **extra})
    if family == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**{"sliding_window": None, **llama_like, **extra})
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**{"use_sliding_window": False, "sliding_window": None, **llama_like, **extra})
    if family in _FAMILY_EXTRAS:
        import transformers

        cls, defaults = _FAMILY_EXTRAS[family]
        kw = {**llama_like, **defaults, **extra}
        if "rope_parameters" in kw:     # the family's own rope table replaces the Llama-like theta
            kw.pop("rope_theta")
        if "hidden_activation" in kw:
            kw.pop("hidden_act")
        return getattr(transformers, cls)(**kw)
    raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")


# Init scales, tuned so that greedy continuations of a prompt are varied (not one
# repeated token) and the top-1/top-2 logit gaps are far above fp32/ONNX noise,
# with a max softmax probability around 0.5 (usable for sampling tests too).
WEIGHT_STD = 0.3      # Linear / Conv1D weights (and GPT-2 position embeddings)
EMBED_STD = 0.5       # token embeddings (tied LM head) and untied lm_head
BIAS_STD = 0.3        # q/k/v (qwen2), GPT-2 attention/MLP/LayerNorm biases
NORM_NOISE = 0.1      # RMSNorm / LayerNorm scales are 1 + N(0, NORM_NOISE)


# Gemma's RMSNorms scale by (1 + w): their weights are drawn around 0, not 1
_NORM_OFFSET_FAMILIES = ("gemma", "gemma2", "gemma3_text")
# Gemma 2/3 normalise each block's output before the residual add; at unit scale the
# (sqrt(hidden)-scaled) embedding dominates the residual and greedy decoding echoes the last
# token, so these norms start large (as trained Gemma checkpoints' are)
_BLOCK_OUTPUT_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")
BLOCK_OUTPUT_NORM_CENTER = 40.0


def _init_weights(model, seed: int) -> None:
    """Large-ish random init so logits are peaked (greedy decoding is not a tie-fest)."""
    import torch

    sandwich = model.config.model_type in ("gemma2", "gemma3_text")
    norm_center = 0.0 if model.config.model_type in _NORM_OFFSET_FAMILIES else 1.0
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied params appear once
            if p.dim() >= 2:
                is_tok_emb = any(k in name for k in ("embed_tokens", "wte", "lm_head"))
                std = EMBED_STD if is_tok_emb else WEIGHT_STD
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
            else:  # norm scale
                center = BLOCK_OUTPUT_NORM_CENTER if sandwich and any(n in name for n in _BLOCK_OUTPUT_NORMS) \
                    else norm_center
                p.copy_(center + torch.randn(p.shape, generator=gen) * NORM_NOISE)


def _build_model(family, *, seed, **cfg_kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    config = _make_config(family, **cfg_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32) \
        if "torch_dtype" in inspect.signature(AutoModelForCausalLM.from_config).parameters \
        else AutoModelForCausalLM.from_config(config)
    model = model.float()
    _init_weights(model, seed)
    model.eval()
    return model


def make_tiny_model_dir(directory: Path, family: str = "llama", *, layers: int = 2,
                        vocab_size: int = 128, hidden: int = 64, heads: int = 4,
                        kv_heads: int = 2, intermediate: int = 128, max_positions: int = 512,
                        seed: int = 0, tie_embeddings: bool = True, extra: dict | None = None) -> Path:
    """Create an HF model dir (config.json, model.safetensors, tokenizer files).

    extra: config fields set on top of the family's tiny defaults (`_FAMILY_EXTRAS`),
    e.g. {"sliding_window": 8} or a rope_parameters dict."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    _vocab(vocab_size)  # validate before doing any work
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = _build_model(
        family, seed=seed, layers=layers, vocab_size=vocab_size, hidden=hidden, heads=heads,
        kv_heads=kv_heads, intermediate=intermediate, max_positions=max_positions,
        tie_embeddings=tie_embeddings, extra=extra,
    )
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers < 5; v5 always writes safetensors
    model.save_pretrained(directory, **kwargs)
    make_tokenizer_files(directory, vocab_size)
    return directory


def make_pair(root: Path, *, target_layers: int = 3, draft_layers: int = 1,
              vocab_size: int = 128, family: str = "llama", extra: dict | None = None) -> tuple[Path, Path]:
    """A (target_dir, draft_dir) pair: different depth and seed, identical tokenizer."""
    root = Path(root)
    target = make_tiny_model_dir(root / "target", family, layers=target_layers,
                                 vocab_size=vocab_size, seed=0, extra=extra)
    draft = make_tiny_model_dir(root / "draft", family, layers=draft_layers,
                                vocab_size=vocab_size, seed=1, extra=extra)
    return target, draft


def make_truncated_draft(target: Path, directory: Path, layers: int = 1) -> Path:
    """A separate draft model: the first `layers` blocks of `target` (same embeddings, final
    norm and tokenizer) saved as its own Hugging Face directory. Related to the target, so
    greedy drafts are both accepted and rejected (a draft from another seed almost never
    agrees with a random target). Per-layer config lists (layer_types, no_rope_layers) are
    cut to match."""
    import shutil

    from transformers import AutoModelForCausalLM

    target, directory = Path(target), Path(directory)
    model = AutoModelForCausalLM.from_pretrained(target).float().eval()
    n = model.config.num_hidden_layers
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    for name in ("layer_types", "no_rope_layers"):
        value = getattr(model.config, name, None)
        if isinstance(value, list) and len(value) == n:
            setattr(model.config, name, value[:layers])
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, directory / name)
    return directory


def make_pickled_only_dir(directory: Path) -> Path:
    """config.json + pickled ``pytorch_model.bin`` (+ tokenizer), no safetensors."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = _build_model(
        "llama", seed=0, layers=1, vocab_size=MIN_VOCAB, hidden=64, heads=4, kv_heads=2,
        intermediate=128, max_positions=512, tie_embeddings=True,
    )
    model.config.save_pretrained(directory)
    torch.save(model.state_dict(), directory / "pytorch_model.bin")
    make_tokenizer_files(directory, MIN_VOCAB)
    for p in directory.glob("*.safetensors*"):
        p.unlink()
    return directory
