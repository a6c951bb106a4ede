"""Per-call metrics, named as the field names them (vLLM):

acceptance rate        = accepted / drafted
mean acceptance length = tokens emitted per iteration = 1 + accepted / iterations
acceptance per position: of the iterations that drafted position j, the share accepted
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Metrics:
    method: str = "speculative"
    k: int = 0
    prompt_tokens: int = 0
    tokens: int = 0                 # emitted (generated) tokens
    iterations: int = 0             # target passes after the prompt
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)    # [k]
    accepted_at: list[int] = field(default_factory=list)   # [k]
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0        # target passes (verify, or decode for plain)
    plain_steps: int = 0            # rounds that were a plain decode step (no proposal)
    lookup_rounds: int = 0          # rounds that verified prompt lookup's guess, not a draft's
    pair_rounds: int = 0            # rounds that verified one guessed token in the decode graph's second row
    time_accept: float = 0.0
    time_total: float = 0.0
    finish_reason: str | None = None

    def __post_init__(self):
        self.drafted_at = [0] * self.k
        self.accepted_at = [0] * self.k

    def record_iteration(self, drafted: int, accepted: int) -> None:
        self.iterations += 1
        self.drafted += drafted
        self.accepted += accepted
        for j in range(drafted):
            self.drafted_at[j] += 1
            if j < accepted:
                self.accepted_at[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.iterations if self.iterations else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def time_other(self) -> float:
        return max(0.0, self.time_total - self.time_prefill - self.time_draft - self.time_verify - self.time_accept)

    @property
    def decode_tokens_per_s(self) -> float:
        t = self.time_total - self.time_prefill
        return self.tokens / t if t > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "method": self.method, "k": self.k, "prompt_tokens": self.prompt_tokens, "tokens": self.tokens,
            "iterations": self.iterations, "plain_steps": self.plain_steps, "lookup_rounds": self.lookup_rounds, "pair_rounds": self.pair_rounds, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 3),
            "acceptance_per_position": [round(x, 3) for x in self.acceptance_per_position],
            "tokens_per_s": round(self.decode_tokens_per_s, 2),
            "time_s": {k: round(v, 4) for k, v in (
                ("prefill", self.time_prefill), ("draft", self.time_draft), ("verify", self.time_verify),
                ("accept", self.time_accept), ("other", self.time_other), ("total", self.time_total))},
            "finish_reason": self.finish_reason,
        }

    def summary(self) -> str:
        s = f"{self.tokens} tokens in {self.time_total:.2f}s ({self.decode_tokens_per_s:.1f} tok/s decode)"
        if self.method == "speculative":
            s += (f"; k={self.k}, acceptance {self.acceptance_rate:.1%}, mean acceptance length "
                  f"{self.mean_acceptance_length:.2f}, per position "
                  + " ".join(f"{x:.2f}" for x in self.acceptance_per_position))
        s += (f"; time prefill {self.time_prefill:.2f}s draft {self.time_draft:.2f}s verify "
              f"{self.time_verify:.2f}s accept {self.time_accept:.2f}s other {self.time_other:.2f}s")
        return s + f"; finish: {self.finish_reason}"
