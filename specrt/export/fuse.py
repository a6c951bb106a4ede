"""ONNX Runtime's fused contrib operators in an exported "gqa" or "rows" graph: a post-export pass.

The exporter writes each RMSNorm as six standard ops and feeds GroupQueryAttention three
slices of the packed q/k/v MatMul (graph.py). ONNX Runtime fuses the norm itself when a
session loads the graph (SimplifiedLayerNormalization), but neither the residual Add
before it nor the Split before attention. This pass rewrites both, on the ModelProto:

1. skip + RMSNorm (2 per layer + the final norm):

       a ─┐                                                   ┌─ y = s / sqrt(mean(s²) + eps) * w
       b ─┴─ Add ─ s ─┬─ Pow(2) ─ ReduceMean(-1) ─ Add(eps) ─ Sqrt ─ Div(s, ·) ─ Mul(w) ─ y
                      └─ (next residual Add)
   =>  a, b, w ─ com.microsoft.SkipSimplifiedLayerNormalization(epsilon) ─ y  (output 0)
                                                                        └─ s  (output 3, when read)

2. packed QKV (1 per layer):

       h ─ MatMul(w_qkv) ─ qkv [1, T, (H+2KVH)*D] ─ Split ─ q, k, v ─ GroupQueryAttention
   =>  h ─ MatMul(w_qkv) ─ qkv ─ GroupQueryAttention(query=qkv, key='', value='')

Both match only the exact pattern (constants checked: exponent 2, axes [-1], split sizes
[H*D, KVH*D, KVH*D]); anything else is left as it is, and `describe` counts what was
fused, so a change in the exporter's output shows up as fewer fusions, not a wrong graph.
The fused graph is checked against transformers by the build's parity check like any
other; the "standard" (TensorRT) and "portable" variants never go through this pass. The
batched "rows" graph (export/batch.py: plain ops around its attention) gets rewrite 1 only
(onnx_export.fuses): a row's norm is computed alone, so a batch's rows and windows stay
invariant (its gates and tests/export/test_batch.py check them on the fused graph).

What it is worth (benchmarks/fusion.py, SmolLM2-135M fp32, 2 threads): the norms, Adds
and Splits it removes were ~4% of the decode graph's operator time and ~3% of prefill's
(MatMul is 87-91%), so the gain is a few percent, inside this shared machine's noise;
the packed QKV is what onnxruntime-genai's graph feeds its attention. Tried and not kept:
gate and up as two MatMuls (as onnxruntime-genai has them) instead of one MatMul and a
Split: no measurable difference either way (0.95-1.08x, noise).
"""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

MS = "com.microsoft"


class _Graph:
    """Producer / consumer / constant lookups over one GraphProto (rebuilt per rewrite)."""

    def __init__(self, graph: onnx.GraphProto):
        self.g = graph
        self.producer = {o: n for n in graph.node for o in n.output if o}
        self.consumers: dict[str, list] = defaultdict(list)
        for n in graph.node:
            for i in n.input:
                if i:
                    self.consumers[i].append(n)
        self.outputs = {o.name for o in graph.output}
        self.inits = {i.name: i for i in graph.initializer}

    def const(self, name: str) -> np.ndarray | None:
        if name in self.inits:
            init = self.inits[name]
            if init.data_location == onnx.TensorProto.EXTERNAL and not init.raw_data:
                return None
            return numpy_helper.to_array(init)
        n = self.producer.get(name)
        if n is not None and n.op_type == "Constant" and n.domain == "":
            return numpy_helper.to_array(n.attribute[0].t)
        return None

    def only_reader(self, name: str, node) -> bool:
        """`name` is read by `node` alone and is no graph output."""
        return name not in self.outputs and [id(c) for c in self.consumers[name]] == [id(node)]

    def sole(self, name: str, op_type: str):
        """The single consumer of `name` if it is an `op_type` node, else None."""
        cs = self.consumers[name]
        return cs[0] if len(cs) == 1 and cs[0].op_type == op_type and name not in self.outputs else None


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _rms_norm(G: _Graph, pow_node):
    """Match Pow(s, 2) ─ ReduceMean(-1) ─ Add(eps) ─ Sqrt ─ Div(s, ·) ─ Mul(w) from its Pow.
    Returns (s, w, eps, nodes, y) or None."""
    s = pow_node.input[0]
    if not np.array_equal(G.const(pow_node.input[1]), np.array(2.0, np.float32)):
        return None
    mean = G.sole(pow_node.output[0], "ReduceMean")
    if mean is None or _attr(mean, "keepdims", 1) != 1:
        return None
    axes = G.const(mean.input[1]) if len(mean.input) > 1 else np.array(_attr(mean, "axes", []))
    if axes is None or list(np.atleast_1d(axes)) != [-1]:
        return None
    add_eps = G.sole(mean.output[0], "Add")
    if add_eps is None:
        return None
    eps_name = add_eps.input[1] if add_eps.input[0] == mean.output[0] else add_eps.input[0]
    eps = G.const(eps_name)
    if eps is None or eps.size != 1:
        return None
    sqrt = G.sole(add_eps.output[0], "Sqrt")
    div = sqrt and G.sole(sqrt.output[0], "Div")
    if div is None or list(div.input) != [s, sqrt.output[0]]:
        return None
    mul = G.sole(div.output[0], "Mul")
    if mul is None:
        return None
    w = mul.input[1] if mul.input[0] == div.output[0] else mul.input[0]
    if w not in G.inits or len(G.inits[w].dims) != 1:
        return None
    return s, w, float(eps.reshape(())), [pow_node, mean, add_eps, sqrt, div, mul], mul.output[0]


def fuse_skip_rms_norm(model: onnx.ModelProto) -> int:
    """Rewrite 1 (module docstring). Returns the number of norms fused."""
    G = _Graph(model.graph)
    replace: dict[int, onnx.NodeProto] = {}     # id(first removed node) -> fused node
    drop: set[int] = set()
    for n in list(model.graph.node):
        if n.op_type != "Pow" or n.domain != "":
            continue
        m = _rms_norm(G, n)
        if m is None:
            continue
        s, w, eps, nodes, y = m
        add = G.producer.get(s)
        if add is None or add.op_type != "Add" or add.domain != "" or id(add) in drop:
            continue
        a, b = add.input
        if G.const(a) is not None or G.const(b) is not None or a in G.inits or b in G.inits:
            continue                                   # a bias, not a residual sum
        pattern = {id(x) for x in nodes}
        s_read_elsewhere = s in G.outputs or any(id(c) not in pattern for c in G.consumers[s])
        fused = helper.make_node("SkipSimplifiedLayerNormalization", [a, b, w],
                                 [y, "", "", s] if s_read_elsewhere else [y],
                                 name=f"{add.name or s}_skip_rms", domain=MS, epsilon=eps)
        replace[id(add)] = fused
        drop.update(pattern)
    _rewrite(model.graph, replace, drop)
    return len(replace)


def fuse_packed_qkv(model: onnx.ModelProto) -> int:
    """Rewrite 2 (module docstring). Returns the number of attention nodes now fed packed QKV."""
    G = _Graph(model.graph)
    drop: set[int] = set()
    for gqa in model.graph.node:
        if gqa.op_type != "GroupQueryAttention" or gqa.domain != MS or len(gqa.input) < 3 or not gqa.input[1]:
            continue
        split = G.producer.get(gqa.input[0])
        if split is None or split.op_type != "Split" or list(split.output) != list(gqa.input[:3]):
            continue
        if not all(G.only_reader(o, gqa) for o in split.output):
            continue
        H, KVH = _attr(gqa, "num_heads"), _attr(gqa, "kv_num_heads")
        sizes = G.const(split.input[1]) if len(split.input) > 1 and split.input[1] else None
        if sizes is None or len(sizes) != 3 or sizes[0] % H or sizes[0] // H * KVH != sizes[1] or sizes[1] != sizes[2]:
            continue
        if _attr(split, "axis", 0) not in (-1, 2):          # [1, T, (H+2KVH)*D]: the hidden axis
            continue
        gqa.input[0], gqa.input[1], gqa.input[2] = split.input[0], "", ""
        drop.add(id(split))
    _rewrite(model.graph, {}, drop)
    return len(drop)


def _rewrite(graph: onnx.GraphProto, replace: dict, drop: set) -> None:
    """Put each fused node where the first node it replaces was (its inputs exist there and
    every reader of its outputs comes later), drop the rest; then drop unused initializers."""
    nodes = []
    for n in graph.node:
        if id(n) in replace:
            nodes.append(replace[id(n)])
        elif id(n) not in drop:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)


REWRITES = {"skip_rms_norm": fuse_skip_rms_norm, "packed_qkv": fuse_packed_qkv}


def fuse_model(model: onnx.ModelProto, rewrites=tuple(REWRITES)) -> onnx.ModelProto:
    """Apply `rewrites` in place (and return the model). The graph's inputs, outputs and
    weights' names are unchanged, so the runtime, the weights packer and the quantizers
    see the same interface."""
    if not any(o.domain == MS for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS, 1))
    for name in rewrites:
        REWRITES[name](model)
    return model


def describe(model: onnx.ModelProto) -> dict:
    """What the manifest can record about a graph's fusions: fused-op counts and node count."""
    ops = Counter(n.op_type for n in model.graph.node)
    packed = sum(1 for n in model.graph.node
                 if n.op_type == "GroupQueryAttention" and len(n.input) > 2 and not n.input[1])
    return {"nodes": len(model.graph.node), "skip_simplified_layer_norm": ops["SkipSimplifiedLayerNormalization"],
            "packed_qkv_attention": packed}
