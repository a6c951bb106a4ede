"""Rotary position tables, as the exported graphs take them.

transformers rotates the first R dims of each head (R = D, or R < D with Phi-3's
partial_rotary_factor) by angle position * inv_freq (R/2 frequencies), scaled by the rope
type's attention_scaling:

    q_rot = q[:R] * cos + rotate_half(q[:R]) * sin,    rotate_half(x) = cat(-x[R/2:], x[:R/2])

The graphs do the same with one MatMul: q * cos + (q @ rot) * sin over all D dims, where
cos is 1 and sin is 0 past R and `rot` maps those dims to 0, so they pass through exactly.
"""
from __future__ import annotations

import torch


def rotate_half_matrix(d: int, rotary: int | None = None) -> torch.Tensor:
    """[D, D] with x @ R == cat(-x[r/2:r], x[:r/2], 0 * x[r:]) for r = rotary (default D): one
    MatMul instead of Slice/Neg/Concat; dims past r (partial rotary) map to 0."""
    r = torch.zeros(d, d)
    h = (rotary or d) // 2
    r[torch.arange(h) + h, torch.arange(h)] = -1.0
    r[torch.arange(h), torch.arange(h) + h] = 1.0
    return r


def cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, scale: float, head_dim: int):
    """pos [T] -> cos, sin [T, D] (fp32): the rotary angles of the first R dims, cos 1 and
    sin 0 on the D - R dims that pass through."""
    freqs = pos.to(torch.float32)[:, None] * inv_freq[None, :]                 # [T, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)                                     # [T, R]
    cos, sin = emb.cos() * scale, emb.sin() * scale
    rest = head_dim - emb.shape[-1]
    if rest:
        cos = torch.cat([cos, torch.ones(cos.shape[0], rest)], dim=-1)
        sin = torch.cat([sin, torch.zeros(sin.shape[0], rest)], dim=-1)
    return cos, sin


def gqa_table(fn, inv_freq: torch.Tensor, scale: float, rows: int) -> torch.Tensor:
    """GroupQueryAttention's cos_cache / sin_cache: fn(position * inv_freq) * scale, [rows, R/2]."""
    freqs = torch.arange(rows, dtype=torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    return fn(freqs) * scale
