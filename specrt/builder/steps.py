"""The steps the CPU and GPU builds share (builder/cpu.py, builder/gpu.py): refusals before the
long work, the tokenizer and the prompts every gate measures on, the KV record of a model,
the truncated-draft reference.

    check_window(lm, shapes)             max_context + window fits the model's positions
    check_same_tokenizer(target, draft)  a draft model has the target's vocabulary
    save_tokenizer(lm, out) -> dict      tokenizer.json, and the manifest's tokenizer record
    prompt_ids(tokenizer, vocab)         the gates' prompts, encoded as the runtime encodes them
    kv(cfg, shares) -> dict              the manifest's kv record of one model
    truncated_reference(model, layers)   the first `layers` layers (torch), sharing the weights
"""
from __future__ import annotations

import shutil
from pathlib import Path

from specrt import manifest as mf
from specrt.builder.config import BuildConfig
from specrt.driver import encode_prompts
from specrt.errors import SpecrtError, TokenizerMismatchError
from specrt.prompts import PROMPTS

GATE_PROMPTS = 4          # the first specrt.prompts: what the gates measure agreement and identity on


def check_window(lm, shapes) -> None:
    if shapes.kv_capacity > lm.dims.max_positions and lm.spec.positions == "learned":
        raise SpecrtError(f"max_context={shapes.max_context} + window exceeds the model's {lm.dims.max_positions} "
                          "learned positions: lower --max-context")
    if shapes.max_context > lm.dims.max_positions:
        raise SpecrtError(f"max_context={shapes.max_context} exceeds the model's max_position_embeddings="
                          f"{lm.dims.max_positions}: lower --max-context")
    # sliding windows are exported (the attention mask / GroupQueryAttention's local_window_size);
    # a rotary table that transformers swaps for another past some length is not
    for rope in (lm.identity.get("rope") or {}).values():
        limit = rope.get("max_context")
        if limit and shapes.max_context > limit:
            raise SpecrtError(f"the model's {rope['rope_type']} rotary embedding switches to its long-context "
                              f"factors beyond original_max_position_embeddings={limit} tokens, which a static "
                              f"graph cannot follow: use --max-context {limit} or less")


def check_same_tokenizer(a, b) -> None:
    va, vb = a.tokenizer.get_vocab(), b.tokenizer.get_vocab()
    if va != vb:
        only = len(set(va.items()) ^ set(vb.items()))
        raise TokenizerMismatchError(
            f"draft and target tokenizers differ ({len(va)} vs {len(vb)} entries, {only} mismatched): speculative "
            "decoding needs one shared vocabulary; pick a draft from the same model family")
    if a.dims.vocab != b.dims.vocab:
        raise TokenizerMismatchError(f"draft logits have {b.dims.vocab} entries, the target's {a.dims.vocab}: "
                                     "the vocabularies must be the same size")


def save_tokenizer(lm, out: Path) -> dict:
    tok = lm.tokenizer
    tmp = out / "_tokenizer"
    tok.save_pretrained(str(tmp))
    path = out / "tokenizer.json"
    shutil.move(str(tmp / "tokenizer.json"), path)
    shutil.rmtree(tmp)
    eos = set()
    if tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    gen_eos = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        eos.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    return {"file": "tokenizer.json", "sha256": mf.sha256_file(path), "chat_template": tok.chat_template,
            "eos_token_ids": sorted(eos), "eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "bos_token_id": tok.bos_token_id, "vocab_size": len(tok)}


def prompt_ids(tokenizer, vocab: int) -> list[list[int]]:
    """The first specrt.prompts as the runtime encodes them (driver.encode_prompts), checked
    against the model's vocabulary. tokenizer: the runtime's, over the saved tokenizer.json."""
    out = encode_prompts(tokenizer, PROMPTS[:GATE_PROMPTS])
    bad = [i for ids in out for i in ids if not 0 <= i < vocab]
    if bad:
        raise TokenizerMismatchError(f"the tokenizer produced ids {bad[:3]} outside the model's vocabulary "
                                     f"({vocab}): the tokenizer does not belong to this model")
    return out


def kv(cfg: BuildConfig, shares: str | None) -> dict:
    return {"dtype": "float32", "layout": "[batch, kv_heads, kv_capacity, head_dim]",
            "update": "in_place" if cfg.attention in ("gqa", "standard") else "returned", "shares_cache_with": shares}


def truncated_reference(model, layers: int):
    """The first `layers` layers of `model`, sharing its weights; `model` is left whole
    (a shallow copy of a Module shares its submodule dict, so each level gets its own)."""
    import copy
    ref = copy.copy(model)             # shallow: shares weights
    ref._modules = dict(model._modules)
    ref.model = copy.copy(model.model)
    ref.model._modules = dict(model.model._modules)
    ref.model.layers = model.model.layers[:layers]
    ref.model.config = copy.copy(model.model.config)
    ref.model.config.num_hidden_layers = layers
    return ref
