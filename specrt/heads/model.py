"""The draft heads in torch (training and the ONNX export's reference).

EagleHead (EAGLE-3's shape, Li et al. 2025): the target's hidden states of three layers (low,
middle, high) side by side are projected 3h -> h (`fc`); with the embedding of the token that
follows them they go through ONE decoder layer (the target's attention and MLP shapes, its own
small cache of pairs) and a final norm, then an LM head over a reduced draft vocabulary (the
tokens the target says most often; `vocab_map` maps them back). Its output hidden state, before
the norm, stands in for the target's features at the next draft step.

    pair p   (feature of position p, embedding of token p+1)  ->  logits of token p+2

MedusaHead (Cai et al. 2024), to compare: K residual blocks on the target's last hidden state
(after its final norm), block i guessing token t+2+i at once, no attention and no cache.

Both read frozen tables of the target (its embedding); only their own weights train.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
import torch.nn.functional as F


@dataclass(frozen=True)
class HeadConfig:
    hidden: int
    n_feats: int            # tapped target layers
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    draft_vocab: int
    rope_theta: float
    eps: float

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, H, L, D] rotated by positions pos [B, L] (the half-split layout of Llama)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None, :, None].float() * inv          # [B, 1, L, D/2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, vocab_map: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        # [V, h], frozen; fp16 (the export's largest tensor: half the file), widened after the gather
        self.register_buffer("embed", embed.detach().to(torch.float16), persistent=False)
        self.register_buffer("vocab_map", vocab_map.long())                           # [Vd] draft -> target id
        self.fc = nn.Linear(cfg.n_feats * h, h, bias=False)
        self.norm_e, self.norm_h = RMSNorm(h, cfg.eps), RMSNorm(h, cfg.eps)
        self.q = nn.Linear(2 * h, cfg.heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(2 * h, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(2 * h, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * cfg.head_dim, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.eps)
        self.gate = nn.Linear(h, cfg.intermediate, bias=False)
        self.up = nn.Linear(h, cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, h, bias=False)
        self.norm = RMSNorm(h, cfg.eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab, bias=False)
        with torch.no_grad():           # start the LM head from the target's (tied) rows
            self.lm_head.weight.copy_(embed[self.vocab_map].float())

    # --- pieces shared by training and the export -------------------------------------------
    def pair_input(self, feat: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x [.., 2h] the layer's input, residual [.., h]): feat is the h-wide feature (fc of the
        target's layers, or the head's own output), tokens the next tokens."""
        e = self.embed[tokens].float()
        return torch.cat([self.norm_e(e), self.norm_h(feat)], -1), feat

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        B, L, _ = x.shape
        c = self.cfg
        q = self.q(x).view(B, L, c.heads, c.head_dim).transpose(1, 2)
        k = self.k(x).view(B, L, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(x).view(B, L, c.kv_heads, c.head_dim).transpose(1, 2)
        return rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta), v

    def after_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """attn [B, H, L, D] -> (output hidden [B, L, h] (the next step's feature), logits [B, L, Vd])."""
        B, H, L, D = attn.shape
        x = residual + self.o(attn.transpose(1, 2).reshape(B, L, H * D))
        y = self.post_norm(x)
        x = x + self.down(F.silu(self.gate(y)) * self.up(y))
        return x, self.lm_head(self.norm(x))

    def attend(self, q, ks: list, vs: list, masks: list) -> torch.Tensor:
        """q [B, H, L, D] against several key blocks [B, KVH, Lk, D], each with its own boolean
        mask [L, Lk] (True: may attend)."""
        c = self.cfg
        rep = c.heads // c.kv_heads
        k = torch.cat(ks, 2).repeat_interleave(rep, 1)
        v = torch.cat(vs, 2).repeat_interleave(rep, 1)
        m = torch.cat(masks, 1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim)
        s = s.masked_fill(~m, float("-inf"))
        return torch.softmax(s, -1) @ v

    # --- training-time test ----------------------------------------------------------------
    def unrolled(self, feats: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """EAGLE-3's training-time test, all anchors at once. feats [B, L, n*h] the target's
        tapped layers, tokens [B, L]. Step j's logits at pair p guess token p+2 when the head
        has drafted j-1 tokens after anchor a = p-j+1 (real pairs up to a, its own outputs
        after): query (j, p) attends to real pairs <= a and to step i's pair at a+i-1
        (2 <= i <= j, one each), which is what the runtime's cache holds at that draft step.
        Returns each step's logits [B, L-1, Vd] (pairs 0..L-2; a step's first j-1 pairs have
        no anchor and are masked out of the loss by the caller)."""
        B, L, _ = feats.shape
        L1 = L - 1
        pos = torch.arange(L1).expand(B, L1)
        feat = self.fc(feats[:, :L1])
        nxt = tokens[:, 1:]
        idx = torch.arange(L1)
        ks, vs, out = [], [], []
        for j in range(1, steps + 1):
            x, residual = self.pair_input(feat, nxt)
            q, k, v = self.qkv(x, pos)
            ks.append(k)
            vs.append(v)
            masks = [idx[None, :] <= idx[:, None] - (j - 1)]                  # real pairs <= a
            for i in range(2, j + 1):
                masks.append(idx[None, :] == idx[:, None] - (j - i))          # step i's pair of this anchor
            hid, logits = self.after_attention(self.attend(q, ks, vs, masks), residual)
            out.append(logits)
            feat = torch.cat([hid[:, :1], hid[:, :-1]], 1)                    # pair p+1 reads pair p's output
        return out


class MedusaHead(nn.Module):
    """K residual blocks (SiLU) on the target's last hidden state; block i guesses token t+2+i."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, vocab_map: torch.Tensor, k: int):
        super().__init__()
        self.cfg, self.k = cfg, k
        h = cfg.hidden
        self.register_buffer("vocab_map", vocab_map.long())
        self.blocks = nn.ModuleList(nn.Linear(h, h) for _ in range(k))
        self.heads = nn.ModuleList(nn.Linear(h, cfg.draft_vocab, bias=False) for _ in range(k))
        with torch.no_grad():
            for blk, head in zip(self.blocks, self.heads):
                nn.init.zeros_(blk.weight)
                nn.init.zeros_(blk.bias)
                head.weight.copy_(embed[self.vocab_map])

    def forward(self, last: torch.Tensor) -> list[torch.Tensor]:
        return [head(last + F.silu(blk(last))) for blk, head in zip(self.blocks, self.heads)]
