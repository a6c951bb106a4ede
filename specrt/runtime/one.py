"""The single stream as a batch of one: `SpeculativeGenerator` on an engine folder with a
batched model (`specrt build --batch`) runs every request on that model through the batched
engine (runtime/batch/engine.py), stepped from the caller's thread (`BatchEngine.drive`). The
server, `open_batch`, `generate_batch` and the Triton model run the same graphs with the same
policy and accept rule, so a folder gives one answer however it is called: greedy tokens are
identical and a seeded sample is the same (the build's batch and window invariance gates).

    method "plain"        plain steps only
           "lookup"       prompt lookup (n = ngram) and pair rounds, chosen per step by cost
           "speculative"  the above and the int8 self-draft inside the batch (ngram=0: no lookup)

Each round is chosen by the build's measured batch step costs (runtime/batch/policy.py); a k
given to the generator caps the rounds' windows. What the batched model cannot do, the batch
of one does not do either, so that it keeps the server's answers (`plain_because` says why):
a `--batch-attention gqa` model verifies no windows (plain steps only), a build without
measured costs (--no-measure-costs) has no policy (plain steps), and a draft without a batched
graph (--draft-vocab, or a folder built before draft models got one) is not used (lookup and
pair rounds). A draft model or truncate:N runs inside the batch with its own cache
(models.batch_draft).
The one-row graphs of such a folder are not loaded (`engine="one-row"` loads them: `specrt
bench` and `specrt profile` time them, and answers may then differ from the server's).

A folder without a batched model (no `--batch`, the GPU builds), and `engine="one-row"`, run
the folder's one-row graphs on the same engine, one row (runtime/batch/one_row.py): rounds by
the build's one-row costs, or fixed-k rounds where it measured none (or with an explicit k, or
`adaptive=False`); `method="lookup"` verifies every guess there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from specrt.runtime.batch.folder import check_batch_entry, batch_engine
from specrt.runtime.batch.policy import BatchCosts, BatchPolicy
from specrt.runtime.batch.request import Delta, Done, Request
from specrt.runtime.methods import Method
from specrt.runtime.metrics import Metrics
from specrt.runtime.proposers import PromptLookup


@dataclass(frozen=True)
class Emitted:
    """A token of `SpeculativeGenerator.tokens`: from_draft, a proposal the target accepted."""
    token: int
    from_draft: bool
    logprob: object = None          # a TokenLogprob (batch/request.py), when the request asked for it


def one_engine(man) -> bool:
    """Is this folder's batched model its one engine for every caller? Yes whenever it has one
    (the build gated it for batch invariance). A damaged record is a ManifestError, as
    open_batch raises."""
    if man.batch is None:
        return False
    check_batch_entry(man.batch)
    return True


def plain_because(man) -> str | None:
    """Why a batch of one on this folder cannot speculate (None: it can, by measured cost):
    what `specrt inspect` shows and the build logs."""
    entry = man.batch
    if entry is None:
        return None
    if (entry.parity.get("window_invariance") or {}).get("equal") is not True:
        return (f"its batched model ({entry.source.get('attention', '?')} attention) verifies no windows: rebuild "
                "with --batch-attention rows to speculate")
    if BatchCosts.from_manifest((man.build or {}).get("speculation")) is None:
        return "the build measured no batched step costs (--no-measure-costs): rebuild without it to speculate"
    return None


def draft_left_out(man) -> bool:
    """Does the folder have a draft that its batched model cannot run (no batched draft graph,
    no batched draft model)?"""
    return man.draft is not None and man.batch is not None and "draft" not in man.batch.graphs \
        and man.batch_draft is None


class BatchOfOne:
    """One request at a time on a BatchEngine of one row, stepped from the caller's thread:
    the batched model's (`open`), or a folder's one-row graphs (batch/one_row.py). fixed: the
    engine's rounds are fixed-k (a one-row build that measured no step costs)."""

    def __init__(self, engine, tokenizer, *, k: int, fixed: bool = False, one_row: bool = False):
        self.engine, self.tokenizer, self.one_row = engine, tokenizer, one_row
        # the engine emits every token (EOS too): the caller stops, as with SpeculativeGenerator.tokens
        self.engine.tokenizer, self.engine.eos = None, frozenset()
        self.full, self.k, self.fixed = engine.policy, k, fixed
        self.has_draft = self.full.has_draft

    @classmethod
    def open(cls, root, *, threads: int, verify: str, k: int, head=None) -> "BatchOfOne":
        """The folder's batched model (`specrt build --batch`) as a batch of one (head: a trained
        draft head's folder, the draft)."""
        engine, tokenizer = batch_engine(root, max_num_seqs=1, threads=threads, verify=verify, head=head)
        return cls(engine, tokenizer, k=k)

    def policy(self, method: Method, ngram: int, fixed: bool | None = None) -> BatchPolicy:
        """The round choices of one request (the engine runs one request at a time). fixed: every
        round drafts k (or verifies lookup's guess) whatever the costs (`adaptive=False`); False:
        rounds by cost (`adaptive=True`); None: the instance's setting. On one-row graphs
        `method="lookup"` verifies every guess, as it always has there."""
        full = self.full
        fixed = self.fixed if fixed is None else fixed
        fixed = fixed or (self.one_row and method is Method.LOOKUP)
        if method is Method.PLAIN or (full.costs is None and not fixed):
            return BatchPolicy(None, self.k)
        lookup = PromptLookup(ngram, self.k) if ngram else None
        return BatchPolicy(full.costs, self.k, lookup=lookup, pair_guess=full.pair_guess if lookup else None,
                           draft=full.has_draft and method is Method.SPECULATIVE, priors=full.priors,
                           pooled=full.pooled, pair=full.has_pair, fixed=fixed)

    def tokens(self, prompt_ids: list[int], max_new_tokens: int, sampling, seed: int, m: Metrics, method: Method,
               ngram: int, grammar=None, logprobs: int | None = None, fixed: bool | None = None) -> Iterator[Emitted]:
        """Yield the request's tokens as they become final, counting them into `m` (the
        caller's last_metrics; its finish_reason is the engine's, or what a caller that stopped
        early set)."""
        eng = self.engine
        eng.policy = self.policy(method, ngram, fixed)
        t0 = time.perf_counter()
        stream = eng.drive(Request(list(prompt_ids), max_new_tokens, sampling, seed, metrics=m, grammar=grammar,
                                   logprobs=logprobs))
        done: Done | None = None
        yielded = 0
        try:
            for ev in stream:
                if isinstance(ev, Delta):
                    if not m.time_prefill:
                        m.time_prefill = time.perf_counter() - t0
                    lps = ev.logprobs or [None] * len(ev.tokens)
                    for tok, from_draft, lp in zip(ev.tokens, ev.from_draft, lps):
                        yielded += 1
                        yield Emitted(tok, from_draft, lp)
                else:
                    done = ev
        finally:
            # set by a caller that stopped (EOS, a stop string), or None; "cancelled" is the
            # engine's own cleanup (an early close, a model error), which the one-row path leaves None
            reason = None if m.finish_reason == "cancelled" else m.finish_reason
            stream.close()                    # cancels the request if it still runs
            m.finish_reason = reason if done is None else done.finish_reason
            # the tokens the caller saw (a round's tokens past its EOS or stop string are not its)
            m.tokens = yielded
            m.time_total = time.perf_counter() - t0
