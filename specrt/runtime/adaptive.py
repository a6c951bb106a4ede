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
updates `a`; a probe after which the draft still does not pay doubles the wait (up to
`max_cooldown`), and the draft paying again resets it, so a draft that never pays (an int4
target's int8 self-draft costs more than a target step) costs fewer and fewer probes. Likewise a lookup guess passed over `lookup_cooldown` times is tried once:
matches come in runs (a passage quoted from the prompt), so one failed guess says little
about the next.

Prompt lookup (runtime/proposers.py) as a second proposer: when the last n tokens occurred
earlier, their continuation is a free guess; a lookup round costs one verify pass and no
draft steps, so it wins whenever E(a_lookup, g) / t_verify beats the draft's rate and
plain decoding's (a_lookup estimated apart from the draft's). This is what makes
speculation pay on a target too fast for any model draft (an int4 target on a CPU).

Pair rounds (a target whose decode graph runs two rows, as a quantized target's does, see
builder/gates/rows.py): a plain step already pays for a second row, so one guessed token
(prompt lookup's first, or its 1-gram match) rides in it for free:

    rate(pair) = (1 + a_pair) / t_decode  >=  rate(0)

so whenever a guess exists and the best choice would be a plain step, the round is a pair
round; it also competes with draft and lookup rounds on rate (a_pair estimated apart).

Why the costs are fixed numbers from the build, not timed online: the choice of k
decides how many random draws a round consumes, so choices that depended on wall-clock
time would make seeded sampling differ from run to run. With fixed costs the choices are
a function of the verdicts alone, and a seed reproduces its output. Choosing k from past
verdicts keeps the accept rule exact (k is fixed before the round's draws) and greedy
output identical to plain decoding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from specrt.errors import ManifestError

REBUILD = "the manifest was edited; rebuild the engines with this specrt (`specrt build` measures the step costs)"


def positive_cost(v) -> bool:
    """A step cost as a build writes it: a finite number above 0 (a bool is not a number)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def manifest_cost(v, field: str, fix: str = REBUILD) -> float:
    """The cost at manifest field `field`, refused (ManifestError, saying `fix`) unless positive_cost."""
    if not positive_cost(v):
        raise ManifestError(f"{field}={v!r}: a step cost is a positive number of milliseconds; {fix}")
    return float(v)


def speculation_entry(speculation, key: str, fix: str = REBUILD) -> dict | None:
    """build.speculation[key]: None when absent, a dict, or refused (ManifestError, saying `fix`)."""
    if speculation is None:
        return None
    if not isinstance(speculation, dict):
        raise ManifestError(f"build.speculation={speculation!r} is not an object; {fix}")
    c = speculation.get(key)
    if c is not None and not isinstance(c, dict):
        raise ManifestError(f"build.speculation.{key}={c!r} is not an object; {fix}")
    return c


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
            if not positive_cost(v):
                raise ValueError(f"step cost {name}={v!r} must be a positive finite number")

    @classmethod
    def from_manifest(cls, speculation: dict | None) -> "StepCosts | None":
        """The build's measured costs (`build.speculation.costs_ms`), or None when absent or
        without a draft (a build without one times the target alone). A damaged value is
        refused here, when the engines are opened (ManifestError), not in the decode loop."""
        c = speculation_entry(speculation, "costs_ms") or {}
        where = "build.speculation.costs_ms"
        names = ("target_decode", "target_verify", "draft_decode")
        got = {k: manifest_cost(c[k], f"{where}.{k}") for k in names if k in c}
        if "draft_decode" not in got:
            return None
        missing = [k for k in names if k not in got]
        if missing:
            raise ManifestError(f"{where} has draft_decode without {', '.join(missing)}; {REBUILD}")
        return cls(decode=got["target_decode"], verify=got["target_verify"], draft=got["draft_decode"])

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
    it. how: "plain" (k = 0, one decode step), "draft" (k draft tokens), "lookup" (the
    first k tokens of prompt lookup's guess: free to propose, so a round costs one verify
    pass) or "pair" (k = 1: one guessed token in the decode graph's second row, costing a
    plain step). Each proposer keeps its own acceptance estimate. Deterministic: a
    function of the verdicts seen (see the module docstring)."""

    def __init__(self, costs: StepCosts, k_max: int, *, prior: float = 0.8, prior_weight: float = 4.0,
                 forget: float = 0.9, cooldown: int = 16, lookup_prior: float = 0.5, lookup_cooldown: int = 4,
                 pair_prior: float = 0.3, max_cooldown: int = 256):
        if k_max < 1:
            raise ValueError(f"k_max={k_max} must be >= 1")
        self.costs, self.k_max, self.cooldown = costs, k_max, cooldown
        self.draft = _Acceptance(prior, prior_weight, forget)
        self.lookup = _Acceptance(lookup_prior, prior_weight, forget)
        self.pair = _Acceptance(pair_prior, prior_weight, forget)
        self.plain_run = 0          # plain (and pair) steps since the last draft round
        self.probe_gap, self.max_cooldown = cooldown, max_cooldown   # plain steps before the next probe
        self.lookup_cooldown = lookup_cooldown
        self.lookup_refused = 0     # lookup guesses passed over since the last lookup round
        self.rounds = {"plain": 0, "draft": 0, "lookup": 0, "pair": 0, "probe": 0}

    @property
    def acceptance(self) -> float:
        return self.draft.mean

    def choose(self, budget_k: int | None = None, lookup_len: int = 0, pair: bool = False,
               draft: bool = True) -> tuple[str, int]:
        """The next round, with at most budget_k proposed tokens (the tokens still allowed
        minus one), a lookup guess of lookup_len tokens available (0: none), a one-token
        guess for a pair round available (`pair`), and a draft model (`draft`)."""
        cap = self.k_max if budget_k is None else min(self.k_max, budget_k)
        if cap < 1:
            return "plain", 0
        c = self.costs
        k = c.best_k(self.draft.mean, cap) if draft else 0
        best = ("draft", k, c.rate(self.draft.mean, k)) if k else ("plain", 0, c.rate(0.0, 0))
        if pair:   # the decode graph's second row: 1 + a_pair tokens for the price of a plain step
            rate = expected_tokens(self.pair.mean, 1) / c.decode      # > a plain step's 1 / t_decode
            if rate > best[2]:
                best = ("pair", 1, rate)
        g = min(lookup_len, cap)
        if g:   # a lookup round: E(a_lookup, g) tokens for one verify pass, nothing to draft
            rate = expected_tokens(self.lookup.mean, g) / c.verify
            if rate > best[2] or self.lookup_refused >= self.lookup_cooldown:
                if rate <= best[2]:
                    self.rounds["probe"] += 1    # matches come in runs (quoted text): look again
                self.lookup_refused = 0
                return "lookup", g
            self.lookup_refused += 1
        if draft and best[0] in ("plain", "pair") and self.plain_run >= self.probe_gap:
            self.rounds["probe"] += 1
            return "draft", c.best_k(self.draft.mean, cap, allow_plain=False)
        return best[0], best[1]

    def observe(self, how: str, k: int, accepted: int) -> None:
        """The verdict of a round: k tokens proposed by `how`, `accepted` of them kept."""
        self.rounds[how] += 1
        if how in ("plain", "pair"):
            self.plain_run += 1    # no evidence about the draft
            if how == "pair":
                self.pair.observe(k, accepted)
        elif how == "draft":
            probe = self.plain_run >= self.probe_gap
            self.plain_run = 0
            self.draft.observe(k, accepted)
            pays = self.costs.best_k(self.draft.mean, self.k_max) > 0
            if pays:
                self.probe_gap = self.cooldown
            elif probe:               # probed and the draft still does not pay: wait longer next time
                self.probe_gap = min(2 * self.probe_gap, self.max_cooldown)
        else:
            self.lookup.observe(k, accepted)
