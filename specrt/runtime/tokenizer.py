"""Tokenizer for the runtime: the `tokenizers` library on the build's tokenizer.json,
plus the chat template from the manifest rendered with sandboxed jinja2 (as
transformers does). No transformers import."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from specrt.errors import GraphFileError, ManifestError, PromptError, SpecrtError


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
        self._template = self._compile(self.chat_template) if self.chat_template else None

    @staticmethod
    def _compile(source: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):  # templates call this on malformed conversations
            raise PromptError(f"chat template: {msg}")
        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(source)
        except TemplateError as e:
            raise ManifestError(f"the chat template in the manifest is not a valid Jinja template ({e}): the "
                                "manifest is damaged; rebuild the engines") from None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        if self._template is None:
            raise SpecrtError("this model's tokenizer has no chat template: pass a plain prompt (`specrt generate "
                              "--raw`, or chat=False)")
        from jinja2 import TemplateError
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except SpecrtError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise PromptError(f"the chat template could not render these messages ({type(e).__name__}: {e}); "
                              "pass a plain prompt (chat=False / --raw)") from None


class IncrementalDecoder:
    """Streams text for a growing id list; holds back an incomplete UTF-8 sequence.

    Decodes only a window (vLLM's detokenize_incrementally): `ids[prefix:read]` is text
    already released, decoded again only as context so that merges and leading spaces
    come out as in a full decode; each push costs O(window), not O(all ids so far).
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok, self.ids = tokenizer, []
        self.prefix = self.read = 0      # window [prefix, read) = context already released

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""                    # nothing new yet, or half a UTF-8 character
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]
