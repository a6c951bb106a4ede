"""Step costs and acceptance estimates: what the engine's policy (runtime/batch/policy.py) and
the build's plan (builder/gates/plan.py) weigh speculation with.

    E(a, k) = (1 - a^(k+1)) / (1 - a)      tokens a round of k proposals emits in expectation,
                                            under the usual i.i.d. acceptance model (Leviathan et
                                            al. 2023): accepted proposals plus the target's own
    StepCosts                               the one-row build's measured steps (decode, verify,
                                            one draft step) and the rate of a round of k drafts
    Acceptance                              a proposer's per-token acceptance: a Beta prior (the
                                            build's measured agreement) updated with geometric
                                            forgetting, so a stretch the proposer cannot predict
                                            moves the choice within a few rounds

Costs are the build's numbers; the engine corrects them with the times of its own passes
(runtime/batch/live_costs.py; SPECRT_LIVE_COSTS=0 turns that off). That is safe for
answers: a position's token is a function of its logits, the seed and the position alone
(runtime/choice.py), whichever rounds ran.
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


SHRINK = 2.0        # pseudo-rounds of the pooled mean in each position's estimate (Acceptance.at)


class Acceptance:
    """Beta(successes + prior, failures + 1 - prior) over per-token acceptance, the verdicts
    forgotten geometrically (`mean`; the prior's own pseudo-count of one is never forgotten),
    and per position of a round the acceptance of proposal j given that the ones before it
    were accepted (`at`), from which `expected` gives E(k). Acceptance is not i.i.d.
    along a round, so the pooled mean's geometric series misjudges rounds: on the fp32 folder's
    int8 self-draft (2026-12-06) the positions were at 0.98, 0.98, 0.97 while the pooled mean,
    pulled down by the rejections that end rounds, said 0.92-0.95 (E(3) 3.9 against 3.6), and
    the batch of one drafted 2 tokens a round where 3-4 paid; a draft that is right about a
    whole round or wrong at its first token is over-counted by it instead.

    The lasting pseudo-count sits at the prior (the build's agreement), not at 1/2: Beta(s + 1,
    f + 1) kept one success and one failure that were never forgotten, against the ~10 rounds
    of evidence that forgetting at 0.9 keeps, so it pulled a good draft's estimate toward 1/2,
    and the more so the shorter its rounds (a self-draft keeping 0.96 of its guesses in rounds
    of one read 0.88), so short rounds chose short rounds: the fp32 folder's batch of one
    estimated 0.89 where its draft kept 0.95-0.97 at every position, and fixed rounds of 4 beat
    its choices by x1.03 (2026-12-06)."""

    def __init__(self, prior: float, weight: float, forget: float):
        prior = min(max(prior, 0.05), 0.95)     # a build's agreement can be 0 or 1 on few prompts
        self.successes, self.failures, self.forget = prior * weight, (1.0 - prior) * weight, forget
        self.prior = prior
        self._at: list[list[float]] = []       # [position] -> [successes, failures] seen there

    @property
    def mean(self) -> float:
        return (self.successes + self.prior) / (self.successes + self.failures + 1.0)

    def at(self, j: int) -> float:
        """Acceptance of proposal j (0-based) given that proposals 0..j-1 were accepted: what was
        seen at position j, shrunk toward the pooled `mean` with SHRINK pseudo-rounds (a
        position no round has reached yet has the pooled mean, so rounds of k never make k + 1
        look worse than the evidence says)."""
        s, f = self._at[j] if j < len(self._at) else (0.0, 0.0)
        return (s + SHRINK * self.mean) / (s + f + SHRINK)

    def expected(self, k: int) -> float:
        """Tokens a round of k proposals emits in expectation: 1 + sum_j prod_{i<=j} at(i)."""
        return self.expected_upto(k)[k]

    def expected_upto(self, k: int) -> list[float]:
        """[E(0), E(1), ..., E(k)] in one pass (the policy weighs every k each step)."""
        out, e, p = [1.0], 1.0, 1.0
        for j in range(k):
            p *= self.at(j)
            e += p
            out.append(e)
        return out

    def start(self, weight: float, forget: float) -> "Acceptance":
        """A new estimate that begins where this one is: its evidence (pooled and per position)
        scaled down to at most `weight` rounds' worth, so the new one's own verdicts soon
        outweigh it; the same lasting prior. What a row starts from (BatchPolicy.row_accept)."""
        new = Acceptance(self.prior, 0.0, forget)
        total = self.successes + self.failures
        c = min(1.0, weight / total) if total > 0 else 1.0
        new.successes, new.failures = self.successes * c, self.failures * c
        new._at = [[s * c, f * c] for s, f in self._at]
        return new

    def observe(self, k: int, accepted: int) -> None:
        # the first rejection ends the round: `accepted` successes, then one failure if any
        self.successes = self.forget * self.successes + accepted
        self.failures = self.forget * self.failures + (1 if accepted < k else 0)
        # positions 0..accepted were tried (the last one failed unless all k were accepted); every
        # position's evidence is forgotten at each round, so one that shorter rounds no longer
        # reach drifts back to the pooled mean instead of keeping an old verdict for good
        tried = min(accepted + 1, k)
        while len(self._at) < tried:
            self._at.append([0.0, 0.0])
        for j, sf in enumerate(self._at):
            sf[0] = self.forget * sf[0] + (j < tried and j < accepted)
            sf[1] = self.forget * sf[1] + (j < tried and j == accepted)
