"""TensorRT's rules for an INT8 Q/DQ graph, checked before anything is written: zero points
0 and int8, weight scales per output channel on the MatMul/Gemm output axis, activation
scales per tensor. Uses `engines.tensorrt.qdq_problems` plus the checks it lacks."""
from __future__ import annotations

import onnx
from onnx import numpy_helper

from specrt.errors import ParityError


def rule_problems(model: onnx.ModelProto) -> list[str]:
    """`engines.tensorrt.qdq_problems` plus what it does not check: int8 zero points, weight
    scales on the output-channel axis of their MatMul/Gemm, activation scales scalar."""
    from specrt.engines.tensorrt import qdq_problems
    problems = list(qdq_problems(model))
    consts = {i.name: i for i in model.graph.initializer}
    consumers: dict[str, list] = {}
    for n in model.graph.node:
        for i, name in enumerate(n.input):
            consumers.setdefault(name, []).append((n, i))
    for n in model.graph.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        where = f"{n.op_type} {n.name or n.output[0]!r}"
        if len(n.input) > 2 and n.input[2] in consts and consts[n.input[2]].data_type != onnx.TensorProto.INT8:
            problems.append(f"{where}: zero point type {onnx.TensorProto.DataType.Name(consts[n.input[2]].data_type)}"
                            ", TensorRT's INT8 Q/DQ needs INT8")
        scale = consts.get(n.input[1])
        if scale is None:
            continue                                        # reported by qdq_problems
        s = numpy_helper.to_array(scale)
        weight = n.op_type == "DequantizeLinear" and n.input[0] in consts
        if not weight:
            if s.size != 1:
                problems.append(f"{where}: activation scale has shape {list(s.shape)}, TensorRT needs one scale")
            continue
        if s.size == 1:
            continue                                        # a per-tensor weight is allowed
        w = consts[n.input[0]]
        axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
        axis = axis + len(w.dims) if axis < 0 else axis
        for node, slot in consumers.get(n.output[0], []):
            # other consumers (a tied embedding's Transpose -> Gather) read a constant: allowed
            want = _output_axis(node, slot, len(w.dims))
            if want is not None and (axis != want or s.size != w.dims[want]):
                problems.append(f"{where}: per-channel axis {axis} ({s.size} scales) on a {node.op_type} weight "
                                f"{list(w.dims)}; the output channel is axis {want}")
    return problems


def _output_axis(node, slot: int, rank: int) -> int | None:
    """The output-channel axis of the weight in input `slot` of `node` (None: not a weight slot)."""
    if node.op_type == "MatMul" and slot == 1:
        return rank - 1                                     # B [K, N]
    if node.op_type == "Gemm" and slot == 1:
        trans = next((a.i for a in node.attribute if a.name == "transB"), 0)
        return 0 if trans else 1
    if node.op_type in ("Conv", "ConvTranspose") and slot == 1:
        return 0 if node.op_type == "Conv" else 1
    return None


def check_rules(protos: dict[str, onnx.ModelProto]) -> dict:
    """{"passed", "problems", counts}; BackendError-free: the caller decides what a failure means."""
    problems, q, dq = [], 0, 0
    for g, m in protos.items():
        problems += [f"{g}: {p}" for p in rule_problems(m)]
        q += sum(n.op_type == "QuantizeLinear" for n in m.graph.node)
        dq += sum(n.op_type == "DequantizeLinear" for n in m.graph.node)
    return {"passed": not problems and dq > 0, "problems": problems[:50], "quantize_nodes": q,
            "dequantize_nodes": dq,
            "rules": "zero points constant int8 0; scales constant > 0; per-channel scales on weights only, on "
                     "the output-channel axis; activation scales scalar"}



class QDQRuleError(ParityError):
    """The Q/DQ graph breaks a rule TensorRT's INT8 import relies on (a ParityError: the
    artifact fails its boundary check, nothing is written)."""
