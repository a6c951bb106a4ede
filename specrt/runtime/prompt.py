"""Prompts in, checked token ids out: shared by the one-stream generator and the batched one.

    encode_prompt(tokenizer, prompt, chat=..., system=...)   text (chat-templated or raw) or ids -> ids
    check_request(ids, max_new_tokens, max_context, vocab)   typed errors before any work
"""
from __future__ import annotations

from typing import Mapping, Sequence

from specrt.errors import ContextLengthError, PromptError, SamplingParamsError, TokenizerMismatchError


def encode_prompt(tokenizer, prompt: str | Sequence[int] | Sequence[Mapping], *, chat: bool = False,
                  system: str | None = None) -> list[int]:
    """Text (with the model's chat template when `chat`), a list of chat messages
    ({"role", "content"} dicts, multi-turn: always through the chat template), or a sequence of
    token ids -> ids. Control tokens typed in chat text stay text (Tokenizer.encode_chat)."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, Mapping) for m in prompt):
        if system is not None and not isinstance(system, str):
            raise PromptError(f"system must be a string, got {type(system).__name__}")
        return tokenizer.encode_chat(([{"role": "system", "content": system}] if system else []) + list(prompt))
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise PromptError("the prompt is bytes: decode it to str first (e.g. prompt.decode('utf-8')), or "
                          "pass a list of token ids")
    if not isinstance(prompt, str):
        return token_ids(prompt)
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"the prompt is not valid UTF-8 text (undecodable byte at position {e.start}, "
                          "e.g. from a terminal in another encoding): pass UTF-8 text") from None
    if system is not None and not isinstance(system, str):
        raise PromptError(f"system must be a string, got {type(system).__name__}")
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return tokenizer.encode_chat(messages)   # control tokens typed in the text stay text
    return tokenizer.encode(prompt)


def token_ids(prompt) -> list[int]:
    """A sequence of token ids as plain ints; anything else is a PromptError."""
    if isinstance(prompt, (str, bytes, bytearray, memoryview)):
        raise PromptError(f"expected a sequence of token ids, got {type(prompt).__name__}")
    try:
        ids = list(prompt)
    except TypeError:
        raise PromptError(f"the prompt must be text or a sequence of token ids, got {type(prompt).__name__}") from None
    out = []
    for t in ids:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise PromptError(f"token ids must be integers, got {t!r} ({type(t).__name__}): pass text, or "
                              "gen.tokenizer.encode(text)")
        out.append(int(t))
    return out


def check_request(prompt_ids, max_new_tokens, max_context: int, vocab: int) -> list[int]:
    """The ids as plain ints, or a typed error saying what to change."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise SamplingParamsError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    ids = token_ids(prompt_ids)
    P, C = len(ids), max_context
    if P == 0:
        raise ContextLengthError("the prompt is empty: give at least one token")
    if P >= C:
        raise ContextLengthError(
            f"the prompt has {P} tokens; the engines were built with max_context={C}, leaving no room to "
            f"generate: shorten the prompt or rebuild with --max-context {P + max_new_tokens}")
    if max(ids) >= vocab or min(ids) < 0:
        raise TokenizerMismatchError(f"prompt token ids must lie in [0, {vocab}): encode the prompt with "
                                     "this build's tokenizer (pass text, or gen.tokenizer.encode(text))")
    return ids
