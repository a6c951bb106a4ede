"""`benchmarks/run_peers.py quality`: how faithful each system is to the fp32 target, on
`specrt quality`'s measures and prompts, with onnxruntime-genai's models as extra rows.

Per held-out prompt (chat template), specrt's fp32 target decodes greedily for N tokens
(stopping after an EOS); every variant is then teacher-forced on those tokens (its N rows
of logits: top-1 agreement, KL(fp32 || variant), max |delta logit|) and run free (its own
greedy output == the fp32 tokens: exact match). specrt's rows use specrt's own functions
(tools.quality); onnxruntime-genai's rows come from its worker, which feeds the prompt
and then one token at a time through onnxruntime-genai's Generator and returns the logits
of each step, the same rows specrt's teacher forcing reads (prefill, then T=1 steps).
genai fp32 is a check of this harness: it should agree with specrt fp32 almost exactly.
`--batched FOLDERS`: rows for engine folders' batched models (`specrt build --batch`, e.g.
`--batch-block-size 64`), teacher-forced one row per call through OrtBatchModel (prefill chunks,
then one-token steps: what the batched engine runs); their free greedy runs are not made (-).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from common import REFERENCE, SYSTEMS, Worker, eval_prompts

SPECRT_ROWS = ("specrt-int8-plain", "specrt-int4-plain")
GENAI_ROWS = ("genai-int4", "genai-fp32")


def quality(a) -> dict:
    from specrt.tools.quality import _greedy, _reference_run, _teacher_forced, kl_rows
    from specrt.runtime import SpeculativeGenerator

    for name in (REFERENCE, *SPECRT_ROWS, *GENAI_ROWS):
        if SYSTEMS[name].missing:
            raise SystemExit(f"{name}: {SYSTEMS[name].missing}")
    # the one-row graphs (engine="one-row", as specrt quality opens them): the teacher-forced passes step
    # them directly; a --batch folder's default engine is its batched model, which has no .target
    load = lambda s: SpeculativeGenerator(s.path, methods=("plain", "lookup"), threads=a.threads,  # noqa: E731
                                          engine="one-row")
    ref = load(SYSTEMS[REFERENCE])
    specrt_rows = {n: load(SYSTEMS[n]) for n in SPECRT_ROWS}
    genai = {n: Worker("genai", SYSTEMS[n].path, SYSTEMS[n].python, a.threads) for n in GENAI_ROWS}
    prompts = eval_prompts(a.prompts, a.prompt_file)
    eos = set(ref.tokenizer.eos_token_ids)
    batched = {f"batched {Path(f).name}": _batched_model(Path(f)) for f in filter(None, a.batched.split(","))}
    names = [*SPECRT_ROWS, *GENAI_ROWS, *batched]
    stats = {n: {"agree": 0, "positions": 0, "kl": 0.0, "delta": 0.0, "exact": 0} for n in names}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for j, p in enumerate(prompts):
                ids = ref.encode_prompt(p.text, chat=True)
                ref_rows, toks = _reference_run(ref.target, ref.shapes.prefill_chunk, ids, a.new_tokens, eos)
                for n in names:
                    if n in batched:
                        got, own = _batched_teacher_forced(batched[n], ids, toks), None
                    elif n in specrt_rows:
                        g = specrt_rows[n]
                        got = _teacher_forced(g.target, g.shapes.prefill_chunk, ids, toks)
                        own = _greedy(g, ids, a.new_tokens, eos)
                    else:
                        out = str(Path(tmp) / "rows.npy")
                        genai[n].ask(op="logits", ids=ids, tokens=toks, out=out)
                        got = np.load(out)
                        own = genai[n].ask(op="generate", ids=ids, n=a.new_tokens, eos=sorted(eos))["tokens"]
                    assert got.shape == ref_rows.shape, (n, got.shape, ref_rows.shape)
                    s = stats[n]
                    s["agree"] += int((got.argmax(-1) == np.asarray(toks)).sum())
                    s["positions"] += len(toks)
                    s["kl"] += float(kl_rows(ref_rows, got).sum())
                    s["delta"] = max(s["delta"], float(np.abs(got - ref_rows).max()))
                    s["exact"] += own == toks if own is not None else 0
                print(f"prompt {j + 1:>2}/{len(prompts)} ({p.kind}, {len(ids)} tokens, {len(toks)} reference tokens)",
                      flush=True)
    finally:
        for w in genai.values():
            w.close()
    rows = [{"system": n, "label": SYSTEMS[n].label.replace(" plain", "") if n in SYSTEMS else n, "top1_agreement": s["agree"] / s["positions"],
             "positions": s["positions"], "mean_kl": s["kl"] / s["positions"], "max_abs_logit_delta": s["delta"],
             "greedy_exact_match": s["exact"] if n not in batched else None, "greedy_prompts": len(prompts)}
            for n, s in stats.items()]
    report = {"reference": REFERENCE, "prompts": [p.id for p in prompts], "new_tokens": a.new_tokens,
              "how": "teacher-forced on specrt fp32's greedy continuation (chat template, stops after an EOS); "
                     "KL(fp32 || variant) per position; exact = the variant's own greedy output equals fp32's",
              "variants": rows}
    w = max(len(r["label"]) for r in rows)
    head = f"{'system':<{w}} {'top-1':>6} {'mean KL':>9} {'max|dlogit|':>11} {'greedy =':>9} {'positions':>9}"
    print(f"\nfaithfulness to specrt fp32 (= transformers): {len(prompts)} held-out prompts x {a.new_tokens} tokens, "
          "teacher-forced on fp32's greedy text\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['label']:<{w}} {r['top1_agreement']:>6.3f} {r['mean_kl']:>9.5f} {r['max_abs_logit_delta']:>11.3f} "
              + (f"{r['greedy_exact_match']:>4}/{r['greedy_prompts']:<4}" if r["greedy_exact_match"] is not None
                 else f"{'-':>9}") + f" {r['positions']:>9}")
    return report


def _batched_model(folder: Path):
    from specrt import manifest as mf
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    man = mf.load(folder)
    if man.batch is None:
        raise SystemExit(f"{folder} has no batched model: build it with --batch")
    return OrtBatchModel(folder, man.batch, man.shapes, rows=1), man.shapes.prefill_chunk


def _batched_teacher_forced(model_chunk, ids, toks) -> np.ndarray:
    """[len(toks), V]: row i is the logits that predict toks[i] (the prompt's last position, then
    one-token steps on the reference tokens), one row per call as a request alone runs."""
    model, C = model_chunk
    for s in range(0, len(ids), C):
        chunk = ids[s:s + C]
        last = model.step("prefill", np.array([chunk], np.int64), np.array([s], np.int64), 0,
                          np.array([[len(chunk) - 1]], np.int64), pad_start=0)[0, 0].copy()
    rows = [last]
    for j, t in enumerate(toks[:-1]):
        rows.append(model.step("step", np.array([[t]], np.int64), np.array([len(ids) + j], np.int64), 0,
                               pad_start=0)[0, 0].copy())
    return np.stack(rows)
