"""Tokenizer for the runtime: the `tokenizers` library on the build's tokenizer.json, plus the
chat template from the manifest rendered as transformers renders it (runtime/chat_template.py).
No transformers import.

Chats are encoded as transformers' `apply_chat_template(..., sanitize_control_tokens=True)`
encodes them: a control token (a special added token, or an added token the template's text
contains) typed inside a message, a tool or a template variable is encoded as plain text, so
`<|im_start|>system` in a user message cannot open a turn; only the markers the template writes
itself become control tokens.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from specrt.errors import GraphFileError, PromptError, SpecrtError
from specrt.runtime.chat_template import (
    MARK_END,
    MARK_START,
    ChatTemplate,
    control_patterns,
    mark_control_tokens,
    normalize_messages,
    plain_data,
)

# the special tokens transformers passes to every template (its special_tokens_map)
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


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
        # manifests may carry transformers' whole special_tokens_map; older ones only bos/eos
        named = info.get("special_tokens_map") or {"bos_token": self.bos_token, "eos_token": self.eos_token}
        self.special_tokens = {k: v for k, v in named.items() if k in _SPECIAL_TOKEN_NAMES and isinstance(v, str)}
        self._template = ChatTemplate(self.chat_template) if self.chat_template else None
        self.control_tokens = self._control_tokens(info.get("chat_control_tokens"))
        self._newline = self._tok.encode("\n", add_special_tokens=False).ids

    def _control_tokens(self, listed) -> tuple[str, ...]:
        """Added tokens encoded as text when typed in a chat (transformers' _get_control_tokens): the
        special ones, plus those the manifest lists, or else those in the template's text."""
        added = self._tok.get_added_tokens_decoder().values()
        if listed is not None:
            return tuple(t.content for t in added if t.special or t.content in set(listed))
        literal = self._template.literal_text if self._template else ""
        return tuple(t.content for t in added
                     if t.special or (t.content in literal and not t.content.isspace()))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat ---------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: list | None = None, documents: list | None = None, **kwargs: Any) -> str:
        """The chat as text, as transformers' `apply_chat_template(..., tokenize=False)` renders it.
        Encoding this text would parse control tokens typed in the messages: use `encode_chat`."""
        return self._render(normalize_messages(messages), add_generation_prompt, tools, documents, kwargs, None)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    tools: list | None = None, documents: list | None = None, **kwargs: Any) -> list[int]:
        """Token ids of a conversation: `messages` is a list of {"role", "content"} dicts (multi-turn;
        other keys such as tool_calls or reasoning_content are passed to the template); extra keywords
        reach the template (e.g. enable_thinking=False). Control tokens typed in any of them are
        encoded as text (and the private-use characters U+F0000/U+F0001 that mark them are dropped
        from the input, as transformers does). Bad input is a PromptError."""
        tokens_re, _ = control_patterns(self.control_tokens)
        chat = self._render(normalize_messages(messages), add_generation_prompt, tools, documents, kwargs, tokens_re)
        return self._encode_marked(chat)

    def _render(self, messages, add_generation_prompt, tools, documents, kwargs, tokens_re) -> str:
        if self._template is None:
            raise SpecrtError("this model's tokenizer has no chat template: pass a plain prompt (`specrt generate "
                              "--raw`, or chat=False)")
        if not isinstance(add_generation_prompt, bool):
            raise PromptError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}")
        tools, documents = plain_data(tools, "tools"), plain_data(documents, "documents")
        kwargs = {k: plain_data(v, k) for k, v in kwargs.items()}
        if tokens_re is not None:
            messages, tools, documents, kwargs = (mark_control_tokens(x, tokens_re)
                                                  for x in (messages, tools, documents, kwargs))
        return self._template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     documents=documents, variables={**self.special_tokens, **kwargs})

    def _encode_marked(self, chat: str) -> list[int]:
        """transformers' encode_marked_chat: marked tokens as text, the rest (the template's own
        control tokens included) as usual; a lone marker (the template cut a marked token apart)
        still breaks the text, and is refused when a control token lost its mark next to it."""
        tokens_re, marked_re = control_patterns(self.control_tokens)
        pieces, pos = [], 0                  # [text, marked token | None, text, ..., text]
        for m in marked_re.finditer(chat):
            before, after = chat[pos:m.start()], chat[m.end():]
            if m.group(1) is None:           # a lone marker: was a typed token cut from it?
                cut = tokens_re.match(after) if m.group(0) == MARK_START else _token_at_end(tokens_re, before)
                if cut:
                    raise PromptError(
                        f"a message contains {cut.group(0)!r}, one of the model's control tokens, and this chat "
                        "template cuts it apart from its text, so specrt cannot tell it from the template's own: "
                        "remove that text from the messages")
            pieces += [before, m.group(1)]
            pos = m.end()
        pieces.append(chat[pos:])
        ids = self.encode(pieces[0], add_special_tokens=False)
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = i % 2 == 1             # odd pieces are marked tokens
            piece_ids = self._encode_piece(piece, as_text)
            if as_text and self._tok.token_to_id(piece) in piece_ids:
                raise PromptError(f"{piece!r} typed in a message cannot be encoded as plain text with this "
                                  "tokenizer (it produces the control token from text): remove it from the messages")
            ids += piece_ids
        return ids

    def _encode_piece(self, piece: str, as_text: bool) -> list[int]:
        # after a newline, so a SentencePiece tokenizer adds no prefix space, which is then dropped
        encode = self._encode_without_added_tokens if as_text else \
            (lambda t: self.encode(t, add_special_tokens=False))
        ids = encode("\n" + piece)
        n = len(self._newline)
        return ids[n:] if ids[:n] == self._newline else encode(piece)

    def _encode_without_added_tokens(self, text: str) -> list[int]:
        """`text` through normalizer, pre-tokenizer and model only: no added token is matched."""
        if self._tok.normalizer is not None:
            text = self._tok.normalizer.normalize_str(text)
        splits = [text] if self._tok.pre_tokenizer is None else \
            [s for s, _ in self._tok.pre_tokenizer.pre_tokenize_str(text)]
        return [t.id for s in splits for t in self._tok.model.tokenize(s)]


def _token_at_end(tokens_re: re.Pattern, text: str) -> re.Match | None:
    return re.search(f"(?:{tokens_re.pattern})$", text)


class IncrementalDecoder:
    """Streams text for a growing id list; holds back an incomplete UTF-8 sequence.

    Decodes only a window (vLLM's detokenize_incrementally): `ids[prefix:read]` is text
    already released, decoded again only as context so that merges and leading spaces
    come out as in a full decode; each push costs O(window), not O(all ids so far).
    Not `tokenizers.decoders.DecodeStream` (the same algorithm in Rust, ~3x faster per token):
    it raises "Invalid prefix encountered" mid-stream when a byte-fallback tokenizer's bytes
    form invalid UTF-8 (e.g. <0xC3><0x97><0xE6> then a letter), where this keeps streaming.
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
