"""Weight-only quantization of exported graphs, repacked into one shared weights file.

Every graph of a model (prefill, decode, verify) is quantized with the same settings,
so equal weight names hold equal bytes and `export.weights.pack` stores them once, as
the export does for fp32.

Methods (ONNX Runtime's own tools; no hand-written quantizer):
- "matmulnbits": `MatMulNBitsQuantizer`, b-bit weights in blocks of `block_size` along
  K, symmetric. `accuracy_level` picks the compute type of the kernel: 1 = fp32
  (blocks are dequantized, activations stay fp32), 4 = int8 (activations quantized
  per row and block at run time: faster, and each row is rounded on its own).
- "dynamic": `quantize_dynamic`, per-channel int8 weights, int8 activations with one
  scale per tensor computed at run time (so a row's result depends on the other rows
  of the same call: decode T=1 and verify T=k+1 round differently).
- "rowwise": per-channel int8 weights, one activation scale per row (calibration/rowwise.py):
  exact integer sums, so every row is batch- and window-invariant bit for bit; MLAS's u8 x s8
  GEMM (AMX where the CPU has it) makes extra rows nearly free.
"""
from __future__ import annotations

import contextlib
import logging
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from specrt.export import weights as wpack

METHODS = ("matmulnbits", "dynamic", "rowwise")


@dataclass(frozen=True)
class QuantSpec:
    method: str = "matmulnbits"
    bits: int = 8
    block_size: int = 32
    accuracy_level: int = 4
    symmetric: bool = True
    lm_head: bool = True        # quantize the LM head MatMul too ([hidden, vocab], ~1/5 of the weights here)
    lm_head_block_size: int | None = None   # matmulnbits: the LM head's own block (None: block_size)

    def __post_init__(self):
        assert self.method in METHODS, self.method
        assert self.bits in (4, 8), self.bits

    def describe(self) -> dict:
        """What the manifest records about how the weights were made."""
        if self.method == "dynamic":
            return {"method": "onnxruntime quantize_dynamic", "weight_type": "int8", "per_channel": True,
                    "weight_range": "7-bit (reduce_range)", "activations": "int8, one dynamic scale per tensor",
                    "lm_head_quantized": self.lm_head}
        if self.method == "rowwise":
            return {"method": "rowwise int8 (MatMulIntegerToFloat)", "weight_type": "int8", "per_channel": True,
                    "weight_range": "7-bit (|q| <= 63)", "activations": "int8, one dynamic scale per row",
                    "lm_head_quantized": self.lm_head}
        return {"method": "onnxruntime MatMulNBits",
                **{k: v for k, v in asdict(self).items() if k != "method" and not (k == "lm_head_block_size" and v is None)},
                "lm_head_quantized": self.lm_head,
                "compute": {1: "fp32", 2: "fp16", 3: "bf16", 4: "int8"}.get(self.accuracy_level, "default")}


@contextlib.contextmanager
def quiet_logging(level: int = logging.ERROR):
    """ORT's quantizers log notices on the root logger ("consider pre-processing", one
    line per node): silence them for the call only, then restore the previous levels."""
    loggers = [logging.getLogger(), logging.getLogger("onnxruntime.quantization")]
    before = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(max(level, lg.level))
        yield
    finally:
        for lg, lvl in zip(loggers, before):
            lg.setLevel(lvl)


def lm_head_nodes(model: onnx.ModelProto, vocab: int) -> list[str]:
    """MatMul nodes whose constant weight is [hidden, vocab]: the LM head."""
    shapes = {i.name: list(i.dims) for i in model.graph.initializer}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and len(shapes.get(n.input[1], ())) == 2 and shapes[n.input[1]][1] == vocab]


def odd_rows_round_apart(q: dict | None) -> bool:
    """Does this quantization's kernel round the odd last row of a call apart from the rest?
    ONNX Runtime's MatMulNBits with int8 compute (accuracy_level 4) and a block above 32 runs
    rows in pairs and the odd one through a one-row kernel whose rounding differs (~1e-6 per
    MatMul on this CPU; every row of an even-row call is bit for bit the same whatever its
    neighbours). A batched model so quantized must run an even number of rows per call."""
    return bool(q) and q.get("method", "matmulnbits") == "matmulnbits" and q.get("accuracy_level") == 4 \
        and int(q.get("block_size", 32)) > 32


def is_signed_permutation(t: onnx.TensorProto) -> bool:
    """A square matrix of -1/0/1 with one non-zero per row and column: the rotate-half of
    rotary embeddings in the `portable`/`standard` graphs, not a learned weight."""
    if len(t.dims) != 2 or t.dims[0] != t.dims[1]:
        return False
    a = numpy_helper.to_array(t)
    return bool(np.isin(a, (-1, 0, 1)).all() and (np.abs(a).sum(0) == 1).all() and (np.abs(a).sum(1) == 1).all())


def rotary_nodes(model: onnx.ModelProto) -> list[str]:
    """MatMul nodes whose constant weight is the rotary signed permutation. They stay fp32:
    quantized, the int8-activation kernels would round q and k before the rotation (and an
    int4 block scale of 1/7 does not give back exactly +-1)."""
    inits = {i.name: i for i in model.graph.initializer}
    return [n.name for n in model.graph.node
            if n.op_type == "MatMul" and n.input[1] in inits and is_signed_permutation(inits[n.input[1]])]


def gather_rows(model: onnx.ModelProto) -> list[str]:
    """Store a table that only a column lookup reads by rows. A tied model embeds its tokens by
    gathering columns of the [C, V] LM head table (Gather axis 1, then a [C, N] -> [N, C]
    transpose, export/graph.py); once the LM head is quantized the fp32 table serves only that
    lookup, and a column gather touches a page in every row of the table for each token (the whole
    table becomes resident, ~108 MiB per session on SmolLM2). Rewritten to Gather(table^T, axis 0)
    + Identity: the same values, one row read per token. Returns the tables rewritten; a table
    with another reader (an fp32 LM head MatMul) stays as it is."""
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    readers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    done = []
    for n in list(g.node):
        name = n.input[0] if n.op_type == "Gather" and n.input else None
        if name not in inits or len(inits[name].dims) != 2 or len(readers.get(name, ())) != 1:
            continue
        attrs = {a.name: a for a in n.attribute}
        after = readers.get(n.output[0], [])
        if "axis" not in attrs or attrs["axis"].i != 1 or len(after) != 1 or after[0].op_type != "Transpose" \
                or list(next((a.ints for a in after[0].attribute if a.name == "perm"), [])) != [1, 0]:
            continue
        rows = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(inits[name]).T), f"{name}.rows")
        g.initializer.remove(inits[name])
        g.initializer.append(rows)
        n.input[0] = rows.name
        attrs["axis"].i = 0
        t = after[0]          # [N, C] already: the transpose becomes an identity
        t.op_type = "Identity"
        del t.attribute[:]
        done.append(name)
    return done


def _excluded(model: onnx.ModelProto, spec: QuantSpec, vocab: int) -> list[str]:
    """The MatMuls a quantizer must leave in fp32: the rotary permutation, and the LM head
    unless spec.lm_head."""
    return rotary_nodes(model) + ([] if spec.lm_head else lm_head_nodes(model, vocab))


def quantize_graph(src: Path, dst: Path, spec: QuantSpec, vocab: int) -> None:
    with quiet_logging():
        if spec.method == "dynamic":
            from onnxruntime.quantization import QuantType, quantize_dynamic
            exclude = _excluded(onnx.load(str(src)), spec, vocab)
            # MatMulConstBOnly: only weight MatMuls; attention MatMuls against the cache stay fp32.
            # reduce_range: 7-bit weights, so MLAS's u8 x s8 sums cannot saturate on CPUs without
            # VNNI (AVX2: the tiny models' draft agreed 27% with the target there, 8-bit)
            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True,
                             reduce_range=True, use_external_data_format=True, nodes_to_exclude=exclude,
                             extra_options={"MatMulConstBOnly": True})
            return
        model = onnx.load(str(src))
        if spec.method == "rowwise":
            from specrt.calibration import rowwise
            rowwise.quantize_model(model, exclude=set(_excluded(model, spec, vocab)))
            onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=dst.name + ".data", size_threshold=1024)
            return
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
        exclude = _excluded(model, spec, vocab)
        head_apart = spec.lm_head and spec.lm_head_block_size not in (None, spec.block_size)
        if head_apart:          # the LM head in its own blocks: a second pass over what the first left
            exclude += lm_head_nodes(model, vocab)
        q = MatMulNBitsQuantizer(model, bits=spec.bits, block_size=spec.block_size, is_symmetric=spec.symmetric,
                                 accuracy_level=spec.accuracy_level, nodes_to_exclude=exclude)
        q.process()
        if head_apart:
            model = q.model.model
            q = MatMulNBitsQuantizer(model, bits=spec.bits, block_size=spec.lm_head_block_size,
                                     is_symmetric=spec.symmetric, accuracy_level=spec.accuracy_level,
                                     nodes_to_exclude=rotary_nodes(model))
            q.process()
        q.model.save_model_to_file(str(dst), use_external_data_format=True)


def quantize_graphs(export_dir: Path, export: dict, out_dir: Path, graphs: tuple[str, ...],
                    spec: QuantSpec | dict[str, QuantSpec | None], prepare: dict | None = None,
                    source: dict[str, str] | None = None) -> dict:
    """Quantize `graphs` of an exported model into out_dir (graph files + one weights.bin).
    spec: one for every graph, or graph -> spec (None: the fp32 graph as exported).
    prepare: graph -> function applied to its fp32 ModelProto (weights loaded) before
    quantizing (see vocab.py). source: graph -> the exported graph it is made from (default:
    the same name; e.g. the batched model's "prefill" is its "step" quantized another way).
    Returns the manifest fragment: graphs, weights index, dims, quantization (one description,
    or graph -> description when spec is per graph)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = int(export["dims"]["vocab"])
    specs = spec if isinstance(spec, dict) else {g: spec for g in graphs}
    source = source or {}
    protos = {}
    with tempfile.TemporaryDirectory(prefix="specrt-quant-") as tmp:
        for g in graphs:
            dst = Path(tmp) / f"{g}.onnx"
            src = export_dir / export["graphs"][source.get(g, g)]["file"]
            if prepare and g in prepare:
                src = _prepared(src, prepare[g], Path(tmp) / f"{g}.fp32.onnx")
            if specs[g] is None:
                protos[g] = onnx.load(str(src))
                continue
            quantize_graph(src, dst, specs[g], vocab)
            protos[g] = onnx.load(str(dst))
            gather_rows(protos[g])
    tokens = {g: export["graphs"][source.get(g, g)]["tokens"] for g in protos}
    entries, winfo = wpack.save_graphs(protos, out_dir, tokens)
    described = spec.describe() if not isinstance(spec, dict) else \
        {g: s.describe() if s is not None else None for g, s in specs.items()}
    return {"graphs": entries, "weights": winfo, "dims": export["dims"], "quantization": described}


def _prepared(src: Path, fn, dst: Path) -> Path:
    """fn(the fp32 graph with its weights) saved beside the quantizer's output, weights in one file."""
    model = fn(onnx.load(str(src)))
    onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=dst.stem + ".bin", size_threshold=1024)
    return dst
