"""The Q/DQ target against the fp32 one on ONNX Runtime CPU: teacher-forced parity on
held-out prompts (every graph's rows against the fp32 rows at the same positions) and
step times, fp32 and Q/DQ interleaved in one run. The numbers go into the manifest
(`models.target.parity.agreement_with_fp32`, `build.timing`)."""
from __future__ import annotations

import math
import time

import numpy as np

from specrt import manifest as mf
from specrt.calibration.qdq import GRAPHS
from specrt.driver import greedy
from specrt.errors import ParityError


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class _Tally:
    def __init__(self):
        self.n = self.agree = 0
        self.kl = self.delta = 0.0

    def add(self, got: np.ndarray, ref: np.ndarray) -> None:   # [n, V] each
        lp, lq = _log_softmax(ref.astype(np.float64)), _log_softmax(got.astype(np.float64))
        self.kl += float((np.exp(lp) * (lp - lq)).sum())
        self.agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        self.delta = max(self.delta, float(np.abs(got - ref).max()))
        self.n += len(ref)

    def result(self) -> dict:
        return {"positions": self.n, "top1_agreement": self.agree / max(self.n, 1),
                "mean_kl": self.kl / max(self.n, 1), "max_abs_logit_delta": self.delta}


def parity(ref_gs, q_gs, token_lists: list[list[int]], shapes: mf.Shapes,
           steps: int, graphs: tuple[str, ...] = GRAPHS) -> dict:
    """Teacher-forced on the fp32 greedy continuation of each held-out prompt: every row of
    each Q/DQ graph against the fp32 row at the same position (prompt rows: fp32 prefill;
    later rows: fp32 decode). The Q/DQ graphs build their own cache (prompt by prefill, or
    by decode steps when prefill is not among them)."""
    C, width = shapes.prefill_chunk, shapes.k + 1
    tally = {g: _Tally() for g in graphs}
    total = _Tally()
    for ids in token_lists:
        P = len(ids)
        for c in ref_gs.cache:
            c[...] = 0
        run = greedy(ref_gs, ids, steps + 1, keep_rows=True, keep_prompt_rows=True)
        seq = list(ids) + run.tokens
        # [P + steps, V]: positions 0 .. P+steps-1 (the prompt's rows, then the decode steps' rows)
        ref = np.concatenate([run.prompt_rows, *(r[None] for r in run.rows[1:])])
        for g in [g for g in ("prefill", "decode", "verify") if g in graphs]:
            for c in q_gs.cache:
                c[...] = 0
            got = ([q_gs.step("prefill", ids[lo:lo + C], lo) for lo in range(0, P, C)] if "prefill" in graphs
                   else [q_gs.step("decode", ids[i:i + 1], i) for i in range(P)])
            if g == "decode":
                got = [q_gs.step("decode", seq[P + j:P + j + 1], P + j) for j in range(steps)]
            elif g == "verify":
                got = [q_gs.step("verify", seq[lo:min(lo + width, P + steps)], lo)
                       for lo in range(P, P + steps, width)]
            got = np.concatenate(got)
            want = ref[:P] if g == "prefill" else ref[P:]
            tally[g].add(got, want)
            total.add(got, want)
    return {"graphs": {g: t.result() for g, t in tally.items()}, "all": total.result(),
            "prompts": len(token_lists), "new_tokens_per_prompt": steps,
            "how": "teacher-forced on the fp32 greedy continuation of held-out prompts; KL(fp32 || Q/DQ) per row"}


def step_times(ref_gs, q_gs, shapes: mf.Shapes, threads: int, reps: int = 20,
               graphs: tuple[str, ...] = GRAPHS) -> dict:
    """Median ms per step of each graph, fp32 and Q/DQ interleaved in one run, full windows."""
    out = {}
    for g in graphs:
        T = ref_gs.tokens[g]
        start = 0 if g == "prefill" else min(shapes.prefill_chunk, shapes.max_context - T)
        ids = [5] * T
        times = {"fp32": [], "qdq": []}
        for r in range(reps + 2):
            for name, gs in (("fp32", ref_gs), ("qdq", q_gs)):
                t0 = time.perf_counter()
                gs.step(g, ids, start)
                if r >= 2:                                       # two warm-up rounds
                    times[name].append(time.perf_counter() - t0)
        f, q = (float(np.median(times[k])) * 1e3 for k in ("fp32", "qdq"))
        out[g] = {"fp32_ms": f, "qdq_ms": q, "qdq_over_fp32": q / f, "tokens": T}
    return {"graphs": out, "reps": reps, "threads": threads, "backend": "onnxruntime CPUExecutionProvider"}


def check_finite(par: dict) -> None:
    for g, r in par["graphs"].items():
        if not all(math.isfinite(v) for v in r.values()):
            raise ParityError(f"the Q/DQ {g} graph gives non-finite logits or KL ({r}): a scale is broken")
