"""The speculation plan a build records: each graph's measured step cost, the predicted
speedup of every draft length, and the choice (manifest `build.speculation`).

    costs_ms      target_decode, target_verify (window k+1), draft_decode: median of
                  interleaved timed runs at `context` tokens of cache, on the build's pool
    acceptance    the draft's top-1 agreement with the target (calibration.measure),
                  used as the per-token acceptance a of greedy decoding
    predicted     {"k=1": x, ...}: E(a, k) * t_decode / (k * t_draft + t_verify), the
                  verify pass's cost being the built window's for every k (a static
                  graph runs shorter windows padded)
    chosen        the k with the best prediction, or "plain" when none beats 1.0

The runtime's adaptive policy (runtime/batch/policy.py) starts from these costs and this
acceptance and re-estimates the acceptance while it generates. Costs measured on the
build machine carry to a serving machine as ratios, which is all the choice uses; a build timed
on a busy machine records wrong ratios too (other work slows small steps more than wide ones):
`specrt retime FOLDER` measures them again where the folder serves (tools/retime.py).
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from specrt import manifest as mf
from specrt.driver import GraphSet


def step_costs(target_dir: Path, target: dict, draft_dir: Path | None, draft: dict | None, shapes: mf.Shapes, *,
               context: int = 128, runs: int = 15, warmup: int = 3) -> dict:
    """Median milliseconds per step of the target's decode and verify graphs and the draft's
    decode graph, timed in turn (interleaved, so a load change hits all three alike)."""
    context = min(context, shapes.max_context - shapes.k - 1)
    t = GraphSet(target_dir, {g: target["graphs"][g] for g in ("decode", "verify")}, target["dims"],
                 shapes.kv_capacity)
    steps = {"target_decode": lambda: t.model.step("decode", [1], context),
             "target_verify": lambda: t.model.step("verify", [1] * (shapes.k + 1), context)}
    if draft is not None:
        d = GraphSet(draft_dir, {"decode": draft["graphs"]["decode"]}, draft["dims"], shapes.kv_capacity)
        steps["draft_decode"] = lambda: d.model.step("decode", [1], context)
    out = interleaved_ms(steps, runs=runs, warmup=warmup)
    out["context"] = context
    out["runs"] = runs
    return out


def interleaved_ms(steps: dict, *, runs: int, warmup: int) -> dict:
    """name -> median milliseconds of calling steps[name](), the steps timed in turn
    (interleaved, so a load change hits them all alike) after `warmup` untimed rounds."""
    times: dict = {name: [] for name in steps}
    for r in range(warmup + runs):
        for name, run in steps.items():
            t0 = time.perf_counter()
            run()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: round(statistics.median(v) * 1e3, 4) for name, v in times.items()}


def draft_acceptance(draft: dict | None) -> float | None:
    """The acceptance the plan assumes: the draft's top-1 agreement with the target (its parity
    record). A trimmed draft head never proposes a token outside its kept ids: the prompts the
    agreement was measured on hold few of those, so it is scaled by the held-out coverage
    (docs/speculation.md)."""
    agreement = (((draft or {}).get("parity") or {}).get("agreement_with_target") or {}).get("top1_agreement")
    coverage = ((((draft or {}).get("source") or {}).get("quantization") or {}).get("draft_vocab") or {}).get(
        "held_out_coverage")
    if agreement is not None and coverage:
        agreement *= float(coverage)
    return agreement


def plan(costs_ms: dict, acceptance: float | None, k_max: int) -> dict:
    """Predicted speedup over plain decoding for each k in 1..k_max, and the best choice."""
    from specrt.runtime.costs import StepCosts
    out = {"costs_ms": costs_ms, "acceptance": acceptance, "k_max": k_max}
    if acceptance is None or "draft_decode" not in costs_ms:
        return {**out, "predicted": {}, "chosen": {"method": "plain", "k": 0, "predicted_speedup": 1.0}}
    c = StepCosts(decode=costs_ms["target_decode"], verify=costs_ms["target_verify"], draft=costs_ms["draft_decode"])
    predicted = {f"k={k}": round(c.predicted_speedup(acceptance, k), 3) for k in range(1, k_max + 1)}
    best = c.best_k(acceptance, k_max)
    chosen = {"method": "speculative", "k": best, "predicted_speedup": predicted[f"k={best}"]} if best else \
        {"method": "plain", "k": 0, "predicted_speedup": 1.0}
    return {**out, "predicted": predicted, "chosen": chosen,
            "formula": "E(a,k) * t_decode / (k * t_draft + t_verify), E(a,k) = (1 - a^(k+1)) / (1 - a)"}
