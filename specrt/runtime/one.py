"""The single stream as a batch of one: `SpeculativeGenerator` on an engine folder whose
batched model verifies windows (`specrt build --batch --batch-attention rows`, or `--attention
standard --batch`) runs every request on that model through the batched engine
(runtime/batch/engine.py), stepped from the caller's thread (`BatchEngine.drive`). The
server, `open_batch`, `generate_batch` and the Triton model run the same graphs with the same
policy and accept rule, so a folder gives one answer however it is called: greedy tokens are
identical and a seeded sample is the same (the build's batch and window invariance gates).

    method "plain"        plain steps only
           "lookup"       prompt lookup (n = ngram) and pair rounds, chosen per step by cost
           "speculative"  the above and the int8 self-draft inside the batch (ngram=0: no lookup)

Each round is chosen by the build's measured batch step costs (runtime/batch/policy.py); a k
given to the generator caps the rounds' windows. The one-row graphs of such a folder are
not loaded (`engine="one-row"` loads them: `specrt bench` and `specrt profile` time them).
"""
from __future__ import annotations

import time
from typing import Iterator

from specrt.runtime.batch.generator import check_batch_entry, batch_engine
from specrt.runtime.batch.policy import BatchCosts, BatchPolicy
from specrt.runtime.batch.request import Delta, Done, Request
from specrt.runtime.loop import Emitted
from specrt.runtime.methods import Method
from specrt.runtime.metrics import Metrics
from specrt.runtime.proposers import PromptLookup


def speculates(man) -> bool:
    """Is this folder's batched model its one engine for every caller? It must verify windows
    (the build's window_invariance gate), have the batched step costs its policy chooses by,
    and, when the folder has a draft, that draft's batched graph: else a batch of one would
    run plain steps where the one-row graphs speculate (an older build, --draft truncate:N or
    a draft model, --draft-vocab, --no-measure-costs), and those folders keep their one-row
    graphs. A damaged record is a ManifestError, as open_batch raises."""
    entry = man.batch
    if entry is None:
        return False
    check_batch_entry(entry)
    win = entry.parity.get("window_invariance") or {}
    if win.get("equal") is not True:
        return False
    if BatchCosts.from_manifest((man.build or {}).get("speculation")) is None:
        return False
    return man.draft is None or "draft" in entry.graphs


class BatchOfOne:
    def __init__(self, root, *, threads: int, verify: str, k: int):
        self.engine, self.tokenizer = batch_engine(root, max_num_seqs=1, threads=threads, verify=verify)
        # the engine emits every token (EOS too): the caller stops, as with SpeculativeGenerator.tokens
        self.engine.tokenizer, self.engine.eos = None, frozenset()
        self.full, self.k = self.engine.policy, k
        self.has_draft = self.full.has_draft

    def policy(self, method: Method, ngram: int) -> BatchPolicy:
        """The round choices of one request (the engine runs one request at a time)."""
        full = self.full
        if method is Method.PLAIN or full.costs is None:
            return BatchPolicy(None, self.k)
        lookup = PromptLookup(ngram, self.k) if ngram else None
        return BatchPolicy(full.costs, self.k, lookup=lookup, pair_guess=full.pair_guess if lookup else None,
                           draft=full.has_draft and method is Method.SPECULATIVE, priors=full.priors)

    def tokens(self, prompt_ids: list[int], max_new_tokens: int, sampling, seed: int, m: Metrics, method: Method,
               ngram: int) -> Iterator[Emitted]:
        """Yield the request's tokens as they become final, counting them into `m` (the
        caller's last_metrics; its finish_reason is the engine's, or what a caller that stopped
        early set)."""
        eng = self.engine
        eng.policy = self.policy(method, ngram)
        t0 = time.perf_counter()
        stream = eng.drive(Request(list(prompt_ids), max_new_tokens, sampling, seed, metrics=m))
        done: Done | None = None
        yielded = 0
        try:
            for ev in stream:
                if isinstance(ev, Delta):
                    if not m.time_prefill:
                        m.time_prefill = time.perf_counter() - t0
                    for tok, from_draft in zip(ev.tokens, ev.from_draft):
                        yielded += 1
                        yield Emitted(tok, from_draft)
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
