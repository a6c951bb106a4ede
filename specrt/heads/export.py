"""A trained EAGLE-style head as two ONNX graphs (MNN ships EAGLE-3 heads the same way:
`eagle_fc.onnx` + `eagle.onnx`), with the batched engine's KV contract (export/batch.py):

    head_fc.onnx   features [N, n*h] (the target's tapped layers) -> [N, h]
    head.onnx      inputs   hidden     [B, T, h]   the pair's feature: head_fc of the target's, or
                                                    the head's own hidden_out of the previous step
                            input_ids  [B, T]      the token after each feature
                            past_len   [B]         pairs already in row b's cache
                            logit_pos  [B, P]      which of row b's T positions get logits
                            past_k/v   [B, KVH, L, D]   the row's cache, its first L >= past_len positions
                   outputs  logits     [B, P, Vd]  over the draft vocabulary (vocab_map: draft -> target id)
                            hidden_out [B, T, h]   the next step's feature (before the final norm)
                            new_k/v    [B, KVH, T, D]  the caller writes them at past_len[b].. (portable)

Row b's pairs sit at positions past_len[b]..+T-1 and attend to its cache [0, past_len[b]) and
causally within the window. B, T, P and L are symbolic: one graph for the catch-up of real
pairs after a verify, and for each one-pair draft step.
"""
from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from pathlib import Path

import torch
from torch import nn

from specrt.export.onnx_export import EXPORTER_LOGGER, logger_level
from specrt.heads.model import EagleHead, rope


class HeadFc(nn.Module):
    def __init__(self, head: EagleHead):
        super().__init__()
        self.fc = head.fc

    def forward(self, features):
        return self.fc(features)


class HeadStep(nn.Module):
    """EagleHead over a cache (the export's module; heads/model.py's pieces)."""

    def __init__(self, head: EagleHead):
        super().__init__()
        self.head = head

    def forward(self, hidden, input_ids, past_len, logit_pos, past_k, past_v):
        h = self.head
        c = h.cfg
        B, T, _ = hidden.shape
        pos = past_len[:, None] + torch.arange(T)[None, :]                          # [B, T]
        x, residual = h.pair_input(hidden, input_ids)
        q = h.q(x).view(B, T, c.heads, c.head_dim).transpose(1, 2)
        k = h.k(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = h.v(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        L = past_k.shape[2]
        rep = c.heads // c.kv_heads
        keys = torch.cat([past_k, k], 2).repeat_interleave(rep, 1)                   # [B, H, L+T, D]
        vals = torch.cat([past_v, v], 2).repeat_interleave(rep, 1)
        in_cache = (torch.arange(L)[None, None, :] < past_len[:, None, None]).expand(B, T, L)
        steps = torch.arange(T)
        causal = (steps[None, :] <= steps[:, None])[None].expand(B, T, T)
        mask = torch.cat([in_cache, causal], 2)[:, None]                             # [B, 1, T, L+T]
        s = (q @ keys.transpose(-1, -2)) / math.sqrt(c.head_dim)
        attn = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vals
        out, _ = h.after_attention(attn, residual)                                  # [B, T, h]
        idx = logit_pos[:, :, None].expand(-1, -1, out.shape[-1])
        logits = h.lm_head(h.norm(torch.gather(out, 1, idx)))
        return logits, out, k, v


def export_head(head: EagleHead, out_dir: Path) -> dict[str, Path]:
    """head_fc.onnx and head.onnx in out_dir (fp32, weights inside: a few MB)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    c = head.cfg
    B, T, P, L = torch.export.Dim("batch"), torch.export.Dim("tokens"), torch.export.Dim("positions"), \
        torch.export.Dim("kv_len")
    N = torch.export.Dim("rows")
    paths = {"fc": out_dir / "head_fc.onnx", "head": out_dir / "head.onnx"}
    quiet = io.StringIO()
    with torch.no_grad(), contextlib.redirect_stdout(quiet), warnings.catch_warnings(), \
            logger_level(EXPORTER_LOGGER, logging.ERROR):
        warnings.simplefilter("ignore")
        torch.onnx.export(HeadFc(head).eval(), (torch.zeros(3, c.n_feats * c.hidden),), str(paths["fc"]),
                          dynamo=True, input_names=["features"], output_names=["hidden"],
                          dynamic_shapes=({0: N},), external_data=False, verbose=False)
        args = (torch.zeros(2, 3, c.hidden), torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, c.kv_heads, 5, c.head_dim),
                torch.zeros(2, c.kv_heads, 5, c.head_dim))
        torch.onnx.export(HeadStep(head).eval(), args, str(paths["head"]), dynamo=True,
                          input_names=["hidden", "input_ids", "past_len", "logit_pos", "past_k", "past_v"],
                          output_names=["logits", "hidden_out", "new_k", "new_v"],
                          dynamic_shapes=({0: B, 1: T}, {0: B, 1: T}, {0: B}, {0: B, 1: P}, {0: B, 2: L},
                                          {0: B, 2: L}),
                          external_data=False, verbose=False)
    return paths
