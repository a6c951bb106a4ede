"""Prompts in, checked token ids out: the one validation of the one-stream generator, the
batched one and the server (serve/validation.py maps each typed error to a 400 naming the field).

    encode_prompt(tokenizer, prompt, chat=..., system=...)   text (chat-templated or raw) or ids -> ids
    chat_messages(messages)                                  the roles a conversation may use
    check_token_ids(ids, vocab)                              prompt ids inside the vocabulary
    check_stop_token_ids(ids, vocab)                         stop ids inside the vocabulary
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
        return tokenizer.encode_chat(([{"role": "system", "content": system}] if system else [])
                                     + chat_messages(prompt))
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


# OpenAI's chat roles that specrt serves ("tool" needs tool calls, which it does not parse yet)
CHAT_ROLES = ("system", "developer", "user", "assistant")


def chat_messages(messages: Sequence[Mapping]) -> list[dict]:
    """The messages with each role checked against CHAT_ROLES; "developer" (OpenAI's newer
    name for "system") becomes "system", the role chat templates know. The rest of each
    message is checked where the template reads it (chat_template.normalize_messages)."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, Mapping) else None
        if role not in CHAT_ROLES:
            raise PromptError(f"messages[{i}] has role {_short(role)}: give one of {', '.join(CHAT_ROLES)}")
        out.append({**m, "role": "system" if role == "developer" else role})
    return out


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
    return check_token_ids(ids, vocab)


def check_token_ids(ids: list[int], vocab: int) -> list[int]:
    """Prompt ids (plain ints) inside [0, vocab), or a TokenizerMismatchError."""
    if bad := [t for t in ids if not 0 <= t < vocab]:
        raise TokenizerMismatchError(f"prompt token ids must lie in [0, {vocab}), this model's vocabulary (got "
                                     f"{_short(bad)}): encode the prompt with this model's tokenizer, or send text")
    return ids


def check_stop_token_ids(ids, vocab: int) -> frozenset[int]:
    """`stop_token_ids` (a sequence of ints inside [0, vocab)) as a set, or a SamplingParamsError."""
    if isinstance(ids, (str, bytes, Mapping)) or not hasattr(ids, "__iter__"):
        raise SamplingParamsError(f"stop_token_ids={_short(ids)} must be a list of token ids")
    ids = list(ids)
    if any(isinstance(t, bool) or not hasattr(t, "__index__") for t in ids):
        raise SamplingParamsError(f"stop_token_ids={_short(ids)} must be a list of token ids (integers)")
    if bad := [int(t) for t in ids if not 0 <= int(t) < vocab]:
        raise SamplingParamsError(f"stop_token_ids must lie in [0, {vocab}), this model's vocabulary (got "
                                  f"{_short(bad)})")
    return frozenset(int(t) for t in ids)


def _short(value) -> str:
    """A refused value as a message shows it: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
