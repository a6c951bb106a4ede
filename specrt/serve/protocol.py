"""OpenAI wire format: request types (pydantic, strict) and response bodies (dicts).

Only the fields specrt can honour are typed (OpenAI's, and vLLM's `top_k`, `min_p`,
`stop_token_ids`, `ignore_eos`); a known OpenAI or vLLM field it cannot honour (`echo`,
`logprobs`, `n > 1`, penalties, tools ...) is rejected by validation.py with a 400 naming it;
unknown fields are ignored, as OpenAI-compatible servers do.
Strict mode: `"max_tokens": "5"` or `"stream": "yes"` is a 400, not a coercion.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


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
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)   # the newer name of max_tokens


# --- responses ----------------------------------------------------------------------

def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, text: str, finish: str | None,
                    use: dict | None = None, extra: dict | None = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body | ({"specrt": extra} if extra else {})


def chat_body(rid: str, created: int, model: str, text: str, finish: str | None,
              use: dict, extra: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": use}
    return body | ({"specrt": extra} if extra else {})


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None,
               use: dict | None = None) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if use is not None:   # the usage-only chunk of stream_options.include_usage has no choices
        body["choices"], body["usage"] = [], use
    return body


def sse(obj: Any) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
