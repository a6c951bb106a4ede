"""One layer's attention of a batched decode step over an fp32 cache against an int8 cache, on
ONNX Runtime's CPU kernels: the lever left for many requests at once on an AVX2 CPU (issue 28).

A "rows" step graph's attention reads every row's K and V (fp32) once per layer: at 8 rows x
1000 positions it is ~30% of SmolLM2 int8row's step, ~28 GB/s, about what this machine's
memory gives (docs/benchmarks.md). OpenVINO's CPU plugin keeps its cache in u8 by default
(`KV_CACHE_PRECISION`). This measures what ONNX Runtime's int8 GEMM (MatMulIntegerToFloat) does
with a cache of int8 K/V and one fp32 scale per position and head (symmetric, |q| <= 63, as
calibration/rowwise.py's weights: AVX2's u8 x s8 products saturate past that):

    fp32   s = FusedMatMul(q, K, transB, alpha) + mask; p = Softmax(s); o = MatMul(p, V)
    int8   q -> per query row u8 (zero point 128) and scale; s = MatMulIntegerToFloat(q8, Kt8)
           x q scale x K scales (per position) x alpha + mask; p = Softmax(s);
           p x V scales (per position: folded into the probabilities) -> per row u8 and scale;
           o = MatMulIntegerToFloat(p8, V8) x p scale

K is kept transposed ([rows, kv heads, head_dim, positions]): the int8 GEMM reads it as its B.
Prints each form's time a layer (median of interleaved rounds) and the int8 form's error
against fp32 over the same (unquantized) K/V: a measurement for the planners, not a feature
(the cache layout, both graphs of a folder, the gates and `specrt quality` would change).

Measured 2026-12-07 (2-core AMD EPYC, AVX2 only; random K/V, so the error is only indicative):
8 rows x 1024 positions x0.88 of the fp32 form (555 -> 487 us a layer), 24 x 192 x0.98; the two
int8 GEMMs alone are x0.66 of the fp32 ones, and the quantization of q and of the probabilities
and the scale multiplications take the rest back. A quarter of the memory, little of the time:
OpenVINO's u8 cache is read inside its own fused attention kernel.

    .venv/bin/python benchmarks/kv_int8_attention.py [--rows 8] [--positions 1024] [--rounds 7]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

KVH, G, D = 3, 3, 64        # SmolLM2-135M: 3 kv heads, 9 query heads (3 a kv head), head_dim 64
QMAX = 63


def _session(nodes, inputs, outputs, inits=()):
    m = helper.make_model(helper.make_graph(nodes, "attention", inputs, outputs, initializer=list(inits)),
                          opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _vi(name, shape, t=TP.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def _row_quant(x: str, out: str, zero: int, top: int) -> tuple[list, list]:
    """Nodes: x [.., K] -> out (u8, per row: round(x / s) + zero), out + ".s" [.., 1] (s = max|x| / top)."""
    consts = [numpy_helper.from_array(np.array([-1], np.int64), f"{out}.axes"),
              numpy_helper.from_array(np.array(1e-30, np.float32), f"{out}.tiny"),
              numpy_helper.from_array(np.array(1.0 / top, np.float32), f"{out}.inv"),
              numpy_helper.from_array(np.array(zero, np.uint8), f"{out}.zp0")]
    nodes = [helper.make_node("Abs", [x], [f"{out}.abs"]),
             helper.make_node("ReduceMax", [f"{out}.abs", f"{out}.axes"], [f"{out}.max"], keepdims=1),
             helper.make_node("Max", [f"{out}.max", f"{out}.tiny"], [f"{out}.max1"]),
             helper.make_node("Mul", [f"{out}.max1", f"{out}.inv"], [f"{out}.s"]),
             helper.make_node("Shape", [f"{out}.s"], [f"{out}.shape"]),
             helper.make_node("Expand", [f"{out}.zp0", f"{out}.shape"], [f"{out}.zp"]),
             helper.make_node("QuantizeLinear", [x, f"{out}.s", f"{out}.zp"], [out], axis=-1, block_size=0)]
    return nodes, consts


def graphs(B: int, L: int):
    T = G          # one token a row: G query rows a kv head
    alpha = numpy_helper.from_array(np.array(D ** -0.5, np.float32), "alpha")
    fp32 = _session([helper.make_node("FusedMatMul", ["q", "K"], ["s"], domain="com.microsoft", transB=1,
                                      alpha=D ** -0.5),
                     helper.make_node("Add", ["s", "mask"], ["sm"]),
                     helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
                     helper.make_node("MatMul", ["p", "V"], ["o"])],
                    [_vi("q", [B, KVH, T, D]), _vi("K", [B, KVH, L, D]), _vi("V", [B, KVH, L, D]),
                     _vi("mask", [B, 1, T, L])], [_vi("o", [B, KVH, T, D])])
    qn, qc = _row_quant("q", "q8", 128, 127)
    pn, pc = _row_quant("pv", "p8", 0, 255)
    for nodes, k in ((qn, D), (pn, L)):        # blocked QuantizeLinear: one block = one row
        nodes[-1].attribute[-1].i = k
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    int8 = _session(qn + [helper.make_node("MatMulIntegerToFloat", ["q8", "Kt8", "one", "one", "q8.zp0"], ["raw"],
                                           domain="com.microsoft"),
                          helper.make_node("Mul", ["raw", "q8.s"], ["s1"]),
                          helper.make_node("Mul", ["s1", "ks"], ["s2"]),
                          helper.make_node("Mul", ["s2", "alpha"], ["s3"]),
                          helper.make_node("Add", ["s3", "mask"], ["sm"]),
                          helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
                          helper.make_node("Mul", ["p", "vs"], ["pv"])] + pn +
                    [helper.make_node("MatMulIntegerToFloat", ["p8", "V8", "one", "one"], ["o1"], domain="com.microsoft"),
                     helper.make_node("Mul", ["o1", "p8.s"], ["o"])],
                    [_vi("q", [B, KVH, T, D]), _vi("Kt8", [B, KVH, D, L], TP.INT8), _vi("ks", [B, KVH, 1, L]),
                     _vi("V8", [B, KVH, L, D], TP.INT8), _vi("vs", [B, KVH, 1, L]), _vi("mask", [B, 1, T, L])],
                    [_vi("o", [B, KVH, T, D])], qc + pc + [one, alpha])
    return fp32, int8


def quantize_cache(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[B, KVH, L, D] -> (int8 [B, KVH, L, D], scale [B, KVH, 1, L]): one scale a position and head."""
    s = np.maximum(np.abs(x).max(axis=-1), 1e-30) / QMAX
    return np.clip(np.round(x / s[..., None]), -QMAX, QMAX).astype(np.int8), s[:, :, None, :].astype(np.float32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args(argv)
    B, L = a.rows, a.positions
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, KVH, G, D)).astype(np.float32)
    K = rng.standard_normal((B, KVH, L, D)).astype(np.float32)
    V = rng.standard_normal((B, KVH, L, D)).astype(np.float32)
    mask = np.zeros((B, 1, G, L), np.float32)
    K8, ks = quantize_cache(K)
    V8, vs = quantize_cache(V)
    fp32, int8 = graphs(B, L)
    feeds = {"fp32": (fp32, {"q": q, "K": K, "V": V, "mask": mask}),
             "int8": (int8, {"q": q, "Kt8": np.ascontiguousarray(K8.transpose(0, 1, 3, 2)), "ks": ks, "V8": V8,
                             "vs": vs, "mask": mask})}
    times: dict[str, list[float]] = {k: [] for k in feeds}
    for _ in range(a.rounds):
        for k, (s, f) in feeds.items():
            s.run(None, f)
            t = time.perf_counter()
            for _ in range(20):
                s.run(None, f)
            times[k].append((time.perf_counter() - t) / 20 * 1e6)
    ref, got = (s.run(None, f)[0] for s, f in feeds.values())
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"attention of one layer, {B} rows x {G} query rows a kv head, {L} positions, 2 threads")
    print(f"  fp32 cache  {med['fp32']:8.1f} us  ({4 * 2 * B * KVH * L * D / 2 ** 20:.1f} MiB of K/V read)")
    print(f"  int8 cache  {med['int8']:8.1f} us  ({(2 * B * KVH * L * D + 8 * B * KVH * L) / 2 ** 20:.1f} MiB)  "
          f"x{med['int8'] / med['fp32']:.2f}")
    print(f"  int8 against fp32: max |delta| {np.abs(got - ref).max():.3g}, relative "
          f"{np.linalg.norm(got - ref) / np.linalg.norm(ref):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
