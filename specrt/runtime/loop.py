"""The decode loops: plain autoregressive and speculative (propose, verify, accept).

Glossary (vLLM's): per iteration the draft proposes k *draft* tokens; the target's
verify pass over [current, draft...] gives k+1 distributions; the longest prefix that
passes the accept rule is *accepted*; at the first rejection a *recovered* token is
sampled from the residual; if all k pass, a *bonus* token comes from the last row. So
every iteration emits between 1 and k+1 tokens, and the target never runs more than
once per iteration.

Both loops are generators yielding `Emitted` as soon as a token is final, and they
leave the caches consistent (length == tokens that have KV) when the caller stops
early: the `finally` blocks rewind to what was emitted.

Allocation: every buffer is made in `Workspace` before the loop; the greedy path
allocates no arrays per step (tests/test_real_model.py::test_greedy_decode_loop_allocates_no_arrays).
Top-k / top-p sampling allocates inside `probs_from_logits` (a sort), as documented there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from specrt.runtime import trace
from specrt.runtime.adaptive import AdaptiveK
from specrt.runtime.backends.base import ModelRunner as Model
from specrt.runtime.metrics import Metrics
from specrt.runtime.proposers import lookup, one_guess
from specrt.runtime.sampling import SamplingParams, Verdict, probs_from_logits, sample, verify_greedy, verify_sampled


@dataclass(frozen=True)
class Emitted:
    token: int
    from_draft: bool


class Workspace:
    """Every buffer the loops touch, allocated once for (k, vocab)."""

    def __init__(self, k: int, vocab: int):
        self.k = k
        self.p = np.zeros((k + 1, vocab), np.float32)       # warped target rows
        self.q = np.zeros((max(k, 1), vocab), np.float32)    # warped draft rows
        self.scratch = np.zeros(vocab, np.float32)
        self.argmax = np.zeros(k + 1, np.int64)
        self.draft_tokens = np.zeros(max(k, 1), np.int64)
        self.verify_tokens = [0] * (k + 1)


def _choose(logits_row: np.ndarray, params: SamplingParams, rng, out: np.ndarray) -> int:
    if params.greedy:
        return int(np.argmax(logits_row))
    return sample(probs_from_logits(logits_row, params, out), rng)


def prefill(model: Model, graph_tokens: int, prompt: list[int]) -> np.ndarray:
    """Feed the prompt in static chunks; returns the logits row of its last token."""
    last = None
    trace.push("prefill")
    for start in range(0, len(prompt), graph_tokens):
        chunk = prompt[start:start + graph_tokens]
        last = model.step("prefill", chunk, start)[len(chunk) - 1]
    trace.pop()
    model.cache.rewind_to(len(prompt))
    return last


def plain_decode(target: Model, first_logits: np.ndarray, start: int, budget: int, params: SamplingParams,
                 rng, ws: Workspace, metrics: Metrics) -> Iterator[Emitted]:
    """Plain autoregressive decoding through the target's one-token graph.

    start: tokens with KV in the cache (the prompt); budget: most tokens to emit."""
    length = start
    try:
        tok = _choose(first_logits, params, rng, ws.scratch)
        for i in range(budget):
            metrics.tokens += 1            # counted as handed out, as in speculative_decode
            yield Emitted(tok, False)
            if i == budget - 1:
                break
            t0 = time.perf_counter()
            trace.push("decode")
            if params.greedy:    # the backend chooses: a device backend reads back one integer
                target.argmax_step("decode", (tok,), length, ws.argmax[:1])
                tok = int(ws.argmax[0])
            else:
                tok = _choose(target.step("decode", (tok,), length)[0], params, rng, ws.scratch)
            trace.pop()
            metrics.time_verify += time.perf_counter() - t0
            length += 1
            metrics.iterations += 1
    finally:
        target.cache.rewind_to(length)


def speculative_decode(target: Model, draft: Model, first_logits: np.ndarray, start: int, budget: int,
                       params: SamplingParams, rng, ws: Workspace, metrics: Metrics, *,
                       draft_start: int, shared_cache: bool, seq: list[int],
                       policy: AdaptiveK | None = None, lookup_n: int = 0, pair: bool = False,
                       table=None) -> Iterator[Emitted]:
    """Speculative decoding: the draft proposes ws.k tokens, the target verifies them in one pass.

    start: tokens with KV in the target cache (the prompt). draft_start: the same for the
    draft's own cache (ignored when `shared_cache`: a quantized copy of the target reads
    the target's cache for the context and writes its guesses into rows the verify pass
    then overwrites). seq: the prompt; emitted tokens are appended (the draft's catch-up
    reads it). budget: most tokens to emit (already clipped to the context).
    policy: adaptive k (runtime/adaptive.py): each round it chooses a plain step (through the
    target's one-token graph, which must be loaded), k draft tokens, or, with lookup_n > 0,
    prompt lookup's guess (the continuation of the latest earlier match of the last lookup_n
    tokens: free to propose, verified like a draft whose distribution is one-hot). None:
    every round drafts ws.k (fewer near the budget).
    pair: the target's decode graph runs two rows (a quantized target's, calibration/rows.py);
    with a policy and lookup_n > 0, a round may then put one guessed token (prompt lookup's
    first, a 1-gram match, or the engines' n-gram `table`, runtime/ngrams.py) in the second
    row: a *pair round*, verified like a lookup round of k = 1 for the cost of a plain step.
    """
    k, vt = ws.k, ws.verify_tokens
    length = start                     # target rows with KV; seq[length] is `cur`
    d_len = start if shared_cache else draft_start
    emitted = 0
    try:
        cur = _choose(first_logits, params, rng, ws.scratch)
        seq.append(cur)
        emitted = metrics.tokens = 1
        yield Emitted(cur, False)
        while emitted < budget:
            k_eff = min(k, budget - emitted - 1)   # the verify pass emits up to k_eff + 1
            how = "draft"
            if policy is not None:
                guess = lookup(seq, lookup_n, k_eff) if lookup_n and k_eff else ()
                one = one_guess(seq, guess, table) if pair and lookup_n and k_eff else None
                how, k_eff = policy.choose(k_eff, len(guess), pair=one is not None)
                if how == "pair":              # the guess rides in the decode graph's second row
                    guess = (one,)
                if how == "plain":             # speculation does not pay here: one plain step
                    cur = _plain_step(target, cur, length, params, rng, ws, metrics)
                    policy.observe("plain", 0, 0)
                    seq.append(cur)
                    length += 1
                    emitted += 1
                    metrics.tokens += 1
                    yield Emitted(cur, False)
                    continue
            t0 = time.perf_counter()
            trace.push("draft")
            x = vt[0] = cur                  # verify window: [cur, x1..x_k_eff]
            if how in ("lookup", "pair"):    # a guess: a deterministic (one-hot) proposal
                for j in range(k_eff):
                    x = vt[j + 1] = ws.draft_tokens[j] = guess[j]
                    if not params.greedy:
                        ws.q[j].fill(0.0)
                        ws.q[j, x] = 1.0
                if how == "pair":
                    metrics.pair_rounds += 1
                else:
                    metrics.lookup_rounds += 1
            else:
                if not shared_cache:         # feed what the draft has not seen (e.g. a bonus token's predecessor)
                    while d_len < length:
                        draft.step("decode", (seq[d_len],), d_len)
                        d_len += 1
                for j in range(k_eff):
                    if params.greedy:
                        draft.argmax_step("decode", (x,), length + j, ws.draft_tokens[j:j + 1])
                        x = int(ws.draft_tokens[j])
                    else:
                        x = sample(probs_from_logits(draft.step("decode", (x,), length + j)[0], params, ws.q[j]),
                                   rng)
                        ws.draft_tokens[j] = x
                    vt[j + 1] = x
            trace.pop()
            t1 = time.perf_counter()
            trace.push("verify")
            window = vt[:k_eff + 1] if k_eff < k else vt
            graph = "decode" if how == "pair" else "verify"
            if params.greedy:                # [k_eff+1] target choices, no logits rows on the host
                target.argmax_step(graph, window, length, ws.argmax[:k_eff + 1])
                p_logits = None
            else:
                p_logits = target.step(graph, window, length)
            trace.pop()
            t2 = time.perf_counter()
            trace.push("accept")
            verdict = _verify(p_logits, k_eff, params, rng, ws)
            trace.pop()
            t3 = time.perf_counter()
            metrics.time_draft += t1 - t0
            metrics.time_verify += t2 - t1
            metrics.time_accept += t3 - t2
            metrics.record_iteration(k_eff, verdict.n_accepted)
            if policy is not None:
                policy.observe(how, k_eff, verdict.n_accepted)
            if not shared_cache and how == "draft":
                d_len = min(length + k_eff, length + verdict.n_accepted + 1)
            for j in range(verdict.n_accepted):
                tok = int(ws.draft_tokens[j])
                seq.append(tok)
                length += 1
                emitted += 1
                metrics.tokens += 1
                yield Emitted(tok, True)
            cur = verdict.next_token
            seq.append(cur)
            length += 1
            emitted += 1
            metrics.tokens += 1
            yield Emitted(cur, False)
    finally:
        # rows [0, length) hold K/V of every emitted token but the last one (`cur`)
        committed = start + max(emitted - 1, 0)
        target.cache.rewind_to(committed)
        if not shared_cache:
            draft.cache.rewind_to(min(d_len, committed))


def _plain_step(target: Model, cur: int, length: int, params: SamplingParams, rng, ws: Workspace,
                metrics: Metrics) -> int:
    """One target decode step for `cur` at row `length`; returns the next token."""
    t0 = time.perf_counter()
    trace.push("decode")
    if params.greedy:
        target.argmax_step("decode", (cur,), length, ws.argmax[:1])
        nxt = int(ws.argmax[0])
    else:
        nxt = _choose(target.step("decode", (cur,), length)[0], params, rng, ws.scratch)
    trace.pop()
    metrics.time_verify += time.perf_counter() - t0
    metrics.record_iteration(0, 0)
    metrics.plain_steps += 1
    return nxt


def _verify(p_logits: np.ndarray | None, k_eff: int, params: SamplingParams, rng, ws: Workspace) -> Verdict:
    # greedy: ws.argmax[:k_eff+1] holds the target's choices at [cur, x1..x_k_eff];
    # sampled: p_logits [k_eff+1, V] are the target's logits there
    if params.greedy:
        return verify_greedy(ws.argmax[:k_eff + 1], ws.draft_tokens[:k_eff])
    for i in range(k_eff + 1):
        probs_from_logits(p_logits[i], params, ws.p[i])
    return verify_sampled(ws.p[:k_eff + 1], ws.q[:k_eff], ws.draft_tokens[:k_eff], rng, ws.scratch)
