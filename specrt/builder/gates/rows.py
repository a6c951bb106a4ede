"""A decode graph that runs the multi-row kernels: plain decoding through the same
arithmetic as the verify pass.

ONNX Runtime's MatMulNBits with int8 compute (accuracy_level 4) takes one code path for
a single row (T=1) and another for several rows, and the two round differently: on
SmolLM2-135M int4, verify rows and decode rows differ by up to ~1.4 in a logit and pick
another token at ~2% of positions, so greedy speculation would not reproduce plain
decoding. Rows of the multi-row path are bit for bit independent of the other rows of
the call (measured: a position gives the same logits in any row of a T=5 window, with
or without padding, and in a T=2 call). So a quantized target's decode graph is exported
for T=2 (manifest `tokens: 2`): a plain step feeds one token and the runtime pads the
second row (the padding row writes its K/V one row past the length, where nothing reads
it; the cache has a window of spare rows). Cost: ~1.1x a T=1 step. That second row is
not wasted: a *pair round* (runtime/batch/engine.py) puts a guessed next token there, and when the
guess is right the step emits two tokens for the price of one.

`one_token_interface` wraps a T=rows graph behind a one-token signature (pad inside the
graph, keep row 0); `specrt qdq` uses it for its Q/DQ decode graph (the verify graph
behind a one-token interface), and older builds' int4/int8 decode graphs were made so:

    input_ids [1,1] ─Concat(zeros [1,rows-1])─► [1,rows] ─► decoder (T=rows) ─► logits [1,rows,V]
                                                                 │                  └─Slice row 0─► logits [1,1,V]
                                                                 └─ new_k/new_v [1,KVH,rows,D] ─Slice row 0─► [1,KVH,1,D]
                                                                    (in-place present_* are the whole cache: unchanged)
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from specrt import manifest as mf

ROWS = 2


def one_token_interface(model: onnx.ModelProto, rows: int = ROWS) -> onnx.ModelProto:
    """Wrap a graph exported for T=rows so it takes one token and returns one row (in place)."""
    g = model.graph
    ids, logits = mf.IO_NAMES["input_ids"], mf.IO_NAMES["logits"]
    returned = {o.name for o in g.output if o.name.startswith(("new_k_", "new_v_"))}   # [1,KVH,T,D]
    axis_of = {logits: 1, **{n: 2 for n in returned}}
    for node in g.node:                                   # internal names for the T=rows tensors
        node.input[:] = [f"{x}_rows" if x == ids else x for x in node.input]
        node.output[:] = [f"{x}_rows" if x in axis_of else x for x in node.output]
    pad = numpy_helper.from_array(np.zeros((1, rows - 1), np.int64), "one_token.pad_ids")
    zero = numpy_helper.from_array(np.array([0], np.int64), "one_token.row0")
    one = numpy_helper.from_array(np.array([1], np.int64), "one_token.row1")
    axes = {a: numpy_helper.from_array(np.array([a], np.int64), f"one_token.axis{a}") for a in set(axis_of.values())}
    g.initializer.extend([pad, zero, one, *axes.values()])
    head = [helper.make_node("Concat", [ids, pad.name], [f"{ids}_rows"], axis=1, name="one_token.pad")]
    tail = [helper.make_node("Slice", [f"{name}_rows", zero.name, one.name, axes[a].name], [name],
                             name=f"one_token.slice_{name}") for name, a in axis_of.items()]
    nodes = head + list(g.node) + tail
    del g.node[:]
    g.node.extend(nodes)
    for t in list(g.input) + list(g.output):
        if t.name in axis_of or t.name == ids:
            t.type.tensor_type.shape.dim[axis_of.get(t.name, 1)].dim_value = 1
    keep = [v for v in g.value_info if v.name not in axis_of and v.name != ids]
    del g.value_info[:]
    g.value_info.extend(keep)
    return model
