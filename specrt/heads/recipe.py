"""`specrt train-draft`: an EAGLE-style draft head for an engine folder, from the target's own
answers, in stages that each keep their output (a rerun resumes where the last one stopped):

    1 answers   the folder's greedy (and, with --samples, seeded sampled) answers to the training
                prompts (data.py): <out>/work/answers-*.jsonl
    2 teacher   the target's hidden states and top-K next-token distribution along every answer,
                from its torch model (the build's source): <out>/work/teacher/shard-*.npz
    3 train     the head (model.EagleHead), soft cross-entropy with training-time test
                (train.py), under a time budget; seeded
    4 export    head_fc.onnx + head.onnx (export.py), checked against torch (gate: every logit
                within 1e-4 on held-out shards, step by step through the head's cache)
    5 measure   greedy chain acceptance on the held-out prompts (never trained on), and
                head.json: the config, the tapped layers, the draft vocabulary, the numbers

The held-out prompts are the shipped prompt set's evaluation part (calibration/dataset.py
split), the same prompts `specrt quality` and `specrt check-modes` use.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from specrt.errors import ConfigError

log = logging.getLogger(__name__)

HEAD_FILE = "head.json"


@dataclass
class Recipe:
    engines: Path                       # the engine folder the head drafts for (its answers are the data)
    out: Path
    model: Path | None = None           # the target's source (default: the folder's manifest)
    layers: tuple[int, ...] | None = None     # tapped target layers (default: EAGLE-3's low, middle, high)
    samples: tuple[float, ...] = (0.0,)   # temperatures of the answers (0: greedy)
    max_prompts: int | None = None
    max_new_tokens: int = 128
    draft_vocab: int = 8192
    steps: int = 4                      # draft steps unrolled in training (training-time test)
    epochs: float = 2.0
    lr: float = 1e-3
    time_budget: float | None = None    # seconds of training at most
    seed: int = 0
    top_k: int = 32
    max_num_seqs: int = 8
    prompts: Path | None = None         # a prompt file (default: shipped calibration part + templates)
    report: dict = field(default_factory=dict)


def default_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's taps: a low, a middle and a high layer (2, L/2, L-3), not the last (whose output
    the final norm follows)."""
    if n_layers < 4:
        return tuple(range(max(n_layers - 1, 1)))
    return (min(2, n_layers - 3), n_layers // 2, n_layers - 3)


def head_config(hf_config, n_feats: int, draft_vocab: int):
    from specrt.heads.model import HeadConfig
    heads = int(hf_config.num_attention_heads)
    theta = getattr(hf_config, "rope_theta", None)
    if theta is None:
        theta = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return HeadConfig(hidden=int(hf_config.hidden_size), n_feats=n_feats, heads=heads,
                      kv_heads=int(getattr(hf_config, "num_key_value_heads", heads) or heads),
                      head_dim=int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads),
                      intermediate=int(hf_config.intermediate_size), draft_vocab=draft_vocab,
                      rope_theta=float(theta), eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(r: Recipe, progress: bool = True) -> dict:
    import torch

    from specrt import manifest as mf
    from specrt.calibration.dataset import load_prompts, split
    from specrt.export.sources import load_source
    from specrt.heads import data
    from specrt.heads.export import export_head
    from specrt.heads.model import EagleHead
    from specrt.heads.train import draft_vocabulary, eagle_acceptance, load_shards, train_eagle

    torch.manual_seed(r.seed)
    man = mf.load(r.engines)
    source = r.model or Path((man.target.source or {}).get("source", ""))
    if not str(source) or not Path(source).exists():
        raise ConfigError(f"the target's source {source!s:.200} is not on this machine: pass --model (the "
                          "Hugging Face directory or GGUF file the engines were built from)")
    layers = check_folder(man, r)
    if r.draft_vocab > int(man.batch.dims["vocab"]):
        raise ConfigError(f"--draft-vocab {r.draft_vocab} exceeds the target's vocabulary ({man.batch.dims['vocab']})")
    work = r.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    cal, held = split(load_prompts())
    if r.prompts is not None:
        train_prompts = [p.text for p in load_prompts(r.prompts)]
    else:
        train_prompts = [p.text for p in cal] + data.template_prompts(r.seed)
    held_ids = {p.text for p in held}
    train_prompts = [p for p in train_prompts if p not in held_ids][: r.max_prompts]
    check_work(work, r, man, source, train_prompts, layers)
    tag = f"{len(train_prompts)}-{'-'.join(f'{t:g}' for t in r.samples)}-{r.max_new_tokens}-{r.seed}"
    rows = data.answer(r.engines, train_prompts, work / f"answers-{tag}.jsonl", samples=r.samples, seed=r.seed,
                       max_new_tokens=r.max_new_tokens, max_num_seqs=r.max_num_seqs)
    held_rows = data.answer(r.engines, [p.text for p in held], work / f"held-greedy-{r.max_new_tokens}.jsonl",
                            samples=(0.0,), seed=0, max_new_tokens=r.max_new_tokens, max_num_seqs=r.max_num_seqs)
    t_answers = time.monotonic() - t0
    lm = load_source(source)
    ltag = "-".join(map(str, layers))
    train_paths = data.teacher(lm.model, rows, work / f"teacher-{tag}-{ltag}", layers, top_k=r.top_k)
    held_paths = data.teacher(lm.model, held_rows, work / f"teacher-held-{r.max_new_tokens}-{ltag}", layers,
                              top_k=r.top_k)
    t_teacher = time.monotonic() - t0 - t_answers
    shards, held_shards = load_shards(train_paths), load_shards(held_paths)
    vocab_map = draft_vocabulary(shards, r.draft_vocab)
    embed = lm.model.get_input_embeddings().weight.detach()
    cfg = head_config(lm.model.config, len(layers), len(vocab_map))
    head = EagleHead(cfg, embed, torch.from_numpy(vocab_map))
    result = train_eagle(head, shards, epochs=r.epochs, steps=r.steps, lr=r.lr, seed=r.seed,
                         budget_s=r.time_budget, progress=progress)
    paths = export_head(head, r.out)
    gate = onnx_matches_torch(head, paths, held_shards[:2], r.steps)
    acc = eagle_acceptance(head, held_shards, r.steps)
    train_tokens = int(sum(int((s["lengths"] - s["prompt_len"]).sum()) for s in shards))
    np.save(r.out / "vocab_map.npy", vocab_map.astype(np.int64))
    torch.save(head.state_dict(), r.out / "head.pt")
    report = {
        "format": "specrt-eagle-head", "version": 1,
        "engines": str(r.engines), "source": str(source), "layers": list(layers), "config": cfg.to_dict(),
        "files": {name: {"file": p.name, "sha256": _sha256(p)} for name, p in
                  {**paths, "vocab_map": r.out / "vocab_map.npy"}.items()},
        "recipe": {"prompts": len(train_prompts), "answers": len(rows), "samples": list(r.samples),
                   "train_tokens": train_tokens, "max_new_tokens": r.max_new_tokens, "draft_vocab": len(vocab_map),
                   "steps": r.steps, "epochs": r.epochs, "batches": result.steps, "lr": r.lr, "seed": r.seed,
                   "top_k": r.top_k, "seconds": {"answers": round(t_answers), "teacher": round(t_teacher),
                                                 "train": round(result.seconds)},
                   "final_loss": float(np.mean(result.losses[-20:]))},
        "gate": gate,
        "acceptance": {"held_out_prompts": len(held_rows), "k": r.steps, **acc},
    }
    (r.out / HEAD_FILE).write_text(json.dumps(report, indent=1))
    report["costs_ms"] = measure_costs(r.out, man)
    (r.out / HEAD_FILE).write_text(json.dumps(report, indent=1))
    return report


def measure_costs(out: Path, man, runs: int = 7) -> dict:
    """The head's draft step (fc + one pair, its cache holding the build's measured context) at
    the row counts the build timed the folder's batched steps at (build.speculation.batch_costs_ms),
    median of `runs` after a warm-up: the policy prices a head round as k of these plus the verify
    pass (runtime/batch/policy.py), against the target costs the build measured on its machine."""
    from specrt.runtime.head import HeadModel
    spec = ((man.build or {}).get("speculation") or {}).get("batch_costs_ms") or {}
    counts = sorted({int(n) for by_n in (spec.get("target") or {}).values() for n in by_n}) or [1]
    context = int(spec.get("context", 128))
    head = HeadModel(out, rows=max(counts), capacity=man.shapes.kv_capacity, vocab=int(man.target.dims["vocab"]))
    draft = {}
    for n in counts:
        feats = np.random.default_rng(0).standard_normal((n, head.width)).astype(np.float32)
        toks, starts, pos = np.ones((n, 1), np.int64), np.full(n, context, np.int64), np.zeros((n, 1), np.int64)
        times = []
        for i in range(runs + 1):
            t = time.perf_counter()
            head.step(head.fc(feats)[:, None], toks, starts, pos)
            times.append(time.perf_counter() - t)
        draft[str(n)] = round(float(np.median(times[1:])) * 1e3, 4)
    return {"draft": draft, "context": context, "runs": runs,
            "target_measured_by": "the build (manifest build.speculation.batch_costs_ms)"}


def check_folder(man, r: Recipe) -> tuple[int, ...]:
    """The layers the head will read: those the folder's batched model returns (`--hidden-layers`),
    refused before any work when the folder cannot run a head (no batched model, no hidden
    states, other layers than --layers, the last layer)."""
    n = int(man.target.dims["layers"])
    want = tuple(r.layers or default_layers(n))
    flag = ",".join(map(str, want))
    if man.batch is None:
        raise ConfigError(f"{r.engines} has no batched model, where a head drafts: rebuild it with `specrt build ... "
                          f"--batch --hidden-layers {flag}`")
    have = tuple(man.batch.dims.get("hidden_layers") or ())
    if not have:
        raise ConfigError(f"{r.engines} returns no hidden states for a head to read: rebuild it with `specrt build ... "
                          f"--batch --hidden-layers {flag}`")
    if r.layers is not None and tuple(r.layers) != have:
        raise ConfigError(f"--layers {flag}: {r.engines} returns layers {','.join(map(str, have))}; leave --layers out "
                          f"(the head reads what the folder returns) or rebuild it with --hidden-layers {flag}")
    if max(have) >= n - 1:
        raise ConfigError(f"{r.engines} returns layer {max(have)} of {n}: the head reads layers before the last (the "
                          "teacher's last hidden state is after the final norm); rebuild with --hidden-layers below "
                          f"{n - 1}, e.g. {','.join(map(str, default_layers(n)))}")
    return have


def check_work(work: Path, r: Recipe, man, source, prompts: Sequence[str], layers) -> None:
    """work/recipe.json: what the files in `work` were made from (the batched graphs' hashes, the
    source, the prompts, the answer settings, the layers). A rerun resumes only from the same;
    anything else is refused rather than trained on another model's answers."""
    from specrt import manifest as mf
    raw = json.loads((Path(r.engines) / mf.FILENAME).read_text())
    batch = raw["models"]["batch"]
    ident = {"graphs": hashlib.sha256(json.dumps([batch.get("graphs"), batch.get("weights")], sort_keys=True)
                                      .encode()).hexdigest(),
             "source": str(Path(source).resolve()),
             "prompts": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
             "samples": list(r.samples), "max_new_tokens": r.max_new_tokens, "seed": r.seed, "layers": list(layers),
             "top_k": r.top_k}
    path = work / "recipe.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in ident if old.get(k) != ident[k])
        if diff:
            raise ConfigError(f"{work} holds answers and teacher files made otherwise ({', '.join(diff)} differ): give "
                              "another --out, or delete that work folder to start over")
    else:
        path.write_text(json.dumps(ident, indent=1))


def onnx_matches_torch(head, paths: dict, shards: Sequence[dict], steps: int, tol: float = 1e-4) -> dict:
    """Run the exported graphs as the runtime will (real pairs into the cache in one call, then one
    pair a draft step, each step's K/V appended) from several anchors of each shard's first row,
    and compare every step's logits with the torch head's training-time unroll. Raises on a miss."""
    import onnxruntime as ort
    import torch

    from specrt.errors import ParityError
    from specrt.runtime.backends.ort_cpu import session_options
    fc, hs = (ort.InferenceSession(str(paths[g]), session_options(2), providers=["CPUExecutionProvider"])
              for g in ("fc", "head"))
    worst, checked = 0.0, 0
    for s in shards:
        n = int(s["lengths"][0])
        feats = torch.from_numpy(s["feats"][:1, :n]).float()
        toks = torch.from_numpy(s["tokens"][:1, :n]).long()
        with torch.no_grad():
            ref = [x[0].numpy() for x in head.unrolled(feats, toks, steps)]
        h = fc.run(None, {"features": feats[0, : n - 1].numpy()})[0][None]
        lo = int(s["prompt_len"][0]) - 1
        for a in sorted({lo, (lo + n) // 2, n - steps - 2}):
            if a < 1 or a + steps + 1 > n - 1:
                continue
            zeros = np.zeros((1, head.cfg.kv_heads, 0, head.cfg.head_dim), np.float32)
            _, _, K, V = hs.run(None, {"hidden": h[:, :a], "input_ids": toks[:, 1:a + 1].numpy(),
                                       "past_len": np.array([0]), "logit_pos": np.array([[a - 1]]),
                                       "past_k": zeros, "past_v": zeros})
            hid, tok = h[:, a:a + 1], toks[:, a + 1:a + 2].numpy()
            for j in range(steps):
                lg, ho, k, v = hs.run(None, {"hidden": hid, "input_ids": tok, "past_len": np.array([K.shape[2]]),
                                             "logit_pos": np.zeros((1, 1), np.int64), "past_k": K, "past_v": V})
                worst = max(worst, float(np.abs(lg[0, 0] - ref[j][a + j]).max()))
                checked += 1
                K, V = np.concatenate([K, k], 2), np.concatenate([V, v], 2)
                hid, tok = ho, toks[:, a + j + 2:a + j + 3].numpy()
    scale = 1.0 + max(float(np.abs(r).max()) for r in ref) if shards else 1.0
    if worst > tol * scale:
        raise ParityError(f"the exported head differs from the torch head by {worst:.3g} (tolerance {tol * scale:.3g}) "
                         f"over {checked} draft steps: the export is wrong; report it")
    return {"max_abs_logit_diff": worst, "draft_steps_checked": checked, "tolerance": tol * scale}
