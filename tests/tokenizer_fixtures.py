"""Tokenizers of other layouts than the tiny models' byte-level one, written with the
`tokenizers` library (no download)."""
from __future__ import annotations

import string
from pathlib import Path


def make_byte_fallback_tokenizer(directory: Path, added: tuple[str, ...] = ()) -> Path:
    """Llama 2 / Mistral / Gemma layout: SentencePiece-style "▁" spaces prepended by the
    normalizer, unknown characters as <0xNN> byte tokens, a decoder that strips the first
    leading space; <unk> <s> </s> and `added` as special tokens. Writes tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for ch in ["▁", *string.ascii_letters, *string.digits, *string.punctuation, "▁t", "he", "▁the"]:
        vocab.setdefault(ch, len(vocab))
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "t"), ("h", "e"), ("▁t", "he")], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>", *added)])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw.save(str(directory / "tokenizer.json"))
    return directory
