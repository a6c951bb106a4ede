"""`specrt train-draft`: the command line of recipe.py (kept here: cli.py holds the others)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of temperatures, e.g. 0,0.8") from None
    if not vals or any(not 0.0 <= v <= 2.0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: give temperatures in [0, 2] (0: greedy), e.g. 0,0.8")
    return vals


def _layers(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer indices, e.g. 2,15,27") \
            from None
    if not vals or list(vals) != sorted(set(vals)) or vals[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give increasing layer indices, e.g. 2,15,27")
    return vals


def _positive(text: str) -> float:
    import math
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive finite number")
    return v


def cmd_train_draft(a) -> int:
    if a.quiet:                 # the libraries' bars too (transformers, the GGUF reader), as `build --quiet`
        from specrt.cli_text import quiet_progress_bars
        quiet_progress_bars()
    from specrt.errors import ConfigError
    from specrt.heads.recipe import Recipe, run
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file: give a folder")
    if out.exists() and any(out.iterdir()) and not (out / "work").is_dir():
        raise ConfigError(f"--out {out} holds files that train-draft did not write: give a new or empty folder")
    r = Recipe(engines=Path(a.engines), out=out, model=Path(a.model) if a.model else None, layers=a.layers,
               samples=a.samples, max_prompts=a.max_prompts, max_new_tokens=a.max_new_tokens,
               draft_vocab=a.draft_vocab, steps=a.steps, epochs=a.epochs, lr=a.lr, time_budget=a.time_budget,
               seed=a.seed, prompts=Path(a.prompts) if a.prompts else None)
    report = run(r, progress=not a.quiet)
    acc, rec = report["acceptance"], report["recipe"]
    print(json.dumps(report, indent=1) if a.json else
          f"trained {out}: {rec['train_tokens']} answer tokens, {rec['batches']} batches in {rec['seconds']['train']} s; "
          f"held-out greedy acceptance: {acc['tokens_per_round']:.2f} tokens a round at k={acc['k']} "
          f"(per position {', '.join(f'{x:.2f}' for x in acc['alpha'] if x is not None)}); ONNX = torch within "
          f"{report['gate']['max_abs_logit_diff']:.1e}")
    return 0


def add_parser(sub, positive_int) -> None:
    t = sub.add_parser("train-draft", help="train an EAGLE-style draft head on an engine folder's own answers "
                                           "(torch; docs/speculation.md#trained-heads)")
    t.add_argument("engines", help="engine folder (`specrt build --batch`) whose answers are the training data")
    t.add_argument("--out", required=True, help="folder for the head (head.onnx, head_fc.onnx, head.json) and its "
                                                "resumable work files")
    t.add_argument("--model", help="the target's source (default: the path its manifest records)")
    t.add_argument("--layers", type=_layers, help="target layers the head reads (default: EAGLE-3's low, middle, "
                                                  "high: 2, L/2, L-3)")
    t.add_argument("--samples", type=_floats, default=(0.0,),
                   help="temperatures of the answers per prompt, comma-separated (0: greedy)")
    t.add_argument("--prompts", help="training prompts (.jsonl or text; default: the shipped calibration part "
                                     "plus template prompts); the held-out prompts are never trained on")
    t.add_argument("--max-prompts", type=positive_int, help="use at most this many training prompts")
    t.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens per answer")
    t.add_argument("--draft-vocab", type=positive_int, default=8192, help="tokens the head can propose")
    t.add_argument("--steps", type=positive_int, default=4, help="draft steps unrolled in training (and measured)")
    t.add_argument("--epochs", type=_positive, default=2.0, help="passes over the training data")
    t.add_argument("--lr", type=_positive, default=1e-3, help="peak learning rate (AdamW, cosine)")
    t.add_argument("--time-budget", type=_positive, help="stop training after this many seconds (the data stages "
                                                     "resume from disk anyway)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--json", action="store_true", help="print head.json")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(fn=cmd_train_draft)
