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
specrt's rows measure the model each folder's requests run (its batched model for a `--batch`
folder), through `specrt quality`'s teacher forcing (runtime/batch/forced.py) and checks; the
reference runs its one-row graphs. `--batched FOLDERS`: more engine folders as extra rows, measured
the same way (e.g. artifacts/smollm2-int8row).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from common import REFERENCE, SYSTEMS, Worker, eval_prompts

SPECRT_ROWS = ("specrt-int8-plain", "specrt-int4-plain")
GENAI_ROWS = ("genai-int4", "genai-fp32")


def quality(a) -> dict:
    from specrt.tools.quality import _forced, _greedy, kl_rows, runs
    from specrt.runtime import SpeculativeGenerator

    for name in (REFERENCE, *SPECRT_ROWS, *GENAI_ROWS):
        if SYSTEMS[name].missing:
            raise SystemExit(f"{name}: {SYSTEMS[name].missing}")
    # as specrt quality opens them: the reference on its one-row graphs, every other folder on the
    # model its requests run (engine="auto": a --batch folder's batched model)
    load = lambda path, engine="auto": SpeculativeGenerator(path, methods=("plain", "lookup"),  # noqa: E731
                                                            threads=a.threads, engine=engine)
    ref = load(SYSTEMS[REFERENCE].path, "one-row")
    specrt_rows = {n: load(SYSTEMS[n].path) for n in SPECRT_ROWS}
    specrt_rows |= {f"batched {Path(f).name}": load(f) for f in filter(None, a.batched.split(","))}
    genai = {n: Worker("genai", SYSTEMS[n].path, SYSTEMS[n].python, a.threads) for n in GENAI_ROWS}
    prompts = eval_prompts(a.prompts, a.prompt_file)
    eos = set(ref.tokenizer.eos_token_ids)
    names = [*SPECRT_ROWS, *GENAI_ROWS, *[n for n in specrt_rows if n not in SPECRT_ROWS]]
    stats = {n: {"agree": 0, "positions": 0, "kl": 0.0, "delta": 0.0, "exact": 0} for n in names}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for j, p in enumerate(prompts):
                ids = ref.encode_prompt(p.text, chat=True)
                toks, lps = _greedy(ref, ids, a.new_tokens, eos)
                ref_rows = _forced("the reference", ref, ids, toks, toks, lps)
                for n in names:
                    if n in specrt_rows:
                        g = specrt_rows[n]
                        own, lps = _greedy(g, ids, a.new_tokens, eos)
                        got = _forced(n, g, ids, toks, own, lps)
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
                    s["exact"] += own == toks
                print(f"prompt {j + 1:>2}/{len(prompts)} ({p.kind}, {len(ids)} tokens, {len(toks)} reference tokens)",
                      flush=True)
    finally:
        for w in genai.values():
            w.close()
    rows = [{"system": n, "label": SYSTEMS[n].label.replace(" plain", "") if n in SYSTEMS else n, "top1_agreement": s["agree"] / s["positions"],
             "positions": s["positions"], "mean_kl": s["kl"] / s["positions"], "max_abs_logit_delta": s["delta"],
             "greedy_exact_match": s["exact"], "greedy_prompts": len(prompts),
             "runs": runs(specrt_rows[n]) if n in specrt_rows else None}
            for n, s in stats.items()]
    report = {"reference": REFERENCE, "prompts": [p.id for p in prompts], "new_tokens": a.new_tokens,
              "how": "teacher-forced on specrt fp32's greedy continuation (chat template, stops after an EOS), "
                     "specrt's rows through the model each folder's requests run; "
                     "KL(fp32 || variant) per position; exact = the variant's own greedy output equals fp32's",
              "variants": rows}
    w = max(len(r["label"]) for r in rows)
    head = f"{'system':<{w}} {'top-1':>6} {'mean KL':>9} {'max|dlogit|':>11} {'greedy =':>9} {'positions':>9}"
    print(f"\nfaithfulness to specrt fp32 (= transformers): {len(prompts)} held-out prompts x {a.new_tokens} tokens, "
          "teacher-forced on fp32's greedy text\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r['label']:<{w}} {r['top1_agreement']:>6.3f} {r['mean_kl']:>9.5f} {r['max_abs_logit_delta']:>11.3f} "
              + f"{r['greedy_exact_match']:>4}/{r['greedy_prompts']:<4} {r['positions']:>9}"
              + (f"  {r['runs']}" if r["runs"] else ""))
    return report

