"""What more data or more training buys a draft head: train on a fraction of a `specrt
train-draft` folder's teacher shards and measure held-out greedy acceptance.

    python benchmarks/head_curve.py artifacts/smollm2-head --frac 0.25 [--epochs 2 --steps 3
                                    --draft-vocab 4096 --lr 2e-3] [--medusa]

Reads HEAD/head.json (the source model, the tapped layers) and HEAD/work's teacher shards (the
training ones and the held-out ones); a random `--frac` of the training shards (seed 0), trained
as train-draft trains (heads/train.py), or a Medusa head with `--steps` blocks (`--medusa`).
Prints one JSON line: training tokens, seconds, the final loss, tokens a round and the
per-position acceptance on the held-out answers. The fraction and Medusa rows of the table in
docs/speculation.md#trained-heads came from the same functions and shard selection run ad hoc
(2026-12-06, before this script; its heads' initialisation was not seeded, so a rerun differs
slightly).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    from specrt.export.sources import load_source
    from specrt.heads.model import EagleHead, MedusaHead
    from specrt.heads.recipe import head_config
    from specrt.heads.train import (draft_vocabulary, eagle_acceptance, load_shards, medusa_acceptance, train_eagle,
                                    train_medusa)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("head", type=Path)
    ap.add_argument("--frac", type=float, default=1.0)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--medusa", action="store_true")
    a = ap.parse_args()
    meta = json.loads((a.head / "head.json").read_text())
    layers = "-".join(map(str, meta["layers"]))
    work = a.head / "work"
    held_dirs = sorted(work.glob(f"teacher-held-*{layers}"))
    train_dirs = [d for d in sorted(work.glob(f"teacher-*-{layers}")) if d not in held_dirs]
    paths = sorted(p for d in train_dirs for p in d.glob("*.npz"))
    keep = np.random.default_rng(0).permutation(len(paths))[:max(1, int(len(paths) * a.frac))]
    shards = load_shards([paths[i] for i in sorted(keep)])
    held = load_shards(sorted(p for d in held_dirs for p in d.glob("*.npz")))
    lm = load_source(meta["source"])
    vm = torch.from_numpy(draft_vocabulary(shards, a.draft_vocab))
    cfg = head_config(lm.model.config, len(meta["layers"]), len(vm))
    embed = lm.model.get_input_embeddings().weight.detach()
    torch.manual_seed(0)
    if a.medusa:
        head = MedusaHead(cfg, embed, vm, k=a.steps)
        result = train_medusa(head, shards, epochs=a.epochs, lr=a.lr)
        acc = medusa_acceptance(head, held)
    else:
        head = EagleHead(cfg, embed, vm)
        result = train_eagle(head, shards, epochs=a.epochs, steps=a.steps, lr=a.lr)
        acc = eagle_acceptance(head, held, a.steps)
    print(json.dumps({"kind": "medusa" if a.medusa else "eagle", "frac": a.frac, "epochs": a.epochs,
                      "train_tokens": int(sum(int((s["lengths"] - s["prompt_len"]).sum()) for s in shards)),
                      "draft_vocab": len(vm), "train_s": round(result.seconds),
                      "final_loss": float(np.mean(result.losses[-20:])), **acc}))


if __name__ == "__main__":
    main()
