"""OpenAI wire format: request bodies (`parse_json`, then pydantic types, strict) and response
bodies (dicts).

Only the fields specrt can honour are typed (OpenAI's, and vLLM's `top_k`, `min_p`,
`stop_token_ids`, `ignore_eos`); a known OpenAI or vLLM field it cannot honour (`echo`,
`logprobs`, `n > 1`, penalties, tools ...) is rejected by validation.py with a 400 naming it;
unknown fields are ignored, as OpenAI-compatible servers do.
Strict mode: `"max_tokens": "5"` or `"stream": "yes"` is a 400, not a coercion.
"""
from __future__ import annotations

import json
import sys
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from specrt.serve.errors import RequestError


def _unicode_text(s: str) -> str:
    """JSON's \\ud800 escapes decode to lone UTF-16 surrogates, which are not Unicode text:
    no tokenizer or UTF-8 encoder takes them (a 400 here, not a 500 later)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone UTF-16 surrogate ({s[e.start]!a} at character {e.start}), which is not "
                         "Unicode text: send a complete surrogate pair or the character itself") from None
    return s


Text = Annotated[str, AfterValidator(_unicode_text)]    # every string a request carries


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: Text | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)   # None -> 1.0, as OpenAI
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)                      # vLLM's: -1 or 0 = all tokens
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)           # vLLM's: 0 = off
    seed: int | None = Field(default=None, ge=0)
    stop_token_ids: list[int] | None = None     # vLLM's: end on emitting one of these (left out of the text)
    ignore_eos: bool | None = False             # vLLM's: generate through EOS up to max_tokens
    stop: Text | list[Text] | None = Field(default=None)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1)


class CompletionRequest(_SamplingFields):
    # a string, or token ids; a list of strings (a batch) is refused in validation.py
    prompt: Text | list[int] | list[Text]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Text      # checked with the Python APIs' check (runtime/prompt.py CHAT_ROLES) in validation.py
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)   # the newer name of max_tokens


# --- request bodies -----------------------------------------------------------------

MAX_JSON_DEPTH = 64     # nesting of arrays and objects; an OpenAI request needs fewer than 10


def parse_json(raw: bytes) -> dict:
    """A request body -> its JSON object; anything else is one RequestError (400, code
    "invalid_json") saying what is wrong: not UTF-8, not JSON, NaN or Infinity (not JSON,
    though Python's parser takes them), an integer past Python's digit limit, nesting past
    MAX_JSON_DEPTH, or a value that is not an object."""
    try:
        text = raw.decode("utf-8-sig")      # RFC 8259: UTF-8; a leading byte order mark may be ignored
    except UnicodeDecodeError as e:
        raise _not_json(f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise _not_json(f"is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise _not_json(f"nests arrays or objects more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as e:                 # _no_constant, or an integer of more digits than Python converts
        raise _not_json(str(e) if isinstance(e, _Constant) else f"has an integer of more than "
                        f"{sys.get_int_max_str_digits()} digits: send it as a string, or a smaller number") from None
    if not isinstance(obj, dict):
        raise _not_json(f"is a JSON {_JSON_KIND.get(type(obj), 'value')}, not an object: send the request's "
                        "fields as one object, e.g. {\"prompt\": \"...\"}")
    if _depth(obj) > MAX_JSON_DEPTH:
        raise _not_json(f"nests arrays or objects more than {MAX_JSON_DEPTH} levels deep")
    return obj


class _Constant(ValueError):
    pass


def _no_constant(name: str):
    raise _Constant(f"has {name}, which is not JSON (RFC 8259 has no NaN or Infinity): send a finite number")


_JSON_KIND = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _not_json(what: str) -> RequestError:
    return RequestError(f"the request body {what}", code="invalid_json")


def _depth(obj) -> int:
    """The deepest nesting of arrays and objects in parsed JSON (iterative: no recursion limit)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:         # deeper is refused anyway: stop walking
                stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


# --- responses ----------------------------------------------------------------------

def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, text: str, finish: str | None,
                    use: dict | None = None, extra: dict | None = None, logprobs: dict | None = None,
                    index: int = 0) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body | ({"specrt": extra} if extra else {})


def chat_body(rid: str, created: int, model: str, text: str, finish: str | None,
              use: dict, extra: dict | None = None, logprobs: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": finish}],
            "usage": use}
    return body | ({"specrt": extra} if extra else {})


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None,
               use: dict | None = None, logprobs: dict | None = None, index: int = 0) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if use is not None:   # the usage-only chunk of stream_options.include_usage has no choices
        body["choices"], body["usage"] = [], use
    return body


class LogprobFormat:
    """Tokens' log-probabilities (runtime/logprobs.py TokenLogprob) in OpenAI's two formats:
    chat's {"content": [{token, logprob, bytes, top_logprobs}]} and the completions endpoint's
    {tokens, token_logprobs, top_logprobs, text_offset}; one per request (text_offset runs on
    across a stream's chunks). A token's text is its own decoding, special tokens included; its
    `bytes` are the bytes it stands for (`token_bytes`), so the pieces of a character split over
    several tokens join into that character."""

    def __init__(self, decode, chat: bool, token_bytes=None):
        self.decode, self.chat, self.offset = decode, chat, 0
        self.token_bytes = token_bytes or (lambda t: self.decode(t).encode("utf-8", "replace"))

    def __call__(self, lps) -> dict:
        if self.chat:
            return {"content": [self._entry(lp.token, lp.logprob) | {
                "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in lps], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            text = self.decode(lp.token)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.decode(t): v for t, v in lp.top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.decode(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}


def sse(obj: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
