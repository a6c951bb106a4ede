"""The decode loop: one round skeleton (plan -> propose -> verify -> accept -> emit) for
plain, speculative and prompt-lookup decoding alike; only the planner differs.

    planner.next(seq, room) -> Plan(kind, k, proposer, ready)  which round, what proposes it
    proposal = ready or proposer.propose(seq, k)                  runtime/proposers/
    rounds.target_pass(target, kind.graph, [cur, proposal...])    one target pass
    verdict  = rounds.accept(...)                                 the accept rule
    proposer.accept(n); planner.observe(kind, k, n)
    emit the n accepted tokens, then the recovered/bonus token

`decode` is a generator yielding `Emitted` as soon as a token is final, and it leaves the
caches consistent (rows with K/V == tokens emitted but the last) when the caller stops
early: its `finally` rewinds the target and every proposer.

Allocation: buffers live in `rounds.Workspace` and in the proposers, made before the loop;
the greedy path allocates no arrays per round (tests/test_real_model.py). Top-k / top-p
sampling allocates inside `probs_from_logits` (a sort), as documented there.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from specrt.runtime import nvtx_ranges as trace
from specrt.runtime.adaptive import AdaptiveK
from specrt.runtime.backends.base import ModelRunner
from specrt.runtime.metrics import Metrics
from specrt.runtime.proposers.base import EMPTY, Proposal, Proposer
from specrt.runtime.rounds import RoundKind, Workspace, accept, first_token, prefill, target_pass
from specrt.runtime.sampling import SamplingParams

__all__ = ["Emitted", "Workspace", "prefill", "decode", "Plain", "FixedDraft", "Lookup", "Adaptive"]


@dataclass(frozen=True)
class Emitted:
    token: int
    from_draft: bool
    logprob: object = None          # a TokenLogprob (batch/request.py), when the request asked for it


@dataclass(frozen=True)
class Plan:
    kind: RoundKind
    k: int = 0
    proposer: Proposer | None = None   # who proposes (and hears the verdict)
    ready: Proposal | None = None      # a proposal the planner already made (a free guess)


PLAIN = Plan(RoundKind.PLAIN)


class Plain:
    """Plain autoregressive decoding: every round is one decode step."""
    adaptive = False
    proposers: tuple = ()

    def next(self, seq: Sequence[int], room: int) -> Plan:
        return PLAIN

    def observe(self, kind: RoundKind, k: int, accepted: int) -> None:
        pass


class FixedDraft(Plain):
    """Every round drafts min(k_max, room) tokens with the draft model and verifies them with
    the verify graph (the last round, with no room, verifies only `cur` there)."""

    def __init__(self, draft: Proposer):
        self.draft = draft
        self.proposers = (draft,)

    def next(self, seq: Sequence[int], room: int) -> Plan:
        return Plan(RoundKind.DRAFT, room, self.draft)


class Lookup(Plain):
    """Prompt lookup (greedy): a round verifies lookup's guess when there is one, else it is a
    plain step. pair: a chain of one-token guessers (the 1-gram match, the n-gram table) for a
    target whose decode graph has two rows: a guess shorter than two tokens rides in the decode
    graph's second row (a pair round) instead."""

    def __init__(self, lookup: Proposer, pair: Proposer | None = None):
        self.lookup, self.pair = lookup, pair
        self.proposers = tuple(p for p in (lookup, pair) if p is not None)

    def next(self, seq: Sequence[int], room: int) -> Plan:
        guess = self.lookup.propose(seq, room)
        if self.pair is not None and room and len(guess) < 2:
            if len(guess):
                return Plan(RoundKind.PAIR, 1, self.lookup, guess)
            one = self.pair.propose(seq, 1)
            return Plan(RoundKind.PAIR, 1, self.pair, one) if len(one) else PLAIN
        return Plan(RoundKind.LOOKUP, len(guess), self.lookup, guess) if len(guess) else PLAIN


class Adaptive(Plain):
    """Adaptive k (runtime/adaptive.py) choosing, each round, between a plain step, the draft
    model's k tokens, prompt lookup's guess (lookup: None turns it off) and a pair round (pair:
    the one-token guessers, for a two-row decode graph)."""
    adaptive = True

    def __init__(self, policy: AdaptiveK, draft: Proposer, lookup: Proposer | None = None,
                 pair: Proposer | None = None):
        self.policy, self.draft, self.lookup = policy, draft, lookup
        self.pair = pair if lookup is not None else None    # pair guesses start from lookup's
        self.proposers = tuple(p for p in (draft, lookup, self.pair) if p is not None)

    def next(self, seq: Sequence[int], room: int) -> Plan:
        guess = self.lookup.propose(seq, room) if self.lookup is not None and room else EMPTY
        one, one_from = EMPTY, None
        if self.pair is not None and room:
            one, one_from = (guess, self.lookup) if len(guess) else (self.pair.propose(seq, 1), self.pair)
        how, k = self.policy.choose(room, len(guess), pair=len(one) > 0)
        kind = RoundKind(how)
        if kind is RoundKind.PAIR:
            return Plan(kind, 1, one_from, Proposal(one.tokens[:1]))
        if kind is RoundKind.LOOKUP:
            return Plan(kind, k, self.lookup, Proposal(guess.tokens[:k]))
        if kind is RoundKind.DRAFT:
            return Plan(kind, k, self.draft)
        return PLAIN

    def observe(self, kind: RoundKind, k: int, accepted: int) -> None:
        self.policy.observe(kind.value, k, accepted)


def decode(target: ModelRunner, planner: Plain, first_logits, start: int, budget: int, params: SamplingParams,
           seed: int, ws: Workspace, metrics: Metrics, *, seq: list[int]) -> Iterator[Emitted]:
    """Decode up to `budget` tokens after a prefilled prompt.

    start: tokens with K/V in the target cache (the prompt); seq: the prompt, to which every
    emitted token is appended (proposers read it; its last token, `cur`, has no K/V yet, so the
    target holds len(seq) - 1 rows). The proposers must have begun this generation.
    seed: the request's seed; a sampled token at position t is the target's choice keyed by
    (seed, t) (runtime/choice.py), so the tokens do not depend on the planner."""
    length, emitted = start, 0
    try:
        cur = first_token(first_logits, params, seed, len(seq), ws)
        seq.append(cur)
        emitted = metrics.tokens = 1
        yield Emitted(cur, False)
        while emitted < budget:
            room = min(ws.k, budget - emitted - 1)     # a round emits up to room + 1 tokens
            plan = planner.next(seq, room)
            kind = plan.kind
            t0 = time.perf_counter()
            if kind is RoundKind.PLAIN:
                proposal = EMPTY
                trace.push("decode")
                verdict = accept(target_pass(target, "decode", cur, EMPTY, length, params, ws), EMPTY, params, seed,
                                 len(seq), ws)
                trace.pop()
                metrics.time_verify += time.perf_counter() - t0
                metrics.plain_steps += planner.adaptive
            else:
                trace.push("draft")
                proposal = plan.ready if plan.ready is not None else plan.proposer.propose(seq, plan.k)
                trace.pop()
                t1 = time.perf_counter()
                trace.push("verify")
                logits = target_pass(target, kind.graph, cur, proposal, length, params, ws)
                trace.pop()
                t2 = time.perf_counter()
                trace.push("accept")
                verdict = accept(logits, proposal, params, seed, len(seq), ws)
                trace.pop()
                t3 = time.perf_counter()
                plan.proposer.stats.record(len(proposal), verdict.n_accepted)
                plan.proposer.accept(verdict.n_accepted)
                metrics.time_draft += t1 - t0
                metrics.time_verify += t2 - t1
                metrics.time_accept += t3 - t2
                metrics.pair_rounds += kind is RoundKind.PAIR
                metrics.lookup_rounds += kind is RoundKind.LOOKUP and planner.adaptive
            metrics.record_iteration(plan.k, verdict.n_accepted)
            planner.observe(kind, plan.k, verdict.n_accepted)
            for j in range(verdict.n_accepted):
                tok = int(proposal.tokens[j])
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
        for p in planner.proposers:
            p.end(committed)
