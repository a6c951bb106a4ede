"""torch -> ONNX: the static-shape graphs of one model and their shared weights."""
from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import time
import warnings
from pathlib import Path

import onnx
import torch

from specrt import manifest as mf
from specrt.errors import ExportError
from specrt.export import fuse as fusion
from specrt.export import weights as wpack
from specrt.export.batch import DYNAMIC, BatchedDecoder
from specrt.export.graph import BATCHED_ONLY, IN_PLACE, StaticDecoder
from specrt.export.sources import LoadedModel

log = logging.getLogger(__name__)
OPSET = 20
OPSET_BY_ATTENTION = {"standard": 24, "rows": 24}   # TensorScatter is opset 24; Attention 23/24
# graph precision -> torch dtype of weights, activations and the KV cache (logits stay fp32)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
KV_DTYPE = {"fp32": "float32", "fp16": "float16"}


def opset_for(attention: str) -> int:
    return OPSET_BY_ATTENTION.get(attention, OPSET)


def graph_tokens(shapes: mf.Shapes) -> dict[str, int]:
    return shapes.windows


def build_module(lm: LoadedModel, tokens: int | str, kv_capacity: int, layers: int | None = None,
                 attention: str = "portable", precision: str = "fp32", static_total: bool = False,
                 batch: int | str | None = None, hidden_layers: tuple[int, ...] = (),
                 grow_cache: bool | None = None) -> StaticDecoder:
    """batch None: today's one-row graph (graph.py). batch an int or "dynamic": the per-row
    contract of export/batch.py, where tokens may be "dynamic" too."""
    if batch is None and attention in BATCHED_ONLY:
        raise ExportError(f"attention={attention!r} exists only in the batched graph (batch=...): export the one-row "
                          "graphs with gqa, portable or standard")
    dims = lm.dims if layers is None else _replace_layers(lm.dims, layers)
    kw = dict(kv_capacity=kv_capacity, inv_freq=lm.inv_freq, attention_scaling=lm.attention_scaling,
              attention=attention, dtype=DTYPES[precision], static_total=static_total, local_rope=lm.local_rope)
    if batch is None:
        return StaticDecoder(lm.spec, dims, lm.model.state_dict(), tokens=tokens, hidden_layers=hidden_layers,
                             **kw).eval()
    return BatchedDecoder(lm.spec, dims, lm.model.state_dict(), batch=batch, tokens=tokens,
                          hidden_layers=hidden_layers, grow_cache=grow_cache, **kw).eval()


def _replace_layers(dims, layers):
    from dataclasses import replace
    return replace(dims, layers=layers)


def io_names(layers: int, in_place: bool = False, batched: bool = False,
             hidden: bool = False) -> tuple[list[str], list[str]]:
    """batched: the per-row contract's inputs (export/batch.py), with logit_pos after past_len.
    hidden: the graph also returns `hidden_states` (last, after the K/V)."""
    n = mf.IO_NAMES
    out = ("present_key", "present_value") if in_place else ("new_key", "new_value")
    past = [n[kv] % i for i in range(layers) for kv in ("past_key", "past_value")]
    new = [n[kv] % i for i in range(layers) for kv in out]
    return ([n["input_ids"], n["past_len"], *([mf.LOGIT_POS] if batched else []),
             *past], [n["logits"], *new, *([mf.HIDDEN_STATES] if hidden else [])])


EXPORTER_LOGGER = "torch.onnx._internal.exporter._registration"


@contextlib.contextmanager
def logger_level(name: str, level: int):
    """Set one logger's level for the block and put the previous level back after it, so an
    export leaves the process's logging as it found it."""
    logger = logging.getLogger(name)
    previous = logger.level
    logger.setLevel(level)
    try:
        yield logger
    finally:
        logger.setLevel(previous)


def fuses(module: StaticDecoder) -> tuple[str, ...]:
    """The rewrites of export/fuse.py a graph gets (empty: none): fp32 "gqa" graphs the fused
    norms and packed-QKV attention; fp32 "rows" graphs (no GroupQueryAttention) the fused norms:
    60 Adds fewer in the default model's batched step graph, the norms computed by the op the
    one-row graphs and the int8 self-draft use (the draft, which reads the target's cache, kept
    0.900 of its guesses against 0.890 unfused with the same cost table, 0.911 against 0.906 in
    rounds of 4; a call level within the noise, 2026-12-06, docs/benchmarks.md). "portable" and
    "standard" stay standard ops (any runtime, TensorRT); the fp16 CUDA graphs keep their
    fp32-statistics norm, which the pass does not match."""
    if module.dtype != torch.float32:
        return ()
    return {"gqa": ("skip_rms_norm", "packed_qkv"), "rows": ("skip_rms_norm",)}.get(module.attention, ())


def export_graph(module: StaticDecoder, path: Path) -> dict:
    """Export one graph to `path` (+ `path`.data). Returns its fusions (export/fuse.py), empty
    where the variant is not fused. Every caller (export_model, the int8-compute decode graph
    of builder/gates/rows.py) gets the same graph for the same module."""
    d, T = module.dims, module.T
    args = module.example_inputs()
    inputs, outputs = io_names(d.layers, in_place=module.attention in IN_PLACE,
                               batched=isinstance(module, BatchedDecoder),
                               hidden=bool(getattr(module, "hidden_layers", ())))
    quiet = io.StringIO()
    # the exporter's chatter (torchvision notices, deprecation warnings) would bury the progress bar
    try:
        with torch.no_grad(), contextlib.redirect_stdout(quiet), warnings.catch_warnings(), \
                logger_level(EXPORTER_LOGGER, logging.ERROR):
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, str(path), dynamo=True, opset_version=opset_for(module.attention),
                              input_names=inputs, output_names=outputs, external_data=True, verbose=False,
                              dynamic_shapes=module.dynamic_shapes())
    except Exception as e:
        raise ExportError(f"torch.onnx.export failed for T={T}: {type(e).__name__}: {e}\n{quiet.getvalue()[-2000:]}") from e
    rewrites = fuses(module)
    if not rewrites:
        return {}
    proto = fusion.fuse_model(onnx.load(str(path)), rewrites)
    found = fusion.describe(proto)
    # RMSNorm families: a fused norm after every residual Add (2 per layer, the first layer's
    # input norm has none; the final norm has one); packed QKV in every layer, except where q/k
    # norms sit between the projection and attention (spec.qk_norm)
    norms = 2 * d.layers if module.spec.norm == "rms" else 0
    packed = d.layers if "packed_qkv" in rewrites and not module.spec.qk_norm else 0
    if found["skip_simplified_layer_norm"] < norms or found["packed_qkv_attention"] != packed:
        raise ExportError(f"fusing the T={T} {module.attention} graph matched {found} (expected {norms} fused "
                          f"norms and {packed} packed-QKV attention nodes): the exporter's output has changed; "
                          "update specrt/export/fuse.py's patterns")
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)     # onnx appends to an existing data file
    onnx.save(proto, str(path), save_as_external_data=True, location=data.name, all_tensors_to_one_file=True)
    return found


def export_model(lm: LoadedModel, shapes: mf.Shapes, out_dir: Path, *, graphs=("prefill", "decode", "verify"),
                 layers: int | None = None, attention: str = "portable", precision: str = "fp32",
                 static_total: bool = False, progress=None, batch: int | str | None = None,
                 tokens: dict[str, int | str] | None = None, hidden_layers: tuple[int, ...] = (),
                 graph_attention: dict[str, str] | None = None) -> dict:
    """Export `graphs` of one model into out_dir (graph files + weights.bin). Returns the
    manifest fragment: graphs, weights index, dims.

    precision "fp16": weights, activations and KV cache in fp16 (logits fp32; for GPUs).
    static_total (gqa only): total_sequence_length is the constant buffer length, as ONNX
    Runtime CUDA needs under CUDA-graph capture (see graph.StaticDecoder._forward_gqa).
    batch: None (default) exports today's one-row graphs; an int (a static bucket) or
    "dynamic" exports the per-row contract of export/batch.py, recorded as `batch`.
    tokens: graph name -> T (an int or "dynamic"), instead of the shapes' windows; e.g.
    {"step": "dynamic"} is one graph for prefill chunks, decode and verify (batched only).
    hidden_layers: the graphs also return `hidden_states` [B, T, len * hidden] fp32 (B = 1 in the
    one-row graphs), those decoder layers' outputs side by side at every position of the window
    (for trained draft heads: heads/), recorded as dims["hidden_layers"].
    graph_attention (batched only): graph -> its attention instead of `attention`, over the same
    cache (the same layout and in-place update; a symbolic length where `attention` has one),
    recorded as part["graph_attention"]: the int8 self-draft's one-token "gqa" steps beside a
    "rows" step graph (builder/gates/batch.py). Such a graph returns no hidden states: it is a
    draft's, and a head reads the target's (a draft and a head never run together)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    graph_attention = dict(graph_attention or {})
    if graph_attention and (batch is None or any(
            (a in IN_PLACE) != (attention in IN_PLACE) for a in graph_attention.values())):
        raise ExportError(f"graph_attention={graph_attention} with attention={attention!r}: per-graph attention is for "
                          "batched graphs that update the same cache the same way")
    if tokens is not None:
        if batch is None and DYNAMIC in tokens.values():
            raise ExportError("tokens='dynamic' needs the per-row contract: pass batch=<int> or batch='dynamic'")
        graphs = tuple(tokens)
    tokens = tokens or graph_tokens(shapes)
    protos, timings, fused = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="specrt-export-") as tmp:
        for g in graphs:
            t0 = time.perf_counter()
            module = build_module(lm, tokens[g], shapes.kv_capacity, layers, graph_attention.get(g, attention),
                                  precision, static_total, batch,
                                  tuple(hidden_layers) if g not in graph_attention else (),
                                  grow_cache=(attention == "rows") if g in graph_attention else None)
            fused[g] = export_graph(module, Path(tmp) / f"{g}.onnx")
            protos[g] = onnx.load(str(Path(tmp) / f"{g}.onnx"))
            timings[g] = round(time.perf_counter() - t0, 1)
            if progress:
                progress(g)
    entries, winfo = wpack.save_graphs(protos, out_dir, tokens)
    dims = {**vars(lm.dims), **({"layers": layers} if layers else {}),
            **({"hidden_layers": list(hidden_layers)} if hidden_layers else {})}
    return {"graphs": entries, "weights": winfo, "dims": dims, "export_seconds": timings, "attention": attention,
            "kv_update": "in_place" if attention in IN_PLACE else "returned", "precision": precision,
            "kv_dtype": KV_DTYPE[precision],
            **({"total_sequence_length": "static"} if static_total and attention == "gqa" else {}),
            **({"batch": batch} if batch is not None else {}),
            **({"graph_attention": {g: a for g, a in graph_attention.items() if g in graphs}} if graph_attention else {}),
            **({"fusions": fused} if any(fused.values()) else {})}
