"""A request in the batched engine, the row it runs in, and the events it streams.

    Request  what the caller asked for (immutable), plus a cancel flag
    Row      one running request: its cache row, tokens, lengths, text, estimates
    events   Delta (text and tokens as they become final), Done (finish reason, counts),
             Failed (a typed error): delivered to the request's `sink` from the engine thread
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from specrt.runtime.costs import Acceptance
from specrt.runtime.metrics import Metrics
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.text import TextTail

FINISH = ("eos", "stop", "length", "max_context", "cancelled", "timeout")


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the target (its raw distribution: log_softmax of
    the logits, before temperature, top-k/top-p/min-p and any grammar mask), and the `top` most
    likely tokens there as (id, logprob), most likely first (runtime/logprobs.py)."""
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Delta:
    text: str
    tokens: tuple[int, ...]
    from_draft: tuple[bool, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None     # one per token, when the request asked for them


@dataclass(frozen=True)
class Done:
    finish_reason: str          # one of FINISH
    prompt_tokens: int
    completion_tokens: int
    metrics: Metrics


@dataclass(frozen=True)
class Failed:
    error: Exception


@dataclass(eq=False)
class Request:
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int                                 # the seed in force (drawn at submission when params.seed is None)
    stop: tuple[str, ...] = ()
    deadline: float | None = None             # engine clock time after which the request times out
    sink: Callable[[object], None] = lambda event: None
    id: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    stop_token_ids: frozenset[int] = frozenset()   # end with "stop" on emitting one (left out of the text)
    ignore_eos: bool = False                       # EOS is an ordinary token: run to the budget
    # asked at every engine step while the request waits or runs (e.g. Triton's
    # request.is_cancelled, which has no callback): True cancels it as cancel() does
    poll_cancel: Callable[[], bool] | None = None
    metrics: Metrics | None = None                 # the caller's, filled as the request runs (None: the row's own)
    grammar: object | None = None                  # a runtime/grammar.py Matcher: the output must match it
    logprobs: int | None = None                    # None: none; n >= 0: each token's logprob and the n most likely
    # more samples of the same prompt: each takes a row of its own after this request's prompt is
    # prefilled (its cache row copied: one prompt pass for all), with its own seed, sink and grammar
    siblings: tuple["Request", ...] = ()

    def cancel(self) -> None:
        self.cancelled.set()


class Row:
    """A request while it holds a cache row. seq: prompt + emitted tokens; `length`: rows of
    the target cache with K/V (the prompt part prefilled so far, then len(seq) - 1)."""

    def __init__(self, req: Request, budget: int, tokenizer, priors: dict, k_max: int):
        """priors: per proposer, the prior acceptance (a float: Acceptance(p, 4, 0.9)) or the
        estimate to start from (an Acceptance: BatchPolicy.row_accept)."""
        self.req, self.budget = req, budget
        self.seq = list(req.prompt)
        self.length = 0                       # prefill progress, then target rows with K/V
        self.draft_len = 0                    # rows of a draft's own cache with K/V of seq (engine.py)
        self.head_len = 0                     # pairs in a draft head's cache (engine.py _draft_head)
        self.feats: list = []                 # the target's hidden states at positions head_len..length-1
        self.emitted = 0
        self.text = TextTail(tokenizer, req.stop, stop_token_ids=req.stop_token_ids,
                             ignore_eos=req.ignore_eos) if tokenizer is not None else None
        self.finish: str | None = None
        self.error: Exception | None = None   # set (finish "failed"): the request ends with Failed, not Done
        self.lps: list = []                   # TokenLogprob of the round's tokens, in order (req.logprobs set)
        self.metrics = req.metrics or Metrics(method="batched", k=k_max, prompt_tokens=len(req.prompt))
        self.accept = {kind: p if isinstance(p, Acceptance) else Acceptance(p, 4.0, 0.9)
                       for kind, p in priors.items()}   # per proposer
        # the policy's probes (policy.py _probe): plain steps since the last draft round, how many
        # before the next probe (None: the policy's cooldown), lookup guesses passed over in a row
        self.plain_run, self.probe_gap, self.lookup_refused = 0, None, 0
        self.unverified = ()                  # prompt lookup's guess for this step, not verified (policy.py)

    @property
    def prefilled(self) -> bool:
        return self.length >= len(self.req.prompt)

    @property
    def room(self) -> int:
        """Tokens a round may propose: one round emits up to room + 1 (the budget is left)."""
        return self.budget - self.emitted - 1

    def position(self) -> int:
        """Index in seq of the next token to choose."""
        return len(self.seq)
