"""Adaptive draft length, with a fallback to plain decoding when speculation stops paying.

Each round the loop asks `AdaptiveK.choose()` for k: k >= 1 drafts k tokens and verifies
them in one target pass; k = 0 is one plain decode step. The choice maximises expected
tokens per unit of time under the usual i.i.d. acceptance model (Leviathan et al. 2023):

    rate(k) = E(a, k) / (k * t_draft + t_verify)      E(a, k) = (1 - a^(k+1)) / (1 - a)
    rate(0) = 1 / t_decode

with the step costs measured when the engines were built (manifest
`build.speculation.costs_ms`) and `a`, the per-token acceptance, estimated from the
verdicts of this generation: a Beta prior (the build's measured agreement) updated with
exponential forgetting, so a stretch of text the draft cannot predict moves the choice
within a few rounds. The verify graph has a static window, so a shorter k still pays
for the full window; the formula uses that measured cost.

After falling back to plain decoding the policy gathers no new evidence, so it probes:
after `cooldown` plain steps it runs one speculative round at its best k, whose verdict
updates `a`. Likewise a lookup guess passed over `lookup_cooldown` times is tried once:
matches come in runs (a passage quoted from the prompt), so one failed guess says little
about the next.

Prompt lookup (runtime/proposers.py) as a second proposer: when the last n tokens occurred
earlier, their continuation is a free guess; a lookup round costs one verify pass and no
draft steps, so it wins whenever E(a_lookup, g) / t_verify beats the draft's rate and
plain decoding's (a_lookup estimated apart from the draft's). This is what makes
speculation pay on a target too fast for any model draft (an int4 target on a CPU).

Why the costs are fixed numbers from the build, not timed online: the choice of k
decides how many random draws a round consumes, so choices that depended on wall-clock
time would make seeded sampling differ from run to run. With fixed costs the choices are
a function of the verdicts alone, and a seed reproduces its output. Choosing k from past
verdicts keeps the accept rule exact (k is fixed before the round's draws) and greedy
output identical to plain decoding.
"""
from __future__ import annotations

from dataclasses import dataclass


def expected_tokens(a: float, k: int) -> float:
    """Tokens one round emits in expectation: accepted draft tokens plus the target's one."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(frozen=True)
class StepCosts:
    """Seconds (or any one unit) per step: the target's one-token graph, its verify pass
    (window k_max + 1) and one draft step."""
    decode: float
    verify: float
    draft: float

    def __post_init__(self):
        for name in ("decode", "verify", "draft"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"step cost {name}={v!r} must be a positive number")

    @classmethod
    def from_manifest(cls, speculation: dict | None) -> "StepCosts | None":
        """The build's measured costs (`build.speculation.costs_ms`), or None when absent."""
        c = (speculation or {}).get("costs_ms") or {}
        try:
            return cls(decode=float(c["target_decode"]), verify=float(c["target_verify"]),
                       draft=float(c["draft_decode"]))
        except (KeyError, TypeError, ValueError):
            return None

    def rate(self, a: float, k: int) -> float:
        """Expected tokens per unit time of a round with k drafts (k = 0: a plain step)."""
        if k == 0:
            return 1.0 / self.decode
        return expected_tokens(a, k) / (k * self.draft + self.verify)

    def best_k(self, a: float, k_max: int, *, allow_plain: bool = True) -> int:
        ks = range(0 if allow_plain else 1, k_max + 1)
        return max(ks, key=lambda k: (self.rate(a, k), -k))   # ties: the shorter round

    def predicted_speedup(self, a: float, k: int) -> float:
        """Over plain decoding, for a fixed k (the bench's `pred` column)."""
        return self.rate(a, k) * self.decode


class _Acceptance:
    """Beta(successes + 1, failures + 1) over per-token acceptance, forgotten geometrically."""

    def __init__(self, prior: float, weight: float, forget: float):
        prior = min(max(prior, 0.05), 0.95)     # a build's agreement can be 0 or 1 on few prompts
        self.successes, self.failures, self.forget = prior * weight, (1.0 - prior) * weight, forget

    @property
    def mean(self) -> float:
        return (self.successes + 1.0) / (self.successes + self.failures + 2.0)

    def observe(self, k: int, accepted: int) -> None:
        # the first rejection ends the round: `accepted` successes, then one failure if any
        self.successes = self.forget * self.successes + accepted
        self.failures = self.forget * self.failures + (1 if accepted < k else 0)


class AdaptiveK:
    """The per-generation policy: choose() -> (how, k) for the next round, observe() after
    it. how: "plain" (k = 0, one decode step), "draft" (k draft tokens) or "lookup" (the
    first k tokens of prompt lookup's guess: free to propose, so a round costs one verify
    pass). Draft and lookup proposals keep separate acceptance estimates. Deterministic:
    a function of the verdicts seen (see the module docstring)."""

    def __init__(self, costs: StepCosts, k_max: int, *, prior: float = 0.8, prior_weight: float = 4.0,
                 forget: float = 0.9, cooldown: int = 16, lookup_prior: float = 0.5, lookup_cooldown: int = 4):
        if k_max < 1:
            raise ValueError(f"k_max={k_max} must be >= 1")
        self.costs, self.k_max, self.cooldown = costs, k_max, cooldown
        self.draft = _Acceptance(prior, prior_weight, forget)
        self.lookup = _Acceptance(lookup_prior, prior_weight, forget)
        self.plain_run = 0          # plain steps since the last draft round
        self.lookup_cooldown = lookup_cooldown
        self.lookup_refused = 0     # lookup guesses passed over since the last lookup round
        self.rounds = {"plain": 0, "draft": 0, "lookup": 0, "probe": 0}

    @property
    def acceptance(self) -> float:
        return self.draft.mean

    def choose(self, budget_k: int | None = None, lookup_len: int = 0) -> tuple[str, int]:
        """The next round, with at most budget_k proposed tokens (the tokens still allowed
        minus one) and a lookup guess of lookup_len tokens available (0: none)."""
        cap = self.k_max if budget_k is None else min(self.k_max, budget_k)
        if cap < 1:
            return "plain", 0
        c = self.costs
        k = c.best_k(self.draft.mean, cap)
        best = ("draft", k, c.rate(self.draft.mean, k)) if k else ("plain", 0, c.rate(0.0, 0))
        g = min(lookup_len, cap)
        if g:   # a lookup round: E(a_lookup, g) tokens for one verify pass, nothing to draft
            rate = expected_tokens(self.lookup.mean, g) / c.verify
            if rate > best[2] or self.lookup_refused >= self.lookup_cooldown:
                if rate <= best[2]:
                    self.rounds["probe"] += 1    # matches come in runs (quoted text): look again
                self.lookup_refused = 0
                return "lookup", g
            self.lookup_refused += 1
        if best[0] == "plain" and self.plain_run >= self.cooldown:
            self.rounds["probe"] += 1
            return "draft", c.best_k(self.draft.mean, cap, allow_plain=False)
        return best[0], best[1]

    def observe(self, how: str, k: int, accepted: int) -> None:
        """The verdict of a round: k tokens proposed by `how`, `accepted` of them kept."""
        self.rounds[how] += 1
        if how == "plain":
            self.plain_run += 1    # no evidence about the draft
        elif how == "draft":
            self.plain_run = 0
            self.draft.observe(k, accepted)
        else:
            self.lookup.observe(k, accepted)
