"""Can OpenVINO run specrt's own graphs? Issue 28 item 4 names an OpenVINO backend behind the
backend seam as a lever; this is the cheapest form of one (OpenVINO's CPU plugin reading the ONNX
graphs an engine folder already has), measured before anything is built.

For each graph: OpenVINO's ONNX frontend reads and compiles it, or the ops it cannot convert are
printed; a graph that compiles is run with `--rows` rows of one token over `--context` cached
positions (random ids and K/V, the cache as plain inputs: no fixed capacity), on OpenVINO
(.venv-openvino, 2 threads, latency hint) and on ONNX Runtime (this venv, specrt's session
options), alternately, median of 20 calls a run.

    .venv/bin/python benchmarks/openvino_graphs.py [GRAPH.onnx ...] [--rows 1] [--context 150] [--runs 2]

Measured 2026-12-07 (2-core Zen 4, onnxruntime 1.32.0, OpenVINO 2026.4.1):

    artifacts/smollm2-int8row-gqa/batch/step.onnx  not converted: QuantizeLinear-21 (the per-row
        activation scale, a dynamic dimension), then ReduceMax-21, com.microsoft.MatMulIntegerToFloat,
        com.microsoft.SkipSimplifiedLayerNormalization (inputs typed from it)
    artifacts/smollm2-int4/batch/step.onnx         not converted: TensorScatter-24 (the rows cache write)
    artifacts/smollm2-int4/batch/prefill.onnx      as the int8row step (per-row QuantizeLinear)
    artifacts/smollm2-int4/batch/draft.onnx        compiles (8-bit MatMulNBits, GroupQueryAttention);
        1 row at 150 positions: OpenVINO 22.4-30.1 ms, ONNX Runtime 7.6-8.4 ms (x2.9-3.6, four runs);
        8 or 24 rows fail at run time inside OpenVINO's GroupQueryAttention translation
        ("[cpu]reshape: the shape of input data (8) conflicts with the reshape pattern (1)")
    artifacts/smollm2/target/decode.onnx           compiles (fp32, the cache a fixed 1088 positions):
        OpenVINO 72.9-76.6 ms, ONNX Runtime 22.2-22.3 ms (x3.3-3.4): the whole cache goes in and
        out of every call (docs/batching.md, the 2026-12 spike)

So an OpenVINO backend cannot reuse the folders' graphs: it would run OpenVINO's own export of the
model (its stateful form, its paged cache), another model with its own gates. Not part of
`make test`.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OPENVINO_PYTHON = ROOT / ".venv-openvino/bin/python"
DEFAULT = ["artifacts/smollm2-int8row-gqa/batch/step.onnx", "artifacts/smollm2-int4/batch/step.onnx",
           "artifacts/smollm2-int4/batch/prefill.onnx", "artifacts/smollm2-int4/batch/draft.onnx"]


def feeds(names: dict[str, int | None], rows: int, context: int) -> dict:
    """names: input name -> its cache dimension where the graph fixes one (a one-row graph's
    capacity: the cache is that long, `past_len` says how much of it holds positions)."""
    rng = np.random.default_rng(0)
    f = {"input_ids": rng.integers(0, 49152, (rows, 1)).astype(np.int64), "past_len": np.full(rows, context, np.int64),
         "logit_pos": np.zeros((rows, 1), np.int64)}
    for name in names:
        if name.startswith(("past_k_", "past_v_")):
            f[name] = (rng.standard_normal((rows, 3, names[name] or context, 64)) * 0.5).astype(np.float32)
    return {k: v for k, v in f.items() if k in names}


def timed(run) -> float:
    for _ in range(4):
        run()
    ts = []
    for _ in range(20):
        t = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1000


def on_openvino(path: str, rows: int, context: int) -> str:
    """In .venv-openvino: 'ms' on success, else the reason (the frontend's summary or the run's error)."""
    import openvino as ov
    core = ov.Core()
    try:
        model = core.read_model(path)
    except Exception as e:          # the frontend's own report: which ops it could not convert
        text = str(e)
        return "not converted: " + (text[text.find("Summary:") + 8:].strip() if "Summary:" in text else text[-400:])
    compiled = core.compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 2, "PERFORMANCE_HINT": "LATENCY"})
    req = compiled.create_infer_request()
    f = feeds({i.get_any_name(): (i.get_partial_shape()[2].get_length() if i.get_partial_shape().rank.get_length() == 4
                                  and i.get_partial_shape()[2].is_static else None) for i in compiled.inputs}, rows, context)
    try:
        return f"{timed(lambda: req.infer(f)):.2f}"
    except Exception as e:
        return "fails at run time: " + " ".join(str(e).split())[-300:]


def on_onnxruntime(path: str, rows: int, context: int) -> float:
    import onnxruntime as ort

    from specrt.runtime.backends.ort_cpu import session_options
    s = ort.InferenceSession(path, session_options(2), providers=["CPUExecutionProvider"])
    f = feeds({i.name: (i.shape[2] if len(i.shape) == 4 and isinstance(i.shape[2], int) else None)
               for i in s.get_inputs()}, rows, context)
    return timed(lambda: s.run(None, f))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("graphs", nargs="*", default=DEFAULT)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=150, help="cached positions a row")
    ap.add_argument("--runs", type=int, default=2, help="alternate the two runtimes this many times")
    ap.add_argument("--openvino-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.openvino_child:
        print(on_openvino(a.graphs[0], a.rows, a.context))
        return 0
    if not OPENVINO_PYTHON.exists():
        raise SystemExit(f"{OPENVINO_PYTHON} missing: make venv-openvino")
    for g in a.graphs:
        print(f"{g}  ({a.rows} row(s) x 1 token at {a.context} positions)", flush=True)
        for _ in range(a.runs):
            ov = subprocess.run([str(OPENVINO_PYTHON), __file__, g, "--rows", str(a.rows), "--context", str(a.context),
                                 "--openvino-child"], capture_output=True, text=True, cwd=ROOT)
            said = ov.stdout.strip().splitlines()[-1] if ov.stdout.strip() else f"exited {ov.returncode}: {ov.stderr[-300:]}"
            try:
                ov_ms = float(said)
            except ValueError:
                print(f"  OpenVINO: {said}")
                break
            ort_ms = on_onnxruntime(g, a.rows, a.context)
            print(f"  OpenVINO {ov_ms:.2f} ms, ONNX Runtime {ort_ms:.2f} ms (OpenVINO / ONNX Runtime x{ov_ms / ort_ms:.2f})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
