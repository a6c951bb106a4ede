"""Request validation: a parsed OpenAI request -> a `GenerationRequest` a worker can run.

Everything that can be refused is refused here, before a worker is taken: fields
specrt cannot honour, sampling ranges, the model name, and prompts that do not fit
the engines' static context. The prompt is tokenized here with the validator's own
tokenizer (never a worker's generator), exactly as `SpeculativeGenerator.encode_prompt`
does, so the server and `specrt generate` see the same token ids; what the Python APIs
check too (roles, token ids, stop ids) is checked by the same functions (runtime/prompt.py),
whose typed error becomes a 400 naming the field. A text too long to
fit is refused by its size before it is tokenized (see `max_prompt_bytes`): tokenizing
megabytes only to refuse them would hold a core (and the GIL) for seconds.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from specrt.errors import SamplingParamsError, SpecrtError
from specrt.runtime.grammar import GrammarError, Grammars, Structured
from specrt.runtime.logprobs import MAX_TOP
from specrt.runtime.prompt import chat_messages, check_stop_token_ids, check_token_ids
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import Tokenizer
from specrt.serve.errors import ModelNotFoundError, RequestError
from specrt.serve.protocol import ChatCompletionRequest, CompletionRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions
# A tokenizer's normalizer may shrink text before it is split (NFC composes up to 3
# characters into one); this margin keeps the size bound from refusing a prompt that fits.
NORMALIZER_MARGIN = 4
MAX_STOP_STRINGS = 4                    # OpenAI's limit

# OpenAI (and vLLM) fields specrt cannot honour yet: accepted only at their neutral value,
# anything else is a 400 naming the field (never dropped silently)
_NEUTRAL = {
    "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
    "min_tokens": (None, 0),
    "use_beam_search": (None, False), "include_stop_str_in_output": (None, False), "prompt_logprobs": (None,),
}
# the ways a request asks for structured output (runtime/grammar.py): OpenAI's response_format,
# vLLM's structured_outputs and guided_* fields, llama.cpp's json_schema and grammar; at most one
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "json_schema", "grammar")
# what to do instead, where there is something
_INSTEAD = {
    "best_of": "send several requests and choose among them",
    "tools": "specrt does not parse tool calls yet: describe the tools in the messages",
    "functions": "specrt does not parse function calls yet: describe them in the messages",
}


@dataclass(frozen=True)
class GenerationRequest:
    kind: str                       # "completion" | "chat"
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    structured: Structured | None = None        # the output must match it (checked: its grammar compiles)
    logprobs: int | None = None                 # None: none; n: each token's logprob and the n most likely
    n: int = 1                                  # samples of the prompt (OpenAI's n), one choice each


def longest_token_bytes(tok: Tokenizer) -> int:
    """The most UTF-8 bytes one token of `tok` stands for (special tokens included)."""
    return max(len(tok.decode([i], skip_special_tokens=False).encode("utf-8")) for i in range(tok.vocab_size))


class Validator:
    def __init__(self, tokenizer: Tokenizer, *, max_context: int, vocab: int, model_name: str,
                 grammars: Grammars | None = None, max_n: int = 1):
        """grammars: the engine folder's (structured outputs); None: such requests are a 400.
        max_n: the most samples a request may ask for (n): the batched server's max-num-seqs."""
        self.tok, self.max_context, self.vocab, self.model_name = tokenizer, max_context, vocab, model_name
        self.grammars, self.max_n = grammars, max_n
        # a text of more bytes has more than max_context tokens: each token covers at most
        # `longest` bytes (+1: a decoder may drop a token's leading space when it stands alone)
        self.longest = longest_token_bytes(tokenizer) + 1
        self.max_prompt_bytes = NORMALIZER_MARGIN * self.longest * max_context

    def _encode(self, text: str, param: str, **kw) -> list[int]:
        self._check_size(len(text.encode("utf-8")), param)
        return self.tok.encode(text, **kw)

    def _check_size(self, n: int, param: str) -> None:
        """Refuse text too long to fit max_context tokens before tokenizing it."""
        if n > self.max_prompt_bytes:
            raise RequestError(f"the prompt is {n} bytes of text, more than the {self.max_prompt_bytes} that the "
                               f"engines' max_context={self.max_context} tokens can hold with this tokenizer (no "
                               f"token stands for more than {self.longest} bytes): shorten the prompt",
                               param=param, code="context_length_exceeded")

    def completion(self, req: CompletionRequest) -> GenerationRequest:
        self._common(req)
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise RequestError(f"prompt is a batch of {len(p)} strings; this server takes one prompt per "
                                   "request: send them as separate (concurrent) requests", param="prompt")
            p = p[0]
        if isinstance(p, str):
            ids = self._encode(p, "prompt")
        else:
            with _field("prompt"):
                ids = check_token_ids(list(p), self.vocab)
        return self._finish(req, ids, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "completion")

    def chat(self, req: ChatCompletionRequest) -> GenerationRequest:
        self._common(req)
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise RequestError("max_tokens and max_completion_tokens disagree; send one of them",
                               param="max_completion_tokens")
        with _field("messages"):
            messages = chat_messages([{"role": m.role, "content": m.text()} for m in req.messages])
        self._check_size(sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages
                             if isinstance(m["content"], str)), "messages")
        with _field("messages"):
            ids = self.tok.encode_chat(messages)   # control tokens typed in messages are encoded as text
        return self._finish(req, ids, req.max_completion_tokens or req.max_tokens, None, "chat")

    # -----------------------------------------------------------------------------------
    def _common(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise ModelNotFoundError(f"model {req.model!r} is not served here; this server serves "
                                     f"{self.model_name!r} (GET /v1/models)", param="model",
                                     code="model_not_found")
        extra = dict(req.model_extra or {})
        for name, neutral in _NEUTRAL.items():
            if name in extra and not any(extra[name] == v and type(extra[name]) is type(v) for v in neutral):
                raise RequestError(f"{name}={_short(extra[name])} is not supported by specrt yet: leave it out"
                                   + (f" ({_INSTEAD[name]})" if name in _INSTEAD else ""), param=name,
                                   code="unsupported_parameter")

    def _finish(self, req, ids: list[int], max_tokens: int | None, default: int | None,
                kind: str) -> GenerationRequest:
        P, C = len(ids), self.max_context
        if P == 0:
            raise RequestError("the prompt is empty: give at least one token", param="prompt")
        if P >= C:
            raise RequestError(f"the prompt has {P} tokens; the engines were built with max_context={C}, leaving "
                               f"no room to generate: shorten the prompt (or rebuild with a larger --max-context)",
                               param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
        room = C - P
        if max_tokens is None:
            max_tokens = min(default, room) if default else room
        elif max_tokens > room:
            raise RequestError(f"max_tokens={max_tokens} plus the prompt's {P} tokens exceeds the engines' "
                               f"max_context={C}: ask for at most {room} tokens (or rebuild with a larger "
                               "--max-context)", param="max_tokens", code="context_length_exceeded")
        stop = req.stop if isinstance(req.stop, list) else [req.stop] if req.stop else []
        if len(stop) > MAX_STOP_STRINGS:
            raise RequestError(f"stop has {len(stop)} strings; give at most {MAX_STOP_STRINGS}", param="stop")
        try:
            sampling = SamplingParams(temperature=1.0 if req.temperature is None else req.temperature,
                                      top_p=1.0 if req.top_p is None else req.top_p,
                                      top_k=max(req.top_k or 0, 0), min_p=req.min_p or 0.0, seed=req.seed)
        except SamplingParamsError as e:
            raise RequestError(str(e)) from None
        with _field("stop_token_ids"):
            stop_ids = tuple(sorted(check_stop_token_ids(req.stop_token_ids or (), self.vocab)))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        structured = self._structured(req)
        if structured is not None and req.ignore_eos:
            raise RequestError("ignore_eos with a structured output: the grammar ends the answer with EOS when it is "
                               "complete; leave ignore_eos out", param="ignore_eos")
        return GenerationRequest(kind, tuple(ids), max_tokens, sampling, tuple(s for s in stop if s),
                                 bool(req.stream), include_usage, stop_ids, bool(req.ignore_eos), structured,
                                 self._logprobs(req, kind), self._n(req))

    def _n(self, req) -> int:
        n = 1 if req.n is None else req.n
        if n > self.max_n:
            how = (f"this server runs at most {self.max_n} rows at once (--max-num-seqs)" if self.max_n > 1 else
                   "n > 1 runs on the batched server: start it with --max-num-seqs N (a row per sample), or send n "
                   "requests")
            raise RequestError(f"n={n}: {how}", param="n", code="invalid_value")
        return n

    def _logprobs(self, req, kind: str) -> int | None:
        """How many alternatives each token's logprob comes with (None: no logprobs). Chat:
        `logprobs` true, with `top_logprobs` 0..20; completions: `logprobs` 0..20 (OpenAI's, and
        vLLM's limit of 20)."""
        extra = req.model_extra or {}
        lp, top = extra.get("logprobs"), extra.get("top_logprobs")
        if kind == "chat":
            if lp is not None and not isinstance(lp, bool):
                raise RequestError(f"logprobs={_short(lp)}: give true or false (top_logprobs sets how many "
                                   "alternatives)", param="logprobs", code="invalid_value")
            if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP):
                raise RequestError(f"top_logprobs={_short(top)}: give an integer in [0, {MAX_TOP}]",
                                   param="top_logprobs", code="invalid_value")
            if top and not lp:
                raise RequestError("top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
            n = (top or 0) if lp else None
        else:
            if top is not None:
                raise RequestError("top_logprobs is a chat field: the completions endpoint takes logprobs=N",
                                   param="top_logprobs", code="invalid_value")
            if lp is False or lp is None:
                return None
            if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP:
                raise RequestError(f"logprobs={_short(lp)}: give an integer in [0, {MAX_TOP}], the number of most "
                                   "likely alternatives reported with each token", param="logprobs",
                                   code="invalid_value")
            n = lp
        if n is not None and self.grammars is None:
            raise RequestError("this server was set up without the tokenizer logprobs are reported with",
                               param="logprobs")
        if n is not None:
            self.grammars.tokenizer     # the tokens' bytes come from it: built here, off the event loop
        return n

    def _structured(self, req) -> Structured | None:
        """The request's structured output, if it asks for one, with its grammar compiled."""
        extra = req.model_extra or {}
        given = [(name, extra[name]) for name in _STRUCTURED if extra.get(name) is not None
                 and not (name == "response_format" and extra[name] == {"type": "text"})]
        if not given:
            return None
        if len(given) > 1:
            raise RequestError(f"{' and '.join(n for n, _ in given)} each ask for a structured output: send one",
                               param=given[1][0])
        name, value = given[0]
        try:
            spec = _spec(name, value)
            if self.grammars is None:
                raise GrammarError("this server was set up without the tokenizer structured outputs are compiled for")
            self.grammars.compile(spec)
        except GrammarError as e:
            raise RequestError(f"{name}: {e}", param=name, code="invalid_value") from None
        return spec


def _spec(name: str, value) -> Structured:
    """A structured-output field's value -> a Structured (GrammarError when malformed)."""
    if name == "response_format":
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return Structured("json_object")
        if kind == "json_schema":
            js = value.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema"), (dict, bool)):
                raise GrammarError('a json_schema response_format is {"type": "json_schema", "json_schema": '
                                   '{"name": ..., "schema": {...}}}: the schema is missing')
            return Structured("json_schema", js["schema"])
        raise GrammarError(f"type {kind!r}: give 'text', 'json_object' or 'json_schema'")
    if name == "structured_outputs":
        return Structured.coerce(value if isinstance(value, dict) else [value])
    kind = {"guided_json": "json_schema", "json_schema": "json_schema", "guided_regex": "regex",
            "guided_choice": "choice", "guided_grammar": "grammar", "grammar": "grammar"}[name]
    return Structured(kind, value)


@contextmanager
def _field(param: str):
    """A typed error of the runtime's checks (the Python APIs raise the same) -> a 400 naming `param`."""
    try:
        yield
    except SpecrtError as e:
        raise RequestError(str(e), param=param, code="invalid_value") from None


def _short(value) -> str:
    """A refused value as the message shows it: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
