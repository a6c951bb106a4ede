"""One layer's GroupQueryAttention over an fp32 cache against an int8 one, on ONNX Runtime's CPU
kernel: the lever left for many requests at once and for long contexts (issue 28).

ONNX Runtime's `com.microsoft.GroupQueryAttention` takes an int8 cache (`past_key`/`past_value`
int8, `kv_cache_bit_width=8`, `k_quant_type`/`v_quant_type` PER_TENSOR or PER_CHANNEL, with
static fp32 scales `k_scale`/`v_scale`: [1] or [kv_heads, 1, head_dim]) and quantizes the new
K/V itself. benchmarks/kv_int8_attention.py built an int8 attention out of plain ops and lost
most of the gain to the extra ops; this one is the fused kernel. One decode step (one token a
row) of SmolLM2's shape (9 heads, 3 kv heads, head_dim 64), the cache bound in place (present =
past, a fixed capacity, as a `--batch-attention gqa` folder binds it), interleaved rounds, median.
Timing only: random K/V and made-up scales, so it says nothing about faithfulness (calibrated
scales, the gates and `specrt quality` would; the folder's cache dtype and every graph sharing
the cache would change).

Measured 2026-12-07 (2-core Zen 4, AVX-512 VNNI, onnxruntime 1.32.0, capacity 1088), int8 per
channel against fp32, the ratio of medians in four runs (three of this script, one of its draft):

    rows x 1 at positions   int8 per channel / fp32        fp32 ms a layer
    8 at 100                x0.52, x0.71, x1.04, x1.16     0.106-0.244
    8 at 300                x0.66, x0.77, x1.07            0.361-0.666
    24 at 150               x0.53, x0.64, x0.87, x1.45     0.363-0.932
    8 at 1000               x0.27, x0.80, x0.88, x0.92     1.213-5.105
    24 at 600               x0.39, x0.41, x0.86            2.432-5.210
    1 at 1000               x1.06, x1.70, x2.03            0.082-0.215

The fp32 kernel's time is bimodal from run to run (24 rows at 600: 2.4 or 5.2 ms), the int8 one
steadier (2.04-2.11 ms there): int8 pays with many rows at long contexts, costs more for one
row, and is within noise at chat contexts. Per tensor scales time like per channel ones.

    .venv/bin/python benchmarks/gqa_int8_cache.py [--shapes 8x100,8x300,24x150,8x1000,1x1000] [--capacity 1088]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper as h

H, KVH, D = 9, 3, 64      # SmolLM2-135M
FORMS = (("fp32", None), ("int8 per tensor", "PER_TENSOR"), ("int8 per channel", "PER_CHANNEL"))


def session(B: int, capacity: int, quant: str | None, threads: int) -> ort.InferenceSession:
    ct = TP.FLOAT if quant is None else TP.INT8
    vi = h.make_tensor_value_info
    ins = [vi("q", TP.FLOAT, [B, 1, H * D]), vi("k", TP.FLOAT, [B, 1, KVH * D]), vi("v", TP.FLOAT, [B, 1, KVH * D]),
           vi("pk", ct, [B, KVH, capacity, D]), vi("pv", ct, [B, KVH, capacity, D]),
           vi("seqlens", TP.INT32, [B]), vi("total", TP.INT32, [1])]
    inputs, inits, attrs = ["q", "k", "v", "pk", "pv", "seqlens", "total"], [], dict(num_heads=H, kv_num_heads=KVH)
    if quant is not None:
        shape = [1] if quant == "PER_TENSOR" else [KVH, 1, D]
        n = int(np.prod(shape))
        inputs += ["", "", "", "", "", "ks", "vs"]        # cos, sin, position_ids, bias, head_sink: none
        inits = [h.make_tensor("ks", TP.FLOAT, shape, [0.02] * n), h.make_tensor("vs", TP.FLOAT, shape, [0.02] * n)]
        attrs.update(k_quant_type=quant, v_quant_type=quant, kv_cache_bit_width=8)
    node = h.make_node("GroupQueryAttention", inputs, ["o", "prk", "prv"], domain="com.microsoft", **attrs)
    graph = h.make_graph([node], "gqa", ins, [vi("o", TP.FLOAT, None), vi("prk", ct, None), vi("prv", ct, None)],
                         initializer=inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def binding(s: ort.InferenceSession, B: int, capacity: int, positions: int, quant: str | None):
    """Inputs and outputs bound once, the cache in place (present = past)."""
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((B, KVH, capacity, D))
    cache = cache.astype(np.float32) if quant is None else np.clip(cache * 40, -127, 127).astype(np.int8)
    feeds = {"q": rng.standard_normal((B, 1, H * D), np.float32), "k": rng.standard_normal((B, 1, KVH * D), np.float32),
             "v": rng.standard_normal((B, 1, KVH * D), np.float32), "seqlens": np.full(B, positions, np.int32),
             "total": np.array([positions + 1], np.int32)}
    b, hold = s.io_binding(), []
    for name, arr in feeds.items():
        v = ort.OrtValue.ortvalue_from_numpy(arr)
        hold.append(v)
        b.bind_ortvalue_input(name, v)
    for past, present in (("pk", "prk"), ("pv", "prv")):
        v = ort.OrtValue.ortvalue_from_numpy(cache.copy())
        hold.append(v)
        b.bind_ortvalue_input(past, v)
        b.bind_ortvalue_output(present, v)
    out = ort.OrtValue.ortvalue_from_numpy(np.zeros((B, 1, H * D), np.float32))
    hold.append(out)
    b.bind_ortvalue_output("o", out)
    return b, hold


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8x100,8x300,24x150,8x1000,1x1000", help="rows x positions, comma-separated")
    ap.add_argument("--capacity", type=int, default=1088, help="cache positions a row (the folder's kv capacity)")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    print(f"ms a layer, median of {a.rounds} interleaved rounds, capacity {a.capacity}, {a.threads} threads")
    for shape in a.shapes.split(","):
        B, positions = (int(x) for x in shape.split("x"))
        runs = {}
        for name, quant in FORMS:
            s = session(B, a.capacity, quant, a.threads)
            runs[name] = (s, binding(s, B, a.capacity, positions, quant))
        times: dict[str, list[float]] = {name: [] for name in runs}
        for r in range(a.rounds + 5):
            for name, (s, (b, _)) in runs.items():
                t0 = time.perf_counter()
                s.run_with_iobinding(b)
                if r >= 5:
                    times[name].append(time.perf_counter() - t0)
        base = float(np.median(times["fp32"]))
        print(f"{B:>3} rows at {positions:>5} positions: " + "  ".join(
            f"{name} {1e3 * float(np.median(t)):.3f} (x{float(np.median(t)) / base:.2f})" for name, t in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
