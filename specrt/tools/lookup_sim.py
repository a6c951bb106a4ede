"""What prompt lookup would achieve on known greedy outputs, before any loop runs it.

`simulate_lookup` replays a greedy output (the target's own) through the engine's fixed-round
policy for `method="lookup"` (runtime/batch/policy.py, `fixed`): each round proposes from the
prompt and the output so far, keeps the agreeing prefix and emits one more token (the
target's). With measured step costs, `predicted_lookup_speedup` turns the rounds into a
speedup (`specrt bench`'s lookup prediction).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from specrt.runtime.batch.policy import BatchPolicy, RoundKind
from specrt.runtime.proposers import Chain, OneGram, PromptLookup, TableGuess


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
    """pair: the target's decode graph has two rows (a guess shorter than two tokens becomes a
    pair round's one guess: lookup's, else the 1-gram match, else `table`'s)."""
    chain = Chain([OneGram()] + ([TableGuess(table)] if table is not None else [])) if pair else None
    policy = BatchPolicy(None, k, lookup=PromptLookup(n, k), pair_guess=chain, pair=pair, fixed=True)

    def graph_t(graph: str, want: int, rows: int) -> int:
        return (2 if pair else 1) if graph == "decode" else k + 1

    seq, pos = list(prompt) + [output[0]], 1     # output[0]: the prefill's token
    rounds = proposed = paired = 0
    while pos < len(output):
        plan = policy.choose([_Row(seq, len(output) - pos)], graph_t)
        guess = plan.proposals[0]
        accepted = 0
        while accepted < len(guess) and guess[accepted] == output[pos + accepted]:
            accepted += 1
        seq.extend(output[pos:pos + accepted + 1])
        pos += accepted + 1
        rounds += 1
        proposed += plan.kind is RoundKind.LOOKUP
        paired += plan.kind is RoundKind.PAIR
    return LookupStats(tokens=len(output) - 1, rounds=rounds, proposal_rounds=proposed, pair_rounds=paired)


class _Row:
    """What the policy reads of a row: its tokens and its room (tokens it may still emit)."""

    def __init__(self, seq: list[int], left: int):
        self.seq, self.room = seq, left - 1     # a round emits up to room + 1 tokens


def predicted_lookup_speedup(stats: Sequence[LookupStats], t_decode: float, t_verify: float) -> float:
    """Plain time / lookup time for the same tokens: a round with a proposal costs one
    verify pass, a round without one (or a pair round) a decode step."""
    tokens = sum(s.tokens for s in stats)
    with_p = sum(s.proposal_rounds for s in stats)
    without = sum(s.rounds - s.proposal_rounds for s in stats)
    cost = with_p * t_verify + without * t_decode
    return tokens * t_decode / cost if cost else 0.0
