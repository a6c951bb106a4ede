"""Streaming detokenization: the concatenated deltas equal one full decode, for text that
splits multi-byte characters across tokens, special tokens, and leading spaces."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specrt.runtime.tokenizer import IncrementalDecoder, Tokenizer
from tokenizer_fixtures import make_byte_fallback_tokenizer


@pytest.fixture(scope="module")
def real_tokenizer(real_engines) -> Tokenizer:
    return Tokenizer(real_engines, json.loads((real_engines / "manifest.json").read_text())["tokenizer"])


def _stream(tok: Tokenizer, ids: list[int]) -> str:
    dec = IncrementalDecoder(tok)
    return "".join(dec.push(t) for t in ids)


@pytest.mark.real_model
@pytest.mark.parametrize("text", [
    "Hello, world! Ça coûte 5 € — naïve café, 日本語のテキスト, emoji 🙂🚀 done.",
    "  leading spaces\n\ttabs and\nnewlines  ",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello 👋",
])
def test_streamed_text_equals_a_full_decode(real_tokenizer, text):
    ids = real_tokenizer.encode(text, add_special_tokens=False)
    assert _stream(real_tokenizer, ids) == real_tokenizer.decode(ids)


@pytest.mark.real_model
def test_streamed_random_ids_equal_a_full_decode(real_tokenizer):
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = rng.integers(0, real_tokenizer.vocab_size, 60).tolist()
        full = real_tokenizer.decode(ids)
        streamed = _stream(real_tokenizer, ids)
        # a stream may hold back a trailing incomplete character; everything else matches
        assert full.startswith(streamed) and (streamed == full or full.endswith("\ufffd"))


@pytest.mark.real_model
def test_each_push_decodes_a_bounded_window_not_the_whole_history(real_tokenizer, monkeypatch):
    ids = real_tokenizer.encode("word " * 400, add_special_tokens=False)
    seen = []
    orig = real_tokenizer.decode
    monkeypatch.setattr(real_tokenizer, "decode", lambda x, **k: seen.append(len(list(x))) or orig(x, **k))
    _stream(real_tokenizer, ids)
    assert max(seen) <= 4, max(seen)      # was len(ids) per push: quadratic


# --------------------------------------------------------------------------- a byte-fallback tokenizer

@pytest.fixture(scope="module")
def byte_fallback_tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer(make_byte_fallback_tokenizer(tmp_path_factory.mktemp("bytefallback")), {"file": "tokenizer.json"})


@pytest.mark.parametrize("text", ["the theme then", "  two leading spaces", "Ça coûte 5 € — 日本語 🙂🚀",
                                  "</s>the<s> end"])
def test_byte_fallback_stream_equals_a_full_decode(byte_fallback_tokenizer, text):
    tok = byte_fallback_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok._tok.id_to_token(i).startswith("<0x") for i in ids) or text.isascii()
    assert _stream(tok, ids) == tok.decode(ids)


def test_invalid_utf8_from_byte_tokens_keeps_streaming(byte_fallback_tokenizer):
    # <0xC3><0x97> is "×"; <0xE6> starts a 3-byte character that a letter then breaks. DecodeStream raises
    # "Invalid prefix encountered" here (the full decode turns the whole byte run into U+FFFD afterwards).
    tok = byte_fallback_tokenizer
    ids = [tok._tok.token_to_id(t) for t in ("<0xC3>", "<0x97>", "<0xE6>", "a", "b")]
    dec = IncrementalDecoder(tok)
    assert [dec.push(t) for t in ids] == ["", "×", "", "\ufffd\ufffda", "b"]
