"""Tests for the tiny random-weight model fixtures in tests/tiny_models.py."""

from __future__ import annotations

import json

import pytest
import torch  # noqa: E402  (the test extras install it)
from tiny_models import (  # conftest puts tests/ on sys.path
    BOS_ID,
    EOS_ID,
    FAMILIES,
    IM_START_ID,
    make_pair,
    make_pickled_only_dir,
    make_tiny_model_dir,
    make_tokenizer_files,
)
from tokenizers import Tokenizer  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

TEXTS = [
    "Hello, world! 123",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n",
    "All printable: ~!@#$%^&*()_+-=[]{}|;':\",./<>?`\\ 0123456789 abcXYZ",
]


@pytest.fixture(scope="module", autouse=True)
def _few_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {fam: make_tiny_model_dir(root / fam, fam) for fam in FAMILIES}


@pytest.fixture(scope="module")
def loaded(family_dirs):
    cache = {}

    def get(fam):
        if fam not in cache:
            model = AutoModelForCausalLM.from_pretrained(family_dirs[fam])
            model.eval()
            cache[fam] = model
        return cache[fam]

    return get


# ------------------------------------------------------------------ model dirs


@pytest.mark.parametrize("family", FAMILIES)
def test_family_dir_layout_and_config(family_dirs, family):
    d = family_dirs[family]
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not any(n.endswith(".bin") for n in names)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == family
    assert cfg["vocab_size"] == 128
    assert cfg["bos_token_id"] == BOS_ID
    assert cfg["eos_token_id"] == EOS_ID
    assert cfg["pad_token_id"] == EOS_ID
    assert cfg["tie_word_embeddings"] is True
    if family == "gpt2":
        assert (cfg["n_embd"], cfg["n_head"], cfg["n_layer"], cfg["n_positions"]) == (64, 4, 2, 512)
    else:
        assert cfg["num_hidden_layers"] == 2
        heads = (2, 1) if family == "phi3" else (4, 2)      # phi3: head_dim 32 for a partial rotary table
        assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == heads
        assert cfg["rms_norm_eps"] == 1e-5
        rope = cfg.get("rope_parameters") or {}
        rope = rope.get("sliding_attention", rope)             # gemma3_text: one table per layer type
        assert cfg.get("rope_theta", rope.get("rope_theta")) == 10000.0
        if family in ("mistral", "qwen2"):
            assert cfg.get("sliding_window") is None or cfg["sliding_window"] >= 512


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loads_and_forwards(loaded, family):
    model = loaded(family)
    ids = torch.tensor([[BOS_ID, 10, 20, 30, 40, 50, 60]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 128)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    # Peaked enough that greedy is not a near-tie: clear top-1/top-2 gaps.
    top2 = logits[0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).max() > 0.1
    assert logits[0].softmax(-1).max(-1).values.mean() > 0.2


def test_qwen2_has_nonzero_qkv_bias(loaded):
    model = loaded("qwen2")
    attn = model.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None
        assert proj.bias.abs().min() > 0
        assert proj.bias.abs().mean() > 0.05
    # A missing q bias must visibly change the logits.
    ids = torch.tensor([[BOS_ID, 10, 20, 30]])
    with torch.no_grad():
        ref = model(ids).logits
        saved = [layer.self_attn.q_proj.bias.clone() for layer in model.model.layers]
        try:
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.zero_()
            no_bias = model(ids).logits
        finally:
            for layer, b in zip(model.model.layers, saved):
                layer.self_attn.q_proj.bias.copy_(b)
    assert (ref - no_bias).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_continuation_not_degenerate(family_dirs, loaded, family):
    model = loaded(family)
    tok = Tokenizer.from_file(str(family_dirs[family] / "tokenizer.json"))
    ids = torch.tensor([tok.encode("Hello, world!").ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 16
    assert len(set(new)) >= 4, new


def test_same_seed_is_deterministic(tmp_path):
    a = make_tiny_model_dir(tmp_path / "a", "llama", layers=1, seed=3)
    b = make_tiny_model_dir(tmp_path / "b", "llama", layers=1, seed=3)
    c = make_tiny_model_dir(tmp_path / "c", "llama", layers=1, seed=4)
    from safetensors.torch import load_file

    sa, sb, sc = (load_file(str(d / "model.safetensors")) for d in (a, b, c))
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_untied_embeddings_and_bigger_vocab(tmp_path):
    d = make_tiny_model_dir(tmp_path / "u", "llama", layers=1, vocab_size=160, tie_embeddings=False)
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(d)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 160)
    assert Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size() == 160


def test_unknown_family_rejected(tmp_path):
    with pytest.raises(ValueError):
        make_tiny_model_dir(tmp_path / "x", "bloom")


# ------------------------------------------------------------------ tokenizer


def test_vocab_size_too_small_rejected(tmp_path):
    with pytest.raises(ValueError):
        make_tokenizer_files(tmp_path, 127)


@pytest.mark.parametrize("vocab_size", [128, 300])
def test_tokenizer_vocab_and_round_trip(tmp_path, vocab_size):
    make_tokenizer_files(tmp_path, vocab_size)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == vocab_size
    vocab = tok.get_vocab()
    assert sorted(vocab.values()) == list(range(vocab_size))
    for t, i in [("<unk>", 0), ("<s>", BOS_ID), ("</s>", 2), ("<|im_start|>", IM_START_ID),
                 ("<|im_end|>", EOS_ID)]:
        assert vocab[t] == i
    assert f"<extra_{vocab_size - 1 - vocab['<extra_0>']}>" in vocab
    for text in TEXTS:
        enc = tok.encode(text)
        assert len(enc.ids) == len(text)  # one token per character
        assert 0 not in enc.ids  # no <unk>
        assert tok.decode(enc.ids) == text
    space = tok.encode(" ").ids
    assert len(space) == 1 and tok.decode(space) == " "
    assert tok.encode("<|im_start|>hi<|im_end|>").ids[0] == IM_START_ID
    assert tok.encode("<|im_start|>hi<|im_end|>").ids[-1] == EOS_ID


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_tokenizer_matches_tokenizers_library(family_dirs, family):
    d = family_dirs[family]
    auto = AutoTokenizer.from_pretrained(d)
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert auto.eos_token == "<|im_end|>"
    assert auto.eos_token_id == EOS_ID == raw.token_to_id("<|im_end|>")
    assert auto.bos_token_id == BOS_ID
    assert auto.pad_token_id == EOS_ID
    assert len(auto) == 128
    chat = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    for text in TEXTS + [chat]:
        ids = auto(text, add_special_tokens=True)["input_ids"]
        assert ids == raw.encode(text).ids, (family, text)
        assert auto.decode(ids) == raw.decode(ids, skip_special_tokens=False) == text
        assert auto.decode(ids, skip_special_tokens=True) == raw.decode(ids)


def test_chat_template_renders(family_dirs):
    auto = AutoTokenizer.from_pretrained(family_dirs["llama"])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]
    text = auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello, world!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen == text[: -len("<|im_start|>assistant\n")]
    raw = Tokenizer.from_file(str(family_dirs["llama"] / "tokenizer.json"))
    assert raw.decode(raw.encode(text).ids, skip_special_tokens=False) == text


# ------------------------------------------------------------------ pair / pickled


def test_pair_shares_tokenizer(tmp_path):
    target, draft = make_pair(tmp_path, target_layers=2, draft_layers=1)
    assert target != draft and target.parent == draft.parent == tmp_path
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (target / name).read_bytes() == (draft / name).read_bytes()
    ct = json.loads((target / "config.json").read_text())
    cd = json.loads((draft / "config.json").read_text())
    assert (ct["num_hidden_layers"], cd["num_hidden_layers"]) == (2, 1)
    assert ct["vocab_size"] == cd["vocab_size"] == 128
    from safetensors.torch import load_file

    wt = load_file(str(target / "model.safetensors"))
    wd = load_file(str(draft / "model.safetensors"))
    assert not torch.equal(wt["model.embed_tokens.weight"], wd["model.embed_tokens.weight"])
    # Independently made tokenizer files are byte-identical too.
    make_tokenizer_files(tmp_path / "again", 128)
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()


def test_pickled_only_dir(tmp_path):
    d = make_pickled_only_dir(tmp_path / "pkl")
    names = {p.name for p in d.iterdir()}
    assert "config.json" in names and "pytorch_model.bin" in names
    assert not any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names)
    state = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    assert "model.embed_tokens.weight" in state
    assert json.loads((d / "config.json").read_text())["model_type"] == "llama"
