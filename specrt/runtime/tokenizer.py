"""Tokenizer for the runtime: the `tokenizers` library on the build's tokenizer.json,
plus the chat template from the manifest rendered with sandboxed jinja2 (as
transformers does). No transformers import."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from specrt.errors import GraphFileError, SpecrtError


class Tokenizer:
    def __init__(self, root: Path, info: dict):
        path = Path(root) / info["file"]
        if not path.is_file():
            raise GraphFileError(f"tokenizer file {path} is missing: rebuild the engines")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise GraphFileError(f"tokenizer file {path} is corrupt ({e}): rebuild the engines") from None
        self.info = info
        self.eos_token_ids = frozenset(int(i) for i in info.get("eos_token_ids", []))
        self.bos_token = info.get("bos_token")
        self.eos_token = info.get("eos_token")
        self.chat_template = info.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise SpecrtError("this model's tokenizer has no chat template: pass a plain prompt (without --chat)")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        def raise_exception(msg):  # templates call this on malformed conversations
            raise SpecrtError(f"chat template: {msg}")
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


class IncrementalDecoder:
    """Streams text for a growing id list; holds back an incomplete UTF-8 sequence."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok, self.ids, self.text = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta
