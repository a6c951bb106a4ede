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


def one_guess(seq: Sequence[int], guess: Sequence[int] = (), table=None) -> int | None:
    """One guessed next token for a pair round: the first token of prompt lookup's guess,
    else the token that followed the latest earlier occurrence of the last token (a 1-gram
    match), else the target's own n-gram table (runtime/ngrams.py) when the engines ship
    one; None when none of them has a guess."""
    if guess:
        return int(guess[0])
    if len(seq) >= 2:
        try:
            at = len(seq) - 2 - list(seq[-2::-1]).index(seq[-1])   # latest earlier occurrence (C-speed scan)
            return int(seq[at + 1])
        except ValueError:
            pass
    return table.guess(seq) if table is not None else None


@dataclass(frozen=True)
class LookupStats:
    tokens: int              # tokens emitted
    rounds: int              # target passes
    proposal_rounds: int     # passes that verified a proposal (T = k+1); the others are decode steps (T = 1)
    pair_rounds: int = 0     # decode steps that also verified one guessed token (a two-row decode graph)

    @property
    def tokens_per_round(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0


def simulate_lookup(prompt: Sequence[int], output: Sequence[int], n: int, k: int, *, pair: bool = False,
                    table=None) -> LookupStats:
    """Replay a greedy `output` (the target's own) as prompt lookup would have produced it:
    each round proposes from prompt + output so far, accepts the agreeing prefix and
    emits one more token from the target (recovered or bonus). pair/table: as in
    lookup_decode (a guess shorter than two tokens becomes a pair round's one guess)."""
    seq, pos, rounds, proposed, paired = list(prompt) + [output[0]], 1, 0, 0, 0   # output[0]: the prefill's
    while pos < len(output):
        room = min(k, len(output) - pos - 1)
        guess = lookup(seq, n, room) if room > 0 else []
        is_pair = pair and room > 0 and len(guess) < 2
        if is_pair:
            one = one_guess(seq, guess, table)
            guess = [one] if one is not None else []
            paired += bool(guess)
        accepted = 0
        while accepted < len(guess) and guess[accepted] == output[pos + accepted]:
            accepted += 1
        step = accepted + 1
        seq.extend(output[pos:pos + step])
        pos += step
        rounds += 1
        proposed += bool(guess) and not is_pair
    return LookupStats(tokens=len(output) - 1, rounds=rounds, proposal_rounds=proposed, pair_rounds=paired)


def predicted_lookup_speedup(stats: Sequence[LookupStats], t_decode: float, t_verify: float) -> float:
    """Plain time / lookup time for the same tokens: a round with a proposal costs one
    verify pass, a round without one (or a pair round) a decode step."""
    tokens = sum(s.tokens for s in stats)
    with_p = sum(s.proposal_rounds for s in stats)
    without = sum(s.rounds - s.proposal_rounds for s in stats)
    cost = with_p * t_verify + without * t_decode
    return tokens * t_decode / cost if cost else 0.0


def lookup_decode(target, first_logits, start: int, budget: int, metrics, *, seq: list[int], n: int, k: int,
                  choices=None, pair: bool = False, table=None):
    """Greedy decoding with prompt lookup as the proposer (no draft model): a round with a
    match verifies [cur, guess...] in one target pass and keeps the agreeing prefix plus
    the target's next token; a round without one is a plain decode step. Yields
    `Emitted` like the loops in loop.py and leaves the cache at the emitted length.

    Identical to plain greedy decoding wherever the verify rows pick what the decode graph
    picks (recorded at build time in parity.identity).
    seq: the prompt; emitted tokens are appended (the lookup reads it). choices: an int64
    buffer of at least k+1 for the backend's argmax (allocated here if not given).
    pair: the decode graph runs two rows (calibration/rows.py): a round whose guess is
    shorter than two tokens verifies one guessed token (the guess, else a 1-gram match) in
    the decode graph's second row, for the cost of a plain step. table: the engines' n-gram
    table (runtime/ngrams.py), the pair rounds' last resort."""
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
            room = min(k, budget - emitted - 1)
            guess = lookup(seq, n, room)
            graph = "verify"
            if pair and room and len(guess) < 2:
                one = one_guess(seq, guess, table)
                guess, graph = ([one] if one is not None else []), "decode"
                metrics.pair_rounds += bool(guess)
            t0 = time.perf_counter()
            if guess:                    # the target's choices at [cur, guess...], from the backend
                target.argmax_step(graph, [cur, *guess], length, best[:len(guess) + 1])
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
