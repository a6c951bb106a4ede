"""Two edits of a folder's batched "rows" step graph that look like they should pay at many rows
and long contexts, timed against the graph as built, calls interleaved in one process:

    base      the graph as built: each layer copies the first L cache positions of every row (the
              `Slice` of `present[:, :, :L]`, ONNX Runtime has no strided views), then attends
    no-slice  the `Slice` removed and the cache bound at exactly L positions (what a cache that
              grows in blocks of 64 positions would bind): the attention MatMuls read the cache
    fp16-kv   an fp16 cache (half the bytes): `Cast` to fp16 before `TensorScatter`, `Cast` to fp32
              after the `Slice` (not bit-exact: another model; timed only)

    .venv/bin/python benchmarks/attention_variants.py artifacts/smollm2-int8row [--rounds 14]

The edited graphs are written to a temporary folder beside the engine folder (the weights file
hard-linked: ONNX Runtime reads external data only from the graph's own folder) and removed at
the end. Random caches and tokens; the speed of a step does not depend on them. Each shape's
calls alternate A-B / B-A; the first two rounds are dropped; medians in ms and ratios to base.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specrt.runtime.backends.ort_cpu import session_options  # noqa: E402

SHAPES = ((24, 1, 150), (24, 1, 600), (8, 1, 200), (8, 5, 300), (1, 1, 300), (1, 64, 896))   # rows, T, context
KV_BLOCK = 64


def _cache_tensors(g) -> list:
    return [t for t in list(g.input) + list(g.output) if t.name.startswith(("past_k_", "past_v_", "present_k_",
                                                                              "present_v_"))]


def _prefix_slices(g) -> list:
    """The Slice nodes that read a TensorScatter's output: the copy of each row's first L positions."""
    made_by = {o: n for n in g.node for o in n.output}
    return [n for n in g.node if n.op_type == "Slice" and n.input[0] in made_by
            and made_by[n.input[0]].op_type == "TensorScatter"]


def no_slice(m: onnx.ModelProto) -> onnx.ModelProto:
    g = m.graph
    drop = _prefix_slices(g)
    rename = {n.output[0]: n.input[0] for n in drop}
    for n in drop:
        g.node.remove(n)
    for n in g.node:
        n.input[:] = [rename.get(x, x) for x in n.input]
    for t in _cache_tensors(g):
        t.type.tensor_type.shape.dim[2].ClearField("dim_value")
        t.type.tensor_type.shape.dim[2].dim_param = "kv_len"
    del g.value_info[:]
    return m


def fp16_kv(m: onnx.ModelProto) -> onnx.ModelProto:
    g = m.graph
    for n in [n for n in g.node if n.op_type == "TensorScatter"]:
        upd = n.input[1]
        g.node.insert(list(g.node).index(n), helper.make_node("Cast", [upd], [upd + ".f16"], to=TensorProto.FLOAT16))
        n.input[1] = upd + ".f16"
    for n in _prefix_slices(g):
        out = n.output[0]
        n.output[0] = out + ".f16"
        g.node.insert(list(g.node).index(n) + 1, helper.make_node("Cast", [out + ".f16"], [out], to=TensorProto.FLOAT))
    for t in _cache_tensors(g):
        t.type.tensor_type.elem_type = TensorProto.FLOAT16
    del g.value_info[:]
    return m


def bind(sess, B: int, T: int, ctx: int, L: int, M: int, dtype, rng):
    b, hold = sess.io_binding(), []

    def value(a):
        v = ort.OrtValue.ortvalue_from_numpy(a)
        hold.append(v)
        return v
    names = {i.name for i in sess.get_inputs()}
    for name in sorted(n for n in names if n.startswith(("past_k_", "past_v_"))):
        v = value((rng.standard_normal((B, sess_kv_heads(sess), M, sess_head_dim(sess)),
                                       dtype=np.float32) * 0.3).astype(dtype))
        b.bind_ortvalue_input(name, v)
        b.bind_ortvalue_output(name.replace("past_", "present_"), v)
    feeds = {"input_ids": rng.integers(0, 1000, (B, T)), "past_len": np.full(B, ctx),
             "logit_pos": np.tile(np.arange(T), (B, 1)), "kv_pos": np.arange(L)}
    for k, a in feeds.items():
        if k in names:
            b.bind_ortvalue_input(k, value(a.astype(np.int64)))
    vocab = sess.get_outputs()[0].shape[-1]
    b.bind_ortvalue_output("logits", value(np.zeros((B, T, vocab), np.float32)))
    return b, hold


def sess_kv_heads(sess) -> int:
    return next(i.shape[1] for i in sess.get_inputs() if i.name.startswith("past_k_"))


def sess_head_dim(sess) -> int:
    return next(i.shape[3] for i in sess.get_inputs() if i.name.startswith("past_k_"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("engines", type=Path)
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    man = json.loads((a.engines / "manifest.json").read_text())
    batch = man["models"].get("batch")
    if batch is None or batch["source"].get("attention") != "rows":
        raise SystemExit(f"{a.engines}: no batched model with 'rows' attention (specrt build --batch)")
    step = a.engines / batch["graphs"]["step"]["file"]
    weights = a.engines / batch["weights"]["file"]
    tmp = Path(tempfile.mkdtemp(prefix=".attention-variants-", dir=a.engines.resolve().parent))
    try:
        try:
            os.link(weights, tmp / weights.name)
        except OSError:
            shutil.copy(weights, tmp / weights.name)
        files = {"base": step}
        for name, edit in (("no-slice", no_slice), ("fp16-kv", fp16_kv)):
            files[name] = tmp / f"{name}.onnx"
            onnx.save(edit(onnx.load(str(step), load_external_data=False)), str(files[name]))
        sessions = {k: ort.InferenceSession(str(f), session_options(a.threads), providers=["CPUExecutionProvider"])
                    for k, f in files.items()}
        cap = sessions["base"].get_inputs()
        M = next(i.shape[2] for i in cap if i.name.startswith("past_k_"))
        rng = np.random.default_rng(0)
        print(f"{a.engines}: batched step graph, {a.rounds} interleaved rounds, medians (ms), ratio to base")
        for B, T, ctx in SHAPES:
            L = min(-(-(ctx + T) // KV_BLOCK) * KV_BLOCK, M)
            runs = {"base": bind(sessions["base"], B, T, ctx, L, M, np.float32, rng),
                    "no-slice": bind(sessions["no-slice"], B, T, ctx, L, L, np.float32, rng),
                    "fp16-kv": bind(sessions["fp16-kv"], B, T, ctx, L, M, np.float16, rng)}
            times = {k: [] for k in runs}
            order = list(runs)
            for r in range(a.rounds):
                for k in (order if r % 2 else order[::-1]):
                    t0 = time.perf_counter()
                    sessions[k].run_with_iobinding(runs[k][0])
                    times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v[2:]) * 1e3 for k, v in times.items()}
            print(f"  {B:2d} rows x {T:2d} at {ctx:4d} positions (L {L:4d}): base {med['base']:6.1f}  "
                  f"no-slice {med['no-slice']:6.1f} (x{med['no-slice'] / med['base']:.2f})  "
                  f"fp16-kv {med['fp16-kv']:6.1f} (x{med['fp16-kv'] / med['base']:.2f})", flush=True)
            del runs
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
