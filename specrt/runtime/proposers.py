"""Model-free proposers: prompt lookup (n-gram) for a target too fast for a model draft.

An int4 target has no cheaper copy of itself, so a model draft costs a large share of
a target step. Prompt lookup costs nothing: it proposes the continuation of the latest
earlier occurrence of the last n tokens, in the prompt and the text so far. Greedy
verification keeps the output the target's own; rounds without a match need only a
one-token step.

`simulate_lookup` replays greedy outputs to measure what the proposer would have
achieved (tokens per round, rounds with a proposal); with measured step costs it
predicts the speedup before any loop runs it (`predicted_lookup_speedup`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def lookup(seq: Sequence[int], n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of seq[-n:] (none: [])."""
    if len(seq) <= n:
        return []
    key = list(seq[-n:])
    for start in range(len(seq) - n - 1, -1, -1):       # latest match first, not the suffix itself
        if list(seq[start:start + n]) == key:
            return list(seq[start + n:start + n + k])
    return []


@dataclass(frozen=True)
class LookupStats:
    tokens: int              # tokens emitted
    rounds: int              # target passes
    proposal_rounds: int     # passes that verified a proposal (T = k+1); the others are decode steps (T = 1)

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0


def simulate_lookup(prompt: Sequence[int], output: Sequence[int], n: int, k: int) -> LookupStats:
    """Replay a greedy `output` (the target's own) as prompt lookup would have produced it:
    each round proposes from prompt + output so far, accepts the agreeing prefix and
    emits one more token from the target (recovered or bonus)."""
    seq, pos, rounds, proposed = list(prompt) + [output[0]], 1, 0, 0   # output[0] comes from the prefill
    while pos < len(output):
        guess = lookup(seq, n, min(k, len(output) - pos - 1)) if len(output) - pos > 1 else []
        accepted = 0
        while accepted < len(guess) and guess[accepted] == output[pos + accepted]:
            accepted += 1
        step = accepted + 1
        seq.extend(output[pos:pos + step])
        pos += step
        rounds += 1
        proposed += bool(guess)
    return LookupStats(tokens=len(output) - 1, rounds=rounds, proposal_rounds=proposed)


def predicted_lookup_speedup(stats: Sequence[LookupStats], t_decode: float, t_verify: float) -> float:
    """Plain time / lookup time for the same tokens: a round with a proposal costs one
    verify pass, a round without one a decode step."""
    tokens = sum(s.tokens for s in stats)
    with_p = sum(s.proposal_rounds for s in stats)
    without = sum(s.rounds - s.proposal_rounds for s in stats)
    cost = with_p * t_verify + without * t_decode
    return tokens * t_decode / cost if cost else 0.0


def lookup_decode(target, first_logits, start: int, budget: int, metrics, *, seq: list[int], n: int, k: int,
                  choices=None):
    """Greedy decoding with prompt lookup as the proposer (no draft model): a round with a
    match verifies [cur, guess...] in one target pass and keeps the agreeing prefix plus
    the target's next token; a round without one is a plain decode step. Yields
    `Emitted` like the loops in loop.py and leaves the cache at the emitted length.

    Identical to plain greedy decoding wherever the verify rows pick what the decode graph
    picks (recorded at build time in parity.identity).
    seq: the prompt; emitted tokens are appended (the lookup reads it). choices: an int64
    buffer of at least k+1 for the backend's argmax (allocated here if not given)."""
    import time

    import numpy as np

    from specrt.runtime.loop import Emitted

    length = start
    emitted = 0
    best = np.zeros(k + 1, np.int64) if choices is None else choices
    try:
        cur = int(np.argmax(first_logits))
        seq.append(cur)
        emitted = metrics.tokens = 1
        yield Emitted(cur, False)
        while emitted < budget:
            guess = lookup(seq, n, min(k, budget - emitted - 1))
            t0 = time.perf_counter()
            if guess:                    # the target's choices at [cur, guess...], from the backend
                target.argmax_step("verify", [cur, *guess], length, best[:len(guess) + 1])
                accepted = 0
                while accepted < len(guess) and best[accepted] == guess[accepted]:
                    accepted += 1
                nxt = int(best[accepted])
            else:
                target.argmax_step("decode", (cur,), length, best[:1])
                accepted, nxt = 0, int(best[0])
            metrics.time_verify += time.perf_counter() - t0
            metrics.record_iteration(len(guess), accepted)
            for tok in guess[:accepted]:
                seq.append(tok)
                length += 1
                emitted += 1
                metrics.tokens += 1
                yield Emitted(tok, True)
            cur = nxt
            seq.append(cur)
            length += 1
            emitted += 1
            metrics.tokens += 1
            yield Emitted(cur, False)
    finally:
        target.cache.rewind_to(start + max(emitted - 1, 0))
