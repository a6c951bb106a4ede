"""fp16 graphs against their fp32 originals, through ONNX Runtime CPU.

The fp16 graphs (`export_model(..., precision="fp16")`) keep int64 ids and past_len,
take and return the KV cache in float16 and return float32 logits; norms and rotary
angles are computed in fp32 inside the graph. They are meant for GPUs (the TensorRT
standard-op graph, ONNX Runtime CUDA's fp16 GroupQueryAttention). On CPU, ONNX Runtime
runs ops that lack fp16 CPU kernels in fp32 behind inserted casts, so these numbers
measure fp16 weights and KV storage and the ops ORT CPU runs in fp16; GPU kernels
accumulate differently and must be compared again on a GPU (scripts/gpu_check.sh).

Tolerance: max |logit delta| <= FP16_ATOL + FP16_RTOL * max|logit| (fp16 keeps 11
significant bits; the rounding of each layer compounds). Greedy agreement is reported
as the number of identical greedy tokens before the first divergence, with the fp32
logit margin at that position (a near-tie may flip; a wide margin means a bug).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt import manifest as mf
from specrt.driver import graph_set, greedy
from specrt.errors import ParityError

FP16_ATOL = 1e-2
FP16_RTOL = 2e-2


def compare(fp32_dir: Path, fp32: dict, fp16_dir: Path, fp16: dict, shapes: mf.Shapes, *, prompt: list[int],
            new_tokens: int = 32, seed: int = 0, providers: tuple[str, ...] | None = None) -> dict:
    """Logit parity of each graph (same random tokens at real cache offsets) and greedy
    agreement from `prompt`; the fp32 side runs on the CPU, the fp16 side on `providers`
    (default CPU). Raises ParityError above the tolerance."""
    vocab = int(fp32["dims"]["vocab"])
    C, k = shapes.prefill_chunk, shapes.k
    n_prompt = min(C - 3, shapes.max_context - k - 3)
    ids = np.random.default_rng(seed).integers(0, vocab, n_prompt + 1 + k + 1).tolist()
    runs = []
    for d, part, prov in ((fp32_dir, fp32, None), (fp16_dir, fp16, providers)):
        gs = graph_set(d, part, shapes.kv_capacity, providers=prov)
        got = {"prefill": gs.step("prefill", ids[:n_prompt], 0).copy(),
               "decode": gs.step("decode", ids[n_prompt:n_prompt + 1], n_prompt).copy()}
        if "verify" in part["graphs"]:
            got["verify"] = gs.step("verify", ids[n_prompt + 1:], n_prompt + 1).copy()
        runs.append(got)
    ref, low = runs
    scale = float(max(np.abs(r).max() for r in ref.values()))
    tol = FP16_ATOL + FP16_RTOL * scale
    report = {"tolerance": tol, "atol": FP16_ATOL, "rtol": FP16_RTOL, "graphs": {}}
    for g in ref:
        delta = float(np.abs(ref[g] - low[g]).max())
        agree = float((ref[g].argmax(-1) == low[g].argmax(-1)).mean())
        report["graphs"][g] = {"max_abs_logit_delta": delta, "argmax_agreement": agree}
        if delta > tol:
            raise ParityError(f"fp16 {g} graph: max |logit delta| {delta:.3g} vs fp32 exceeds the tolerance "
                              f"{tol:.3g} (atol {FP16_ATOL} + rtol {FP16_RTOL} x max|logit| {scale:.3g})")
    ref_run = greedy(graph_set(fp32_dir, fp32, shapes.kv_capacity), prompt, new_tokens, keep_rows=True)
    t32, rows = ref_run.tokens, ref_run.rows
    t16 = greedy(graph_set(fp16_dir, fp16, shapes.kv_capacity, providers=providers), prompt, new_tokens).tokens
    first = next((i for i, (a, b) in enumerate(zip(t32, t16)) if a != b), None)
    greedy_report = {"tokens": new_tokens, "identical_prefix": new_tokens if first is None else first}
    if first is not None:
        top2 = np.sort(rows[first])[-2:]
        greedy_report["first_divergence"] = {"position": first, "fp32_token": t32[first], "fp16_token": t16[first],
                                             "fp32_top2_margin": float(top2[1] - top2[0])}
    report["greedy"] = greedy_report
    return report
