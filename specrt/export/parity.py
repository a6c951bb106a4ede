"""Parity of exported graphs against the PyTorch reference, through ONNX Runtime.

One random token sequence runs through the Hugging Face model once; the graphs replay
it under the KV contract (prefill chunk, then one decode step, then one verify window),
so every graph is compared at real cache offsets. Also recorded: how far the verify
graph's rows drift from the decode graph's at the same position — greedy speculative
output equals plain greedy output only where that drift cannot flip an argmax.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specrt import manifest as mf
from specrt.driver import GraphSet
from specrt.errors import ParityError

ATOL = 1e-3


def check_parity(reference: torch.nn.Module, directory: Path, export: dict, shapes: mf.Shapes, *,
                 rtol: float, seed: int = 0) -> dict:
    """Compare each graph with the reference; raises ParityError above atol + rtol * max|logit|."""
    dims, graphs = export["dims"], export["graphs"]
    C, k = shapes.prefill_chunk, shapes.k
    n_prompt = min(C - 3, shapes.max_context - k - 3)   # leaves room for decode + verify
    S = n_prompt + 1 + (k + 1)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(dims["vocab"]), (1, S), generator=g)
    with torch.no_grad():
        ref = reference(ids).logits[0].float().numpy()                       # [S, V]
    gs = GraphSet(directory, graphs, dims, shapes.kv_capacity)
    seq = ids[0].tolist()
    got = {}
    if "prefill" in graphs:
        got["prefill"] = (gs.step("prefill", seq[:n_prompt], 0), slice(0, n_prompt))
    else:  # a graph set without prefill (shared-cache draft) is fed by decode steps
        for i in range(n_prompt):
            gs.step("decode", seq[i:i + 1], i)
    if "decode" in graphs:
        got["decode"] = (gs.step("decode", seq[n_prompt:n_prompt + 1], n_prompt), slice(n_prompt, n_prompt + 1))
    if "verify" in graphs:
        lo = n_prompt + 1
        got["verify"] = (gs.step("verify", seq[lo:lo + k + 1], lo), slice(lo, lo + k + 1))
    report = {}
    scale = float(np.abs(ref).max())
    tol = ATOL + rtol * scale
    for name, (logits, rows) in got.items():
        r = ref[rows]
        delta = float(np.abs(logits - r).max())
        agree = float((logits.argmax(-1) == r.argmax(-1)).mean())
        report[name] = {"max_abs_logit_delta": delta, "argmax_agreement": agree, "positions": rows.stop - rows.start}
        if delta > tol:
            raise ParityError(f"{name} graph: max |logit delta| {delta:.3g} vs PyTorch exceeds the tolerance "
                              f"{tol:.3g} (atol {ATOL} + rtol {rtol} x max|logit| {scale:.3g})")
    if "decode" in graphs and "verify" in graphs:
        report["decode_vs_verify"] = _decode_vs_verify(gs, seq, n_prompt, k)
    return {"reference": "transformers (torch fp32)", "tolerance": tol, "graphs": report}


def _decode_vs_verify(gs: GraphSet, seq: list[int], start: int, k: int) -> dict:
    """Max logit difference between the verify graph's rows and decode steps over the same tokens."""
    window = seq[start:start + k + 1]
    v = gs.step("verify", window, start).copy()
    d = np.stack([gs.step("decode", window[i:i + 1], start + i)[0] for i in range(len(window))])
    return {"max_abs_logit_delta": float(np.abs(v - d).max()),
            "argmax_agreement": float((v.argmax(-1) == d.argmax(-1)).mean())}
