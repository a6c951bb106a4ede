"""Training a draft head on the teacher's shards (data.py), and measuring what it would accept.

    vocabulary   the draft vocabulary: the tokens the target wrote most often in its answers
                 (and chose at the training positions), `draft_vocab` of them, sorted by id
    loss         soft cross-entropy against the target's next-token distribution (its top-K
                 log-probabilities, restricted to the draft vocabulary and renormalised), at
                 every answer position, for each of the `steps` unrolled draft steps
                 (EAGLE-3's training-time test: model.EagleHead.unrolled), step j weighted 0.8^(j-1)
    acceptance   greedy chain acceptance on held-out sequences the target wrote greedily: from
                 each round's anchor the head drafts k tokens; the round keeps the agreeing
                 prefix plus the target's own token, and the next round starts there (exactly
                 what the runtime's greedy rounds would do with these features)
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch

from specrt.heads.model import EagleHead, MedusaHead

log = logging.getLogger(__name__)


def load_shards(paths: Iterable[Path]) -> list[dict]:
    return [dict(np.load(p)) for p in paths]


def draft_vocabulary(shards: Sequence[dict], size: int) -> np.ndarray:
    """The `size` most frequent tokens of the answers and of the target's top-1 choices, by id."""
    counts = np.zeros(max(int(max(s["top_id"].max() for s in shards)),
                          int(max(s["tokens"].max() for s in shards))) + 1, np.int64)
    for s in shards:
        for i in range(len(s["lengths"])):
            lo, hi = int(s["prompt_len"][i]), int(s["lengths"][i])
            np.add.at(counts, s["tokens"][i, lo:hi], 1)
            np.add.at(counts, s["top_id"][i, lo - 1:hi, 0], 1)
    order = np.argsort(-counts, kind="stable")[:size]
    return np.sort(order)


def _targets(shard: dict, to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [N, L, K] in the draft vocabulary (0 where outside), probabilities [N, L, K]
    renormalised over the draft vocabulary's share, valid [N, L]: the share is > 0)."""
    ids = to_draft[torch.from_numpy(shard["top_id"]).long()]
    p = torch.from_numpy(shard["top_lp"]).float().exp() * (ids >= 0)
    mass = p.sum(-1, keepdim=True)
    return ids.clamp(min=0), p / mass.clamp(min=1e-9), mass[..., 0] > 1e-6


def _pair_mask(shard: dict, L1: int) -> torch.Tensor:
    """[N, L-1] pairs p whose guess (token p+2) is an answer token inside the sequence's length
    or the token after it: prompt_len - 2 <= p <= length - 2."""
    p = torch.arange(L1)[None, :]
    lo = torch.from_numpy(shard["prompt_len"])[:, None] - 2
    hi = torch.from_numpy(shard["lengths"])[:, None] - 2
    return (p >= lo) & (p <= hi)


def soft_ce(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """-sum_k probs_k log softmax(logits)[ids_k], per position."""
    return -(torch.log_softmax(logits, -1).gather(-1, ids) * probs).sum(-1)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    losses: list


def train_eagle(head: EagleHead, shards: Sequence[dict], *, epochs: float, steps: int, lr: float = 1e-3,
                seed: int = 0, budget_s: float | None = None, progress: bool = True) -> TrainResult:
    """AdamW with warmup and cosine decay over `epochs` passes of the shards (one shard a step)."""
    from tqdm import tqdm
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    to_draft = torch.full((head.embed.shape[0],), -1, dtype=torch.long)
    to_draft[head.vocab_map] = torch.arange(len(head.vocab_map))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    total = max(1, int(epochs * len(shards)))
    warm = max(1, total // 50)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, total) / total)))
    order = np.concatenate([rng.permutation(len(shards)) for _ in range(math.ceil(epochs))])[:total]
    t0, losses = time.monotonic(), []
    head.train()
    bar = tqdm(order, desc="train", unit="batch", disable=not progress)
    for n, i in enumerate(bar):
        s = shards[i]
        feats = torch.from_numpy(s["feats"]).float()
        tokens = torch.from_numpy(s["tokens"]).long()
        L1 = tokens.shape[1] - 1
        ids, probs, ok = _targets(s, to_draft)
        ids, probs, ok = ids[:, 1:], probs[:, 1:], ok[:, 1:]         # pair p: the target at p+1
        mask = _pair_mask(s, L1) & ok
        loss = 0.0
        for j, logits in enumerate(head.unrolled(feats, tokens, steps), start=1):
            m = mask.clone()
            m[:, : j - 1] = False                                      # no anchor yet
            ce = soft_ce(logits, ids, probs)
            loss = loss + 0.8 ** (j - 1) * (ce * m).sum() / m.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
        if budget_s is not None and time.monotonic() - t0 > budget_s:
            log.warning("train: time budget %.0f s reached after %d of %d batches", budget_s, n + 1, total)
            break
    head.eval()
    return TrainResult(len(losses), time.monotonic() - t0, losses)


@torch.no_grad()
def eagle_acceptance(head: EagleHead, shards: Sequence[dict], k: int) -> dict:
    """Greedy chain acceptance of k-token drafts on sequences the target wrote greedily:
    tokens per round (accepted + the target's own), and alpha_j = P(draft j kept | 1..j-1 kept)."""
    rounds = tokens_out = 0
    tried, kept = np.zeros(k), np.zeros(k)
    vm = head.vocab_map.numpy()
    for s in shards:
        feats = torch.from_numpy(s["feats"]).float()
        toks = torch.from_numpy(s["tokens"]).long()
        guess = np.stack([vm[lg.argmax(-1).numpy()] for lg in head.unrolled(feats, toks, k)], 0)   # [k, N, L-1]
        for r in range(len(s["lengths"])):
            lo, hi = int(s["prompt_len"][r]), int(s["lengths"][r])
            a = lo - 1
            while a + 2 < hi:                 # a round guesses tokens a+2.. (a+1: the target's last choice)
                m = 0
                while m < k and a + m + 2 < hi and guess[m, r, a + m] == s["tokens"][r, a + m + 2]:
                    m += 1
                for j in range(min(m + 1, k)):
                    if a + j + 2 < hi:
                        tried[j] += 1
                        kept[j] += j < m
                rounds += 1
                step = min(m + 1, hi - (a + 2))
                tokens_out += step
                a += step
    return {"rounds": rounds, "tokens": tokens_out, "tokens_per_round": tokens_out / max(rounds, 1),
            "alpha": [float(kept[j] / tried[j]) if tried[j] else None for j in range(k)]}


def train_medusa(head: MedusaHead, shards: Sequence[dict], *, epochs: float, lr: float = 1e-3, seed: int = 0,
                 progress: bool = True) -> TrainResult:
    from tqdm import tqdm
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    V = int(max(s["top_id"].max() for s in shards)) + 1
    to_draft = torch.full((max(V, int(head.vocab_map.max()) + 1),), -1, dtype=torch.long)
    to_draft[head.vocab_map] = torch.arange(len(head.vocab_map))
    opt = torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95))
    total = max(1, int(epochs * len(shards)))
    order = np.concatenate([rng.permutation(len(shards)) for _ in range(math.ceil(epochs))])[:total]
    t0, losses = time.monotonic(), []
    for i in tqdm(order, desc="medusa", unit="batch", disable=not progress):
        s = shards[i]
        last = torch.from_numpy(s["last"]).float()
        ids, probs, ok = _targets(s, to_draft)
        L = last.shape[1]
        loss = 0.0
        for j, logits in enumerate(head(last)):        # block j at t guesses t+2+j: the target at t+1+j
            sh = 1 + j
            m = _pair_mask(s, L - 1)[:, : L - sh] & ok[:, sh:]
            m = m & (torch.arange(L - sh)[None] <= torch.from_numpy(s["lengths"])[:, None] - 2 - j)
            ce = soft_ce(logits[:, : L - sh], ids[:, sh:], probs[:, sh:])
            loss = loss + 0.8 ** j * (ce * m).sum() / m.sum().clamp(min=1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return TrainResult(len(losses), time.monotonic() - t0, losses)


@torch.no_grad()
def medusa_acceptance(head: MedusaHead, shards: Sequence[dict]) -> dict:
    k = head.k
    rounds = tokens_out = 0
    tried, kept = np.zeros(k), np.zeros(k)
    vm = head.vocab_map.numpy()
    for s in shards:
        guess = np.stack([vm[lg.argmax(-1).numpy()] for lg in head(torch.from_numpy(s["last"]).float())], 0)
        for r in range(len(s["lengths"])):
            lo, hi = int(s["prompt_len"][r]), int(s["lengths"][r])
            a = lo - 1
            while a + 2 < hi:
                m = 0
                while m < k and a + m + 2 < hi and guess[m, r, a] == s["tokens"][r, a + m + 2]:
                    m += 1
                for j in range(min(m + 1, k)):
                    if a + j + 2 < hi:
                        tried[j] += 1
                        kept[j] += j < m
                rounds += 1
                step = min(m + 1, hi - (a + 2))
                tokens_out += step
                a += step
    return {"rounds": rounds, "tokens": tokens_out, "tokens_per_round": tokens_out / max(rounds, 1),
            "alpha": [float(kept[j] / tried[j]) if tried[j] else None for j in range(k)]}
