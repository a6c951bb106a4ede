"""One round of decoding: verify a proposal in one target pass and apply the accept rule.

Glossary (vLLM's): a proposer suggests k *draft* tokens; the target's pass over
[cur, draft...] gives k+1 distributions; the longest prefix that passes the accept rule
is *accepted*; at the first rejection the target's own choice there is the *recovered*
token; if all k pass, a *bonus* token comes from the last row. The accept rule is
runtime/choice.py's, the batched engine's too. So every round emits between 1
and k+1 tokens, and the target runs exactly once per round.

The kinds of round (RoundKind), all the same skeleton (runtime/loop.py):

    PLAIN   k = 0: one step of the target's decode graph (plain autoregressive decoding)
    DRAFT   a draft model's k tokens, verified by the verify graph (T = k_max + 1)
    LOOKUP  a free guess of k tokens (prompt lookup), verified by the verify graph
    PAIR    one guessed token in the second row of a two-row decode graph (a quantized
            target's, builder/gates/rows.py): a verify pass for the price of a plain step

Allocation: `Workspace` holds every target-side buffer, made once for (k_max, vocab).
"""
from __future__ import annotations

from enum import Enum
from typing import Sequence

import numpy as np

from specrt.runtime import nvtx_ranges as trace
from specrt.runtime.backends.base import ModelRunner
from specrt.runtime.proposers.base import Proposal
from specrt.runtime.choice import choose, first_mismatch
from specrt.runtime.sampling import SamplingParams, Verdict, verify_greedy


class RoundKind(str, Enum):
    PLAIN = "plain"
    DRAFT = "draft"
    LOOKUP = "lookup"
    PAIR = "pair"

    @property
    def graph(self) -> str:
        """The target graph the round runs: the decode graph for a plain step or a pair round,
        the verify graph for a proposal of up to k_max tokens."""
        return "decode" if self in (RoundKind.PLAIN, RoundKind.PAIR) else "verify"


class Workspace:
    """Every target-side buffer a round touches, allocated once for (k, vocab)."""

    def __init__(self, k: int, vocab: int):
        self.k = k
        self.scratch = np.zeros(vocab, np.float32)           # [V] one warped row at a time
        self.argmax = np.zeros(k + 1, np.int64)              # [k+1] the target's greedy choices
        self.verify_tokens = [0] * (k + 1)                   # the window [cur, x1..xk]


def prefill(model: ModelRunner, graph_tokens: int, prompt: Sequence[int]) -> np.ndarray:
    """Feed the prompt in static chunks; returns the logits row of its last token."""
    last = None
    trace.push("prefill")
    for start in range(0, len(prompt), graph_tokens):
        chunk = prompt[start:start + graph_tokens]
        last = model.step("prefill", chunk, start)[len(chunk) - 1]
    trace.pop()
    model.cache.rewind_to(len(prompt))
    return last


def first_token(logits_row: np.ndarray, params: SamplingParams, seed: int, position: int, ws: Workspace) -> int:
    """The token after the prompt (at `position`, the prompt's length), from the prefill's last row."""
    return choose(logits_row, params, seed, position, ws.scratch)


def target_pass(target: ModelRunner, graph: str, cur: int, proposal: Proposal, length: int,
                params: SamplingParams, ws: Workspace):
    """Run the target once over [cur, proposal...] at rows length..length+k. Greedy: each row's
    argmax into ws.argmax[:k+1] (a device backend reads back k+1 integers), returns None.
    Sampled: returns the logits rows [k+1, V] (a reused buffer)."""
    k = len(proposal)
    vt = ws.verify_tokens
    vt[0] = cur
    for j in range(k):
        vt[j + 1] = int(proposal.tokens[j])
    window = vt[:k + 1] if k < ws.k else vt
    if params.greedy:
        target.argmax_step(graph, window, length, ws.argmax[:k + 1])
        return None
    return target.step(graph, window, length)


def accept(logits, proposal: Proposal, params: SamplingParams, seed: int, position: int, ws: Workspace) -> Verdict:
    """The accept rule on a target pass's result (runtime/choice.py): the longest prefix equal
    to the target's choices, then its choice at the first difference. Greedy: the argmax rows
    the pass read back; sampled: the rows' race keyed by (seed, position of x1 + j)."""
    k = len(proposal)
    if params.greedy:
        return verify_greedy(ws.argmax[:k + 1], proposal.tokens)
    n, nxt = first_mismatch(logits, proposal.tokens, params, seed, position, ws.scratch)
    return Verdict(n_accepted=n, next_token=nxt, bonus=n == k)
