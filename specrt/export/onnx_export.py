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
from specrt.export import weights as wpack
from specrt.export.graph import StaticDecoder
from specrt.export.sources import LoadedModel

log = logging.getLogger(__name__)
OPSET = 20


def graph_tokens(shapes: mf.Shapes) -> dict[str, int]:
    return {"prefill": shapes.prefill_chunk, "decode": 1, "verify": shapes.k + 1}


def build_module(lm: LoadedModel, tokens: int, kv_capacity: int, layers: int | None = None,
                 attention: str = "portable") -> StaticDecoder:
    dims = lm.dims if layers is None else _replace_layers(lm.dims, layers)
    return StaticDecoder(lm.spec, dims, lm.model.state_dict(), tokens=tokens, kv_capacity=kv_capacity,
                         inv_freq=lm.inv_freq, attention_scaling=lm.attention_scaling, attention=attention).eval()


def _replace_layers(dims, layers):
    from dataclasses import replace
    return replace(dims, layers=layers)


def io_names(layers: int, in_place: bool = False) -> tuple[list[str], list[str]]:
    n = mf.IO_NAMES
    out = ("present_key", "present_value") if in_place else ("new_key", "new_value")
    past = [n[kv] % i for i in range(layers) for kv in ("past_key", "past_value")]
    new = [n[kv] % i for i in range(layers) for kv in out]
    return [n["input_ids"], n["past_len"], *past], [n["logits"], *new]


def export_graph(module: StaticDecoder, path: Path) -> None:
    d, T, M = module.dims, module.T, module.M
    args = (torch.zeros(1, T, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
            *[torch.zeros(1, d.kv_heads, M, d.head_dim) for _ in range(2 * d.layers)])
    inputs, outputs = io_names(d.layers, in_place=module.attention == "gqa")
    quiet = io.StringIO()
    # the exporter's chatter (torchvision notices, deprecation warnings) would bury the progress bar
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    try:
        with torch.no_grad(), contextlib.redirect_stdout(quiet), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, str(path), dynamo=True, opset_version=OPSET, input_names=inputs,
                              output_names=outputs, external_data=True, verbose=False)
    except Exception as e:
        raise ExportError(f"torch.onnx.export failed for T={T}: {type(e).__name__}: {e}\n{quiet.getvalue()[-2000:]}") from e


def export_model(lm: LoadedModel, shapes: mf.Shapes, out_dir: Path, *, graphs=("prefill", "decode", "verify"),
                 layers: int | None = None, attention: str = "portable", progress=None) -> dict:
    """Export `graphs` of one model into out_dir (graph files + weights.bin). Returns the
    manifest fragment: graphs, weights index, dims."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens = graph_tokens(shapes)
    protos, timings = {}, {}
    with tempfile.TemporaryDirectory(prefix="specrt-export-") as tmp:
        for g in graphs:
            t0 = time.perf_counter()
            module = build_module(lm, tokens[g], shapes.kv_capacity, layers, attention)
            export_graph(module, Path(tmp) / f"{g}.onnx")
            protos[g] = onnx.load(str(Path(tmp) / f"{g}.onnx"))
            timings[g] = round(time.perf_counter() - t0, 1)
            if progress:
                progress(g)
    winfo = wpack.pack(protos, out_dir)
    entries = {}
    for g, proto in protos.items():
        path = out_dir / f"{g}.onnx"
        onnx.save(proto, str(path))
        entries[g] = {"file": path.name, "tokens": tokens[g], "sha256": mf.sha256_file(path)}
    winfo["sha256"] = mf.sha256_file(out_dir / winfo["file"])
    dims = {**vars(lm.dims), **({"layers": layers} if layers else {})}
    return {"graphs": entries, "weights": winfo, "dims": dims, "export_seconds": timings, "attention": attention,
            "kv_update": "in_place" if attention == "gqa" else "returned"}
