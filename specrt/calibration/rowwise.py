"""Row-wise int8: per-channel int8 weights, and every activation row quantized on its own at
run time, so a row's result depends on that row alone, bit for bit.

Each MatMul whose B is a constant [K, N] weight becomes:

    x [.., K] ─ Abs ─ ReduceMax(-1) ─ Max(tiny) ─ Mul(1/127) ─ s [.., 1]     one scale per row
    x, s, Expand(128, Shape(s)) ─ QuantizeLinear(axis -1, block K) ─ xq [.., K]
                                    = round_half_even(x / s) + 128 as uint8: symmetric, stored as u8 - 128
    xq, Wq [K, N] int8, s, ws [N] ─ com.microsoft.MatMulIntegerToFloat(a_zero_point=128) ─ y [.., N]
                                    (y = s * ws * Σ_k (xq - 128) Wq, accumulated in int32)

QuantizeLinear in its blocked form (opset 21; one block = one row, so the scale is [.., 1]) does
in one pass what Div, Round, Add(128) and Cast(uint8) did in four (the form before 2026-12-06):
the same bits (x / s in [-127, 127], rounded half to even, then + 128; checked on SmolLM2's
int8row step graph at 1x1..24x1, 8x5 and prompt chunks: logits bit-identical), x0.85-0.87 of a
64-token prompt chunk's time and of an 8-row step, x0.94 of a 24-row step, level at one row
(2 cores, AVX-512 VNNI, 2026-12-06).

Why this and not the builds' quantizers (batch invariance, issue 15):
- the integer sum is exact (7-bit weights: see WEIGHT_MAX), so whichever kernel MLAS picks for
  the call (AMX tiles, AVX-512 VNNI, AVX2, the one-row path) and however many rows share it,
  each row's output is the same bits:
  decode (T=1), verify (T=k+1) and any batch agree by construction;
- `quantize_dynamic` quantizes activations with ONE scale per tensor: a row's result depends
  on the other rows of the call (its output is neither batch- nor window-invariant);
- MatMulNBits with int8 compute (accuracy_level 4) rounds one row (M=1) and several rows
  differently (calibration/rows.py), and its cost grows about linearly with the rows;
- MLAS's u8 x s8 GEMM runs on AMX tiles where the CPU has them: rows are nearly free
  (benchmarks/batch_kernels.py measures it).
The cost: 5 small ops per MatMul besides it (a few microseconds each), 7 for the first
activation of each row shape (its zero point's Shape and Expand).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS = "com.microsoft"
OPSET = 21          # ReduceMax with axes as an input (18); blocked QuantizeLinear (21)


# |q| <= 63 (7 bits): on x86 CPUs without VNNI (AVX2 only: AMD Zen 1-3, Intel before Cascade
# Lake) MLAS's u8 x s8 kernel adds pairs of products in int16 (vpmaddubsw), which saturates once
# 255 * |w| * 2 > 32767: with |w| <= 127 a sum was off by up to 17% there (measured on an AVX2
# EPYC), silently. 255 * 63 * 2 = 32130 fits, so the integer sum is exact on every CPU (the
# same reason as quantize_dynamic's reduce_range).
WEIGHT_MAX = 63


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[K, N] float -> (int8 [K, N], scale [N]): symmetric per output channel, |q| <= WEIGHT_MAX."""
    scale = np.abs(w).max(axis=0) / WEIGHT_MAX
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.clip(np.round(w / scale), -WEIGHT_MAX, WEIGHT_MAX).astype(np.int8), scale


def quantize_model(model: onnx.ModelProto, exclude: set[str] = frozenset()) -> int:
    """Rewrite, in place, every MatMul whose B is a 2-D float initializer (and whose name is not
    in `exclude`) as the pattern of the module docstring. Returns how many were rewritten."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    shared = [numpy_helper.from_array(np.array([-1], np.int64), "rowwise.axes"),
              numpy_helper.from_array(np.array(1e-30, np.float32), "rowwise.tiny"),
              numpy_helper.from_array(np.array(1.0 / 127.0, np.float32), "rowwise.inv127"),
              numpy_helper.from_array(np.array(128, np.uint8), "rowwise.zero_point")]
    weights: dict[str, tuple[str, str]] = {}        # fp32 weight -> (int8 weight, scale), once per weight
    rows = _row_shapes(model)
    zero_points: dict[tuple, str] = {}              # an activation's row shape -> its Expanded zero point
    nodes, count = [], 0
    for n in g.node:
        w = inits.get(n.input[1]) if n.op_type == "MatMul" and n.domain == "" and len(n.input) == 2 else None
        if w is None or len(w.dims) != 2 or w.data_type != onnx.TensorProto.FLOAT or n.name in exclude:
            nodes.append(n)
            continue
        if w.name not in weights:
            q, s = quantize_weight(numpy_helper.to_array(w))
            g.initializer.extend([numpy_helper.from_array(q, f"{w.name}.int8"),
                                  numpy_helper.from_array(s, f"{w.name}.scale")])
            weights[w.name] = (f"{w.name}.int8", f"{w.name}.scale")
        key = rows.get(n.input[0])
        made = _pattern(n, *weights[w.name], k=int(w.dims[0]), zero_point=zero_points.get(key))
        if key is not None and key not in zero_points:
            zero_points[key] = made[-2].input[2]
        nodes += made
        count += 1
    del g.node[:]
    g.node.extend(nodes)
    if count:
        g.initializer.extend(shared)
        used = {i for n in g.node for i in n.input}
        keep = [i for i in g.initializer if i.name in used]
        del g.initializer[:]
        g.initializer.extend(keep)
        _set_opsets(model)
    return count


def _pattern(n: onnx.NodeProto, wq: str, ws: str, k: int, zero_point: str | None = None) -> list[onnx.NodeProto]:
    """The nodes that replace MatMul n. zero_point: the [.., 1] zero point tensor an earlier
    pattern made for activations of the same row shape (None: make one here)."""
    x, y, p = n.input[0], n.output[0], (n.name or n.output[0]) + ".rowwise"
    zp = zero_point or f"{p}.zp"
    return [helper.make_node("Abs", [x], [f"{p}.abs"], name=f"{p}.abs"),
            helper.make_node("ReduceMax", [f"{p}.abs", "rowwise.axes"], [f"{p}.max"], name=f"{p}.max", keepdims=1),
            helper.make_node("Max", [f"{p}.max", "rowwise.tiny"], [f"{p}.max1"], name=f"{p}.max1"),
            helper.make_node("Mul", [f"{p}.max1", "rowwise.inv127"], [f"{p}.scale"], name=f"{p}.scale"),
            # the zero point has the scale's shape (blocked quantization): 128 in every row; made
            # once for all activations of one row shape (~240 fewer nodes in SmolLM2's step graph:
            # x0.88-0.92 of a one-row step)
            *([] if zero_point else [
                helper.make_node("Shape", [f"{p}.scale"], [f"{p}.shape"], name=f"{p}.shape"),
                helper.make_node("Expand", ["rowwise.zero_point", f"{p}.shape"], [zp], name=f"{p}.zp")]),
            helper.make_node("QuantizeLinear", [x, f"{p}.scale", zp], [f"{p}.q"], name=f"{p}.q",
                             axis=-1, block_size=k),
            helper.make_node("MatMulIntegerToFloat", [f"{p}.q", wq, f"{p}.scale", ws, "rowwise.zero_point"], [y],
                             name=f"{p}.matmul", domain=MS)]


def _row_shapes(model: onnx.ModelProto) -> dict[str, tuple]:
    """Tensor name -> its shape but the last axis, where ONNX shape inference names every axis
    (a number or a symbolic name of the graph's inputs, never an unknown): tensors with equal
    keys have equal row shapes at run time. Inferred on a copy without the weights' data."""
    g = model.graph
    names = {x.name for x in g.input}
    weights = [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)) for i in g.initializer
               if i.name not in names]
    light = helper.make_model(helper.make_graph(list(g.node), g.name, list(g.input) + weights, list(g.output),
                                                value_info=list(g.value_info)),
                              opset_imports=list(model.opset_import), ir_version=model.ir_version)
    light.functions.extend(model.functions)
    try:
        inferred = onnx.shape_inference.infer_shapes(light)
    except Exception:           # no sharing: every pattern makes its own zero point
        return {}
    out = {}
    for v in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = v.type.tensor_type.shape.dim
        key = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims[:-1])
        if dims and all(isinstance(d, int) or (d and not d.startswith("unk__")) for d in key):
            out[v.name] = key
    return out


def _set_opsets(model: onnx.ModelProto) -> None:
    have = {o.domain: o for o in model.opset_import}
    if "" in have and have[""].version < OPSET:
        have[""].version = OPSET
    if MS not in have:
        model.opset_import.append(helper.make_opsetid(MS, 1))
