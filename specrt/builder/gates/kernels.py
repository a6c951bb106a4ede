"""The kernel table (issue 28): what each of ONNX Runtime's CPU matrix kernel families costs at
the shapes this folder's runtime actually runs, measured on this machine, beside the family each
shape runs (manifest `build.kernels`, `specrt inspect`).

    measure(root, man) -> dict     the table of a built folder (the build, and `specrt retime`);
                                   `specrt inspect` shows it (tools/describe.py kernel_lines)

What is timed: every weight MatMul of the model (its own [K, N] shapes, read from the graph the
runtime steps: the fused QKV, O, gate/up and down projections of every layer, and the LM head at
the rows that need logits; a draft's shapes from its own graph), one small graph per shape with
random weights, quantized by each
family as the build quantizes: `fp32` MatMul; `int4` and `int8` MatMulNBits (the folder's own
block size and accuracy level where it has them; int8 compute = MLAS's VNNI/AMX paths);
`int8row` MatMulIntegerToFloat with one activation scale per row (calibration/rowwise.py, its
quantizer ops included). The families are timed in turn, shape after shape (interleaved, so a load
change hits them all alike); the median of `runs` rounds, in milliseconds a call summed over the
model's MatMuls. Attention, norms and the rest of the graph are left out: the table compares the
kernel families, not whole steps (those are `build.speculation`'s costs).

Which family a shape runs is the folder's, not the table's: a step's numbers define the answers
(greedy = the target's plain decoding; a request's tokens independent of its batch), so the
table informs the build's precision, it never swaps a kernel under a built target. Where the
folder runs a family and another is faster at that shape, `specrt inspect` says by how much, and
the faithfulness of each precision is `specrt quality`'s table (docs/precision.md).
"""
from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specrt import manifest as mf
from specrt.runtime.backends.batch_calls import lone_prefill_tokens, padded_call, prompt_rows

FAMILIES = ("fp32", "int4", "int8", "int8row")
STEP_ROWS = (4, 8, 16, 24, 32)        # decode steps of n requests at once
PROMPT_CHUNKS = (16, 256, 512)        # besides the folder's own prefill chunk
GROUP_ROWS, GROUP_TOKENS = 8, 16      # short prompts of requests admitted together, in one call
RUNS, WARMUP = 5, 1


def family_of(quant: dict | None) -> str:
    """The family of a graph's manifest quantization record (None: fp32)."""
    if not quant:
        return "fp32"
    method = str(quant.get("method", ""))
    if method.startswith("rowwise"):
        return "int8row"
    if method == "onnxruntime MatMulNBits":
        return f"int{quant.get('bits')}"
    if method == "onnxruntime quantize_dynamic":
        return "int8dyn"
    return method


def _specs(man: mf.Manifest) -> dict:
    """family -> QuantSpec (None for fp32): the build's defaults, the folder's own settings where
    the folder runs that family (its block size, accuracy level, symmetry)."""
    from specrt.builder.config import PRECISIONS
    from specrt.calibration.quantize import QuantSpec
    specs = {"fp32": None, **{f: QuantSpec(**PRECISIONS[f]) for f in ("int4", "int8", "int8row")}}
    fields = set(QuantSpec.__dataclass_fields__) - {"method", "lm_head", "lm_head_block_size"}
    for quant in _quantizations(man).values():
        fam = family_of(quant)
        if fam in ("int4", "int8") and quant:
            specs[fam] = QuantSpec(**{**PRECISIONS[fam], **{k: quant[k] for k in fields if k in quant}})
    return specs


def _quantizations(man: mf.Manifest) -> dict:
    """graph file -> its quantization record, for the graphs the runtime steps."""
    out = {}
    for role in ("target", "draft", "batch", "batch_draft"):
        m = man.models.get(role)
        if m is None:
            continue
        q = (m.source or {}).get("quantization")
        for g, e in m.graphs.items():
            extra = (m.source or {}).get(f"{g}_graph") if role == "batch" else None
            out[e.file] = extra if extra is not None else q
    return out


def runtime_shapes(man: mf.Manifest) -> list[dict]:
    """The calls this folder's runtime makes: {use, rows, tokens, logit_rows, graph}; rows are
    the call as run where the graph wants an even number of rows (the runtime's padding,
    batch_calls.padded_call: a lone one-token row gets a padding row, one row of an odd number of
    tokens one token more; a prompt chunk of 64 tokens runs as one row)."""
    s, batch = man.shapes, man.models.get("batch")
    out = []

    def add(use, rows, tokens, graph, logits_a_row=None):
        if graph is None:
            return
        mult = int((batch.io or {}).get("row_multiple", 1)) if batch is not None and \
            Path(graph).parent == Path(batch.weights["file"]).parent else 1
        rows, tokens, P = padded_call(rows, tokens, tokens if logits_a_row is None else logits_a_row, mult)
        out.append({"use": use, "rows": rows, "tokens": tokens, "graph": graph, "logit_rows": rows * P})

    if batch is not None:
        step, prefill = batch.graphs["step"].file, batch.graphs.get("prefill", batch.graphs["step"]).file
        draft = batch.graphs["draft"].file if "draft" in batch.graphs else None
        add("decode, 1 request", 1, 1, step)
        add("pair round, 1 request", 1, 2, step)
        add(f"verify window (k={s.k}), 1 request", 1, s.k + 1, step)
        for n in STEP_ROWS:
            add(f"decode, {n} requests", n, 1, step)
        for n in (4, 8):
            add(f"verify windows, {n} requests", n, s.k + 1, step)
        add("int8 self-draft, 1 request", 1, 1, draft)
        add("int8 self-draft, 8 requests", 8, 1, draft)
        bd = man.models.get("batch_draft")
        if bd is not None:          # a draft model inside the batch, its own graph and cache
            add("draft model, 1 request", 1, 1, bd.graphs["step"].file)
            add("draft model, 8 requests", 8, 1, bd.graphs["step"].file)
    else:
        t = man.target.graphs
        add("decode, 1 request", 1, t["decode"].tokens, t["decode"].file)
        add(f"verify window (k={s.k})", 1, t["verify"].tokens, t["verify"].file)
        if man.draft is not None and "decode" in man.draft.graphs:
            add("draft step", 1, man.draft.graphs["decode"].tokens, man.draft.graphs["decode"].file)
        prefill = t["prefill"].file
    # a request alone prefills in the larger chunk the build showed gives the same bits
    lone = lone_prefill_tokens(batch, s) if batch is not None else s.prefill_chunk
    for c in sorted({s.prefill_chunk, lone, *PROMPT_CHUNKS}):
        if c <= s.max_context:
            use = "prompt chunk" if c == s.prefill_chunk else "prompt chunk, a request alone" if c == lone \
                else f"prompt chunk with --prefill-chunk {c}"
            add(use, 1, c, prefill, logits_a_row=1)
    if batch is not None and prompt_rows(batch) > 1:
        # requests admitted together share prompt calls (runtime/batch/admission.py): 8 short ones
        add(f"prompts of {GROUP_ROWS} requests in one call", GROUP_ROWS, GROUP_TOKENS, prefill, logits_a_row=1)
    return out


def weight_shapes(graph: Path, vocab: int, head_dim: int) -> tuple[dict, tuple[int, int]]:
    """({(K, N): count} of the weight MatMuls but the LM head, the LM head's (K, N)) of a graph,
    read without its weights: MatMul with a 2-D initializer B, MatMulNBits (K, N attributes),
    MatMulIntegerToFloat. The LM head is the [hidden, vocab] one, or the graph's last weight
    MatMul where a draft's vocabulary was cut (`--draft-vocab`)."""
    model = onnx.load(str(graph), load_external_data=False)
    inits = {i.name: tuple(i.dims) for i in model.graph.initializer}
    found: list = []
    for n in model.graph.node:
        kn = None
        if n.op_type == "MatMulNBits":
            a = {x.name: helper.get_attribute_value(x) for x in n.attribute}
            kn = (int(a["K"]), int(a["N"]))
        elif n.op_type in ("MatMul", "MatMulIntegerToFloat") and len(n.input) > 1 and len(inits.get(n.input[1], ())) == 2:
            kn = tuple(int(d) for d in inits[n.input[1]])
        if kn is None or (n.op_type == "MatMul" and kn == (head_dim, head_dim)):
            continue            # not a weight, or the rotary rotate-half permutation (it stays fp32)
        found.append(kn)
    heads = [kn for kn in found if kn[1] == vocab]
    head = heads[-1] if heads else (found[-1] if found else None)
    counts: dict = {}
    for kn in found:
        if kn != head:
            counts[kn] = counts.get(kn, 0) + 1
    if head is None or not counts:
        raise ValueError(f"{graph}: no LM head or no weight MatMuls found")
    return counts, head


MAX_PARAMS = 64 * 2**20     # the timed body's weights: as many layers as fit (scaled to all of them)


def _graph(mats: dict, copies: int, seed: int) -> onnx.ModelProto:
    """One input x_K [M, K] per distinct K; `copies` x count MatMuls x_K @ W (each its own random
    fp32 weights, so the weights stream from memory as a model's do, not from cache); each output's
    first column concatenated into y (so no output is pruned and little is copied back)."""
    rng = np.random.default_rng(seed)
    nodes, inits, cols = [], [], []
    ks = sorted({k for k, _ in mats})
    for (k, n), count in sorted(mats.items()):
        for j in range(count * copies):
            w, y = f"w_{k}_{n}_{j}", f"y_{k}_{n}_{j}"
            inits.append(numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32) * np.float32(0.02), w))
            nodes += [helper.make_node("MatMul", [f"x_{k}", w], [y], name=f"proj_{k}_{n}_{j}"),
                      helper.make_node("Slice", [y, "zero", "one", "one"], [y + ".c"], name=f"col_{k}_{n}_{j}")]
            cols.append(y + ".c")
    inits += [numpy_helper.from_array(np.array([v], np.int64), name) for name, v in (("zero", 0), ("one", 1))]
    nodes.append(helper.make_node("Concat", cols, ["y"], axis=1, name="cols"))
    g = helper.make_graph(nodes, "kernels",
                          [helper.make_tensor_value_info(f"x_{k}", TensorProto.FLOAT, ["M", k]) for k in ks],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", len(cols)])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _quantized(model: onnx.ModelProto, spec) -> onnx.ModelProto:
    """The one-MatMul graph as the build would quantize it (calibration/quantize.py's tools)."""
    from specrt.calibration import quantize
    if spec is None:
        return model
    with quantize.quiet_logging():
        if spec.method == "rowwise":
            from specrt.calibration import rowwise
            rowwise.quantize_model(model)
            return model
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
        q = MatMulNBitsQuantizer(model, bits=spec.bits, block_size=spec.block_size, is_symmetric=spec.symmetric,
                                 accuracy_level=spec.accuracy_level)
        q.process()
        return q.model.model


def _session(model: onnx.ModelProto, threads: int | None = None):
    import onnxruntime as ort
    from specrt.runtime.backends.ort_cpu import pool_threads, session_options
    threads = threads or pool_threads() or 2
    return ort.InferenceSession(model.SerializeToString(), session_options(threads), providers=["CPUExecutionProvider"])


def _model_of(man: mf.Manifest, graph: str):
    """The model entry whose graphs include this file."""
    for m in man.models.values():
        if any(e.file == graph for e in m.graphs.values()):
            return m
    raise ValueError(f"{graph}: no model of the manifest has this graph")


def _parts(root: Path, man: mf.Manifest, shapes: list[dict]) -> tuple[dict, dict]:
    """(part key -> (mats {(K, N): count}, copies), graph -> [(part key, time scale)]): each graph
    timed on its own model's weight shapes (a truncated or separate draft has its own), one
    layer's projections `copies` times (as many layers as fit in MAX_PARAMS; the time scaled to
    all layers), the LM head apart (its time scaled when only a slice of its columns fits)."""
    parts: dict = {}
    plan: dict = {}
    for graph in dict.fromkeys(sh["graph"] for sh in shapes):
        m = _model_of(man, graph)
        vocab, layers = int(m.dims["vocab"]), m.layers
        body, (hidden, head_n) = weight_shapes(root / graph, vocab, int(m.dims["head_dim"]))
        per_layer = {kn: max(1, c // layers) for kn, c in body.items()}
        params = sum(k * n * c for (k, n), c in per_layer.items())
        shrink = min(1.0, MAX_PARAMS / params)          # a layer larger than MAX_PARAMS: a slice of every N
        mats = {(k, max(1, round(n * shrink))): c for (k, n), c in per_layer.items()}
        copies = max(1, min(layers, int(MAX_PARAMS // sum(k * n * c for (k, n), c in mats.items()))))
        cols = min(head_n, max(1, MAX_PARAMS // hidden))
        body_key, head_key = ("body", tuple(sorted(mats.items())), copies), ("head", ((hidden, cols), 1), 1)
        parts[body_key] = (mats, copies)
        parts[head_key] = ({(hidden, cols): 1}, 1)
        plan[graph] = [(body_key, layers / copies / shrink, "body"), (head_key, head_n / cols, "head")]
    return parts, plan


def measure(root: Path, man: mf.Manifest, *, runs: int = RUNS, warmup: int = WARMUP, threads: int | None = None,
            measured_by: str = "specrt build", progress=None) -> dict:
    """The kernel table of the folder at root (manifest `build.kernels`)."""
    from specrt.cpu_features import int8_kernels
    from specrt.runtime.backends.ort_cpu import pool_threads
    threads = threads or pool_threads() or int((man.build.get("config") or {}).get("threads") or 2)
    shapes = runtime_shapes(man)
    specs = _specs(man)
    parts, plan = _parts(root, man, shapes)
    sessions = {}
    for fam, spec in specs.items():
        if progress:
            progress(f"kernel table: {fam}")
        for seed, (key, (mats, cps)) in enumerate(parts.items()):
            sessions[fam, key] = _session(_quantized(_graph(mats, cps, seed=seed), spec), threads)
    xs: dict = {}

    def inputs(key, rows):
        ks = sorted({k for k, _ in parts[key][0]})
        for k in ks:
            if (rows, k) not in xs:
                xs[rows, k] = np.random.default_rng(rows * 7 + k).standard_normal((rows, k), dtype=np.float32)
        return {f"x_{k}": xs[rows, k] for k in ks}

    times: dict = {}
    for r in range(warmup + runs):
        for si, sh in enumerate(shapes):
            for fam in specs:
                total = 0.0
                for key, scale, what in plan[sh["graph"]]:
                    feeds = inputs(key, sh["rows"] * sh["tokens"] if what == "body" else sh["logit_rows"])
                    t0 = time.perf_counter()
                    sessions[fam, key].run(None, feeds)
                    total += (time.perf_counter() - t0) * scale
                if r >= warmup:
                    times.setdefault((si, fam), []).append(total)
    quant = _quantizations(man)
    rows_out = []
    for si, sh in enumerate(shapes):
        ms = {fam: round(statistics.median(times[si, fam]) * 1e3, 3) for fam in specs}
        m = _model_of(man, sh["graph"])
        rows_out.append({**sh, "runs": family_of(quant.get(sh["graph"])), "ms": ms, "fastest": min(ms, key=ms.get),
                         "model": m.role, "layers": m.layers})
    first = man.models.get("batch") or man.target
    body, (hidden, head_n) = weight_shapes(root / first.graphs["step" if "step" in first.graphs else "decode"].file,
                                           int(first.dims["vocab"]), int(first.dims["head_dim"]))
    return {"measured_by": measured_by,
            "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "threads": threads, "int8_kernels": int8_kernels(), "runs": runs,
            "what": ("milliseconds a call of every weight MatMul of the model that runs the shape (each layer's "
                     "projections at rows x tokens activation rows, the LM head at the rows that need logits), "
                     "random weights of its shapes quantized as each family's build does (as many layers as fit "
                     "in 64M parameters, scaled to all; larger matrices timed on a slice of their columns, "
                     "scaled); attention and the rest left out"),
            "matmuls": {**{f"{k}x{n}": c for (k, n), c in sorted(body.items())},
                        f"{hidden}x{head_n} (LM head)": 1},
            "layers_timed": {key[0] + (f" {sum(c for _, c in key[1])} matrices" if key[0] == "body" else ""): cps
                             for key, (_, cps) in parts.items()},
            "families": {fam: (spec.describe() if spec is not None else {"method": "MatMul fp32"})
                         for fam, spec in specs.items()},
            "shapes": rows_out}

