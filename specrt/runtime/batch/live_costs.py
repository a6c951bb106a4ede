"""The build's step-cost table corrected by the loop's own timings (runtime/batch/policy.py
BatchCosts.observe prices every shape with it): the build timed each shape once, for a few
seconds, on a machine that may have been busy, and the shape of its table decides which rounds
the single stream runs (two builds of the same graphs: x0.93 and x0.99 of the one-request loop,
2026-12-06). Choices only: a row's tokens never depend on it (runtime/choice.py)."""
from __future__ import annotations

import math
import os
import threading


def live_costs_default() -> bool:
    """Whether engines correct their cost table in the loop when not told (`live_costs=None`):
    yes, unless the environment says SPECRT_LIVE_COSTS=0 (the test suite does: choices
    reproducible, tests/conftest.py)."""
    v = os.environ.get("SPECRT_LIVE_COSTS", "1").strip().lower()
    if v in ("1", "true", "yes", "on", ""):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"SPECRT_LIVE_COSTS={v!r}: expected 1 (correct the build's step costs in the loop) or 0 "
                     "(price with the build's table alone)")


class LiveCorrection:
    """How far the loop's step times sit from the build's table: a factor per shape (a target
    pass of n rows x T tokens, a draft step of n rows), as log ratios observed / table.

    Each shape's factor is the machine's overall factor (all observations) times its own
    offset; a shape never observed takes the overall factor alone, so a machine that got
    uniformly slower moves every price together and the table's shape stands where the loop
    has no evidence against it. Both follow the running median (a sign step of `eta` toward
    each observation, in log space; Robbins and Monro's stochastic quantile estimate): a cold
    call, a page fault or a preempted thread moves an estimate one step, never by its size.
    Observations outside [1/16, 16] of the table (a suspended process) are dropped.

    What it cannot fix: a shape the table prices too high is never chosen, so never observed
    (the policy's probes try drafts, not windows)."""

    ETA_ALL = 0.02       # per observation of any shape: about 35 observations to move by x2
    ETA_SHAPE = 0.04     # per observation of the shape
    BOUND = math.log(16.0)

    def __init__(self):
        self.overall = 0.0                       # log factor of the machine now against the build
        self.offsets: dict[tuple, float] = {}    # shape -> log factor beyond the overall one
        self.counts: dict[tuple, int] = {}
        # the engine thread observes, the server's /metrics thread takes snapshots: copying a dict
        # while another thread adds keys can fail even in one C call (an allocation may run the
        # garbage collector, which runs Python code and lets the other thread in; seen in CI)
        self._lock = threading.Lock()

    def factor(self, shape: tuple) -> float:
        if not self.counts:
            return 1.0
        return math.exp(self.overall + self.offsets.get(shape, 0.0))

    def observe(self, shape: tuple, ratio: float) -> None:
        if not (isinstance(ratio, float) and math.isfinite(ratio) and ratio > 0):
            return
        x = math.log(ratio)
        if abs(x) > self.BOUND:
            return
        with self._lock:
            off = self.offsets.get(shape, 0.0)
            est = self.overall + off
            self.offsets[shape] = off + self.ETA_SHAPE * _sign(x - est)
            self.overall += self.ETA_ALL * _sign(x - self.overall)
            self.counts[shape] = self.counts.get(shape, 0) + 1

    def snapshot(self) -> dict:
        """{"overall": factor, "shapes": {shape: (factor, observations)}}: what the server's
        /metrics (specrt_step_cost_factor) and the benchmarks show."""
        with self._lock:
            counts, offsets, overall = dict(self.counts), dict(self.offsets), self.overall
        return {"overall": math.exp(overall),
                "shapes": {k: (math.exp(overall + offsets[k]), c) for k, c in counts.items()}}


def _sign(x: float) -> float:
    return (x > 0) - (x < 0)
