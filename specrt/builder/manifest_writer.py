"""Assemble the artifacts of a build into a manifest (the writer every backend shares: the
ONNX Runtime CPU and CUDA builds pass their device, a TensorRT build adds its engine fields
with engines/trt_build.py before `save_manifest`, `specrt qdq` writes its folder's)."""
from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

from specrt import __version__
from specrt import manifest as mf


def tool_versions() -> dict:
    import onnx
    import onnxruntime

    versions = {"specrt": __version__, "python": platform.python_version(), "onnx": onnx.__version__,
                "onnxruntime": onnxruntime.__version__}
    for name in ("torch", "transformers"):   # read, not imported: `specrt qdq` never loads torch
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def model_entry(role: str, part: dict, subdir: str) -> mf.ModelEntry:
    # a graph with a symbolic T (the batched model's) is recorded as tokens=1 + dynamic_tokens
    graphs = {g: mf.GraphEntry(file=f"{subdir}/{e['file']}", tokens=1 if e["tokens"] == "dynamic" else e["tokens"],
                               sha256=e["sha256"], batch=part.get("batch"), dynamic_tokens=e["tokens"] == "dynamic")
              for g, e in part["graphs"].items()}
    weights = {**part["weights"], "file": f"{subdir}/{part['weights']['file']}"}
    io = {**mf.IO_NAMES, "dtypes": {"input_ids": "int64", "past_len": "int64", "logits": "float32",
                                    "kv": part["kv"]["dtype"]},
          **{k: part[k] for k in mf.IO_COUNTS if k in part},
          **({"hidden_states": mf.HIDDEN_STATES} if part["dims"].get("hidden_layers") else {})}
    return mf.ModelEntry(role=role, family=part["family"], precision=part["precision"], dims=part["dims"],
                         graphs=graphs, weights=weights, source=part["source"], kv=part["kv"], io=io,
                         parity=part.get("parity", {}))


def as_entry(role: str, part, subdir: str) -> mf.ModelEntry:
    """A gate's model: a build's part dict (model_entry), or a built folder's entry as it is
    (`specrt retime` runs the gates again over a folder, builder/gates/here.py)."""
    return part if isinstance(part, mf.ModelEntry) else model_entry(role, part, subdir)


def cpu_device(by: str = "specrt build") -> dict:
    """The device field of a CPU build: mf.this_device() and `gated_on`, the kernels (onnxruntime
    version and instruction set) its exactness gates were measured on (runtime/backends/ort_cpu.py
    kernel_fingerprint; the runtime refuses the folder on other kernels until `specrt retime`
    measures them there)."""
    from specrt.runtime.backends.ort_cpu import gate_record
    rec = gate_record(by)
    return {**mf.this_device(), **({"gated_on": [rec]} if rec else {})}


def assemble_manifest(shapes: mf.Shapes, parts: dict[str, dict], tokenizer: dict, build: dict,
                      device: dict | None = None, proposers: dict | None = None) -> mf.Manifest:
    """parts: role -> {"subdir", graphs, weights, dims, family, precision, source, kv, parity}.
    device: the build's target device (default: this CPU). proposers: files shipped for the
    runtime's proposals (e.g. {"ngrams": {...}}, builder/gates/ngrams.py)."""
    models = {role: model_entry(role, p, p["subdir"]) for role, p in parts.items()}
    return mf.Manifest(shapes=shapes, models=models, tokenizer=tokenizer, device=device or cpu_device(),
                       tools=tool_versions(), build=build, proposers=proposers or None)


def save_manifest(man: mf.Manifest, out: Path) -> mf.Manifest:
    """Check every named file and hash, then write manifest.json (atomically)."""
    mf.check_files(man, out, hashes=True)
    man.save(out)
    return man


def write_manifest(out: Path, shapes: mf.Shapes, parts: dict[str, dict], tokenizer: dict, build: dict,
                   device: dict | None = None, proposers: dict | None = None) -> mf.Manifest:
    return save_manifest(assemble_manifest(shapes, parts, tokenizer, build, device, proposers), out)
