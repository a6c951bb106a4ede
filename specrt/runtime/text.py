"""Text in, text out: streaming chunks with stop strings over `SpeculativeGenerator.tokens`.

`TextStreaming` is the text half of the public generator (runtime/generator.py): it turns
the token stream into text chunks (held back while they may be the start of a stop
string), stops on EOS, a stop string, the token budget or the maximum context, and
reports which in `last_metrics.finish_reason`.
"""
from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from specrt.errors import SamplingParamsError
from specrt.runtime.metrics import Metrics
from specrt.runtime.prompt import check_stop_token_ids
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.tokenizer import IncrementalDecoder


@dataclass
class Chunk:
    """A piece of streamed output: the text it adds and the tokens behind it."""
    text: str
    tokens: list[int]
    from_draft: list[bool]
    logprobs: list | None = None    # TokenLogprob per token (runtime/logprobs.py), when asked for


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    metrics: Metrics
    prompt_tokens: int = 0
    message: str = field(default="")
    logprobs: list | None = None    # TokenLogprob per token, when asked for


class TextStreaming:
    """stream() and generate() for a class that has encode_prompt(), tokens(), tokenizer,
    shapes and last_metrics (SpeculativeGenerator)."""

    def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (), chat: bool = False,
               system: str | None = None, method: str | None = None, ngram: int = 2,
               stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, structured=None,
               logprobs: int | None = None) -> Iterator[Chunk]:
        """Yield text chunks as tokens are accepted; stops on EOS, a stop string, one of
        `stop_token_ids`, the token budget or the maximum context (`last_metrics.finish_reason`
        says which: "eos", "stop", "length", "max_context"). ignore_eos: EOS is a token like any
        other (generation runs to the budget; its text is empty when it is a special token).
        structured: the output must match it (runtime/grammar.py; engine folders with a batched model).
        logprobs: None, or n in [0, 20]: each chunk's `logprobs` holds its tokens' log-probabilities with
        the n most likely alternatives (runtime/logprobs.py; engine folders with a batched model)."""
        ids = self.encode_prompt(prompt, chat=chat, system=system)
        text = TextTail(self.tokenizer, stop, stop_token_ids=check_stop_token_ids(stop_token_ids, self.vocab),
                        ignore_eos=ignore_eos)
        kw = {} if structured is None else {"structured": structured, "ignore_eos": ignore_eos}
        if logprobs is not None:
            kw["logprobs"] = logprobs
        gen = self.tokens(ids, max_new_tokens=max_new_tokens, sampling=sampling, method=method, ngram=ngram, **kw)
        with closing(gen):
            for e in gen:
                chunk, reason = text.push(e.token, e.from_draft)
                if chunk is not None:
                    if logprobs is not None:
                        chunk.logprobs = [e.logprob] * len(chunk.tokens)
                    yield chunk
                if reason:
                    self.last_metrics.finish_reason = reason
                    break
            else:
                if (rest := text.flush()) is not None:
                    yield rest

    def generate(self, prompt: str | Sequence[int], **kw) -> Completion:
        chunks = list(self.stream(prompt, **kw))
        lps = None if kw.get("logprobs") is None else [lp for c in chunks for lp in (c.logprobs or ())]
        m = self.last_metrics
        msg = ""
        if m.finish_reason == "max_context":
            msg = (f"stopped at the maximum context ({self.shapes.max_context} tokens); rebuild with a larger "
                   "--max-context for longer outputs")
        return Completion("".join(c.text for c in chunks), [t for c in chunks for t in c.tokens],
                          m.finish_reason, m, m.prompt_tokens, msg, lps)



def _stop_strings(stop) -> list[str]:
    """`stop` is one string or a sequence of strings (a bare string is ONE stop, not its characters)."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    try:
        stops = list(stop)
    except TypeError:
        raise SamplingParamsError(f"stop must be a string or a list of strings, got {type(stop).__name__}") from None
    for s in stops:
        if not isinstance(s, str):
            raise SamplingParamsError(f"stop strings must be str, got {s!r} ({type(s).__name__})")
    return [s for s in stops if s]


def stop_token_set(ids, ignore_eos) -> frozenset[int]:
    """`stop_token_ids` as a set of ints (a SamplingParamsError for anything else); checks
    `ignore_eos` is a bool."""
    if not isinstance(ignore_eos, bool):
        raise SamplingParamsError(f"ignore_eos={ignore_eos!r} must be True or False")
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise SamplingParamsError(f"stop_token_ids={ids!r} must be a sequence of token ids (integers >= 0)")
    ids = list(ids)
    if any(isinstance(t, bool) or not hasattr(t, "__index__") or int(t) < 0 for t in ids):
        raise SamplingParamsError(f"stop_token_ids={ids!r} must be a sequence of token ids (integers >= 0)")
    return frozenset(int(t) for t in ids)


def _partial_stop_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best


class TextTail:
    """One request's tokens in, text chunks out: streaming detokenization, EOS and stop strings.

    push(token) -> (chunk or None, finish reason or None): "eos" (the EOS token itself is not
    reported; held-back text is released), "stop" (the token that completed a stop string is
    reported, its text trimmed at the stop string; a token of `stop_token_ids` is not reported,
    as vLLM leaves it out of the text). Text that may be the start of a stop string is held
    back until it is not. flush() releases what is held when the tokens run out.
    ignore_eos: the EOS tokens are ordinary tokens (vLLM's ignore_eos)."""

    def __init__(self, tokenizer, stop=(), *, stop_token_ids=(), ignore_eos: bool = False):
        extra = stop_token_set(stop_token_ids, ignore_eos)
        self.eos = frozenset() if ignore_eos else tokenizer.eos_token_ids
        self.stop_ids = extra - self.eos     # an EOS id listed here still ends as "eos"
        self.dec = IncrementalDecoder(tokenizer)
        self.stop = _stop_strings(stop)
        self.held = ""   # text not yet released because it may be the start of a stop string

    def push(self, token: int, from_draft: bool = False) -> tuple[Chunk | None, str | None]:
        if token in self.eos or token in self.stop_ids:
            held, self.held = self.held, ""
            return (Chunk(held, [], []) if held else None), "eos" if token in self.eos else "stop"
        held = self.held + self.dec.push(token)
        hit = min((i for i in (held.find(s) for s in self.stop) if i >= 0), default=-1)
        if hit >= 0:
            self.held = ""
            return Chunk(held[:hit], [token], [from_draft]), "stop"
        keep = _partial_stop_suffix(held, self.stop)
        out, self.held = held[:len(held) - keep], held[len(held) - keep:]
        return Chunk(out, [token], [from_draft]), None

    def flush(self) -> Chunk | None:
        held, self.held = self.held, ""
        return Chunk(held, [], []) if held else None
