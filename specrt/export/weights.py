"""One weights file per model, shared by all its graphs.

Each graph's large initializers are moved into `weights.bin` (page-aligned, so the
runtime can memory-map them) and the graph keeps only a reference. Graphs of the same
model export the same parameter names; equal names must hold equal bytes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper


ALIGN = 4096
MIN_BYTES = 1024   # smaller initializers stay inside the graph


def pack(graphs: dict[str, onnx.ModelProto], directory: Path, name: str = "weights.bin") -> dict:
    """Move large initializers of all `graphs` into directory/name; returns the index
    {initializer: [offset, length, dtype, shape]} and file info for the manifest."""
    index: dict[str, list] = {}
    blobs: dict[str, bytes] = {}
    path = Path(directory) / name
    with open(path, "wb") as f:
        for model in graphs.values():
            for init in model.graph.initializer:
                arr = numpy_helper.to_array(init)
                if arr.nbytes < MIN_BYTES:
                    continue
                data = np.ascontiguousarray(arr).tobytes()
                if init.name in blobs:
                    if blobs[init.name] != data:
                        # a per-graph constant under a shared name (e.g. the causal mask of this T):
                        # it stays inside its graph
                        continue
                else:
                    offset = -(-f.tell() // ALIGN) * ALIGN
                    f.seek(offset)
                    f.write(data)
                    blobs[init.name] = data
                    index[init.name] = [offset, len(data), arr.dtype.str, list(arr.shape)]
                offset, length = index[init.name][:2]
                init.ClearField("raw_data")
                for fld in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    init.ClearField(fld)
                init.data_location = onnx.TensorProto.EXTERNAL
                del init.external_data[:]
                for k, v in (("location", name), ("offset", str(offset)), ("length", str(length))):
                    e = init.external_data.add()
                    e.key, e.value = k, v
        size = f.tell()
    return {"file": name, "bytes": size, "initializers": index}


def save_graphs(protos: dict[str, onnx.ModelProto], out_dir: Path, tokens: dict[str, int]) -> tuple[dict, dict]:
    """Pack the graphs' large initializers into out_dir/weights.bin, save each graph as
    out_dir/<name>.onnx, and hash everything: (graph entries, weights info) for a manifest."""
    from specrt.manifest import sha256_file
    winfo = pack(protos, out_dir)
    entries = {}
    for g, proto in protos.items():
        path = Path(out_dir) / f"{g}.onnx"
        onnx.save(proto, str(path))
        entries[g] = {"file": path.name, "tokens": tokens[g], "sha256": sha256_file(path)}
    winfo["sha256"] = sha256_file(Path(out_dir) / winfo["file"])
    return entries, winfo
