"""fp16 vs fp32 (and standard vs gqa) parity of a model's graphs on ONNX Runtime CPU.

    .venv/bin/python scripts/fp16_parity.py [MODEL] [--out DIR] [--tokens N]

MODEL defaults to the default SmolLM2 GGUF (`make model`). For each attention variant
(gqa, standard) it exports fp32 and fp16 graphs, checks the fp32 standard graphs against
transformers (export.parity), and compares fp16 with fp32 (builder/gates/precision.py: logit
delta against FP16_ATOL + FP16_RTOL * max|logit|, greedy agreement, first divergence and
its fp32 top-2 margin). Prints one JSON report. CPU only; GPU kernels are compared by
scripts/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from specrt.builder.config import DEFAULT_MODEL
    from specrt.driver import graph_set, greedy
    from specrt.builder.gates import precision
    from specrt.export import onnx_export, parity, sources
    from specrt.manifest import Shapes

    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=str(ROOT / DEFAULT_MODEL))
    ap.add_argument("--out", type=Path, default=Path("/tmp/specrt-fp16-parity"))
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    shapes = Shapes(batch=1, max_context=1024, prefill_chunk=64, k=4)
    lm = sources.load_source(args.model)
    prompt = [int(t) for t in lm.tokenizer.encode("The capital of France is Paris. The capital of Germany is")]
    report = {"model": str(args.model), "shapes": vars(shapes), "prompt_tokens": len(prompt)}
    ex = {}
    for att in ("gqa", "standard"):
        for prec in ("fp32", "fp16"):
            t0 = time.perf_counter()
            d = args.out / f"{att}-{prec}"
            ex[att, prec] = (d, onnx_export.export_model(lm, shapes, d, attention=att, precision=prec))
            report[f"export_seconds {att} {prec}"] = round(time.perf_counter() - t0, 1)
        d32, p32 = ex[att, "fp32"]
        report[f"{att} fp32 vs transformers"] = parity.check_parity(lm.model, d32, p32, shapes,
                                                                    rtol=lm.spec.parity_rtol)
        report[f"{att} fp16 vs fp32"] = precision.compare(d32, p32, *ex[att, "fp16"], shapes, prompt=prompt,
                                                          new_tokens=args.tokens)
    # the two fp32 variants greedily, from the same prompt
    runs = {att: greedy(graph_set(*ex[att, "fp32"], shapes.kv_capacity), prompt, args.tokens).tokens
            for att in ("gqa", "standard")}
    report["greedy fp32 standard == gqa"] = runs["gqa"] == runs["standard"]
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
