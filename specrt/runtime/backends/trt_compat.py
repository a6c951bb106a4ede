"""May this machine run a TensorRT engine? Pure functions of the engine's recorded fields
and this machine's identity, used at load time by the tensorrt backend (and re-exported
by the builder, specrt/engines/tensorrt.py::check_engine_compat).

    fields: {"tensorrt_version", "gpu_name", "compute_capability", "hardware_compatibility_level",
             "file" (optional: names the engine in messages)}
    here:   {"tensorrt_version" (None when TensorRT is missing), "gpu_name", "compute_capability"}

Plans are tied to the exact TensorRT version (no version-compatible builds here) and to
the compute capability unless built "ampere_plus" (GPU.md B7).
"""
from __future__ import annotations

from specrt.runtime.backends.gpu_errors import EngineMismatchError

REBUILD = "rebuild the TensorRT engines on this machine (`specrt build --backend tensorrt`)"


def check_engine_compat(fields: dict, here: dict) -> list[str]:
    """Refuse an engine this machine cannot run (EngineMismatchError saying what to rebuild);
    return warnings for what it can run but was not tuned for."""
    what = f"the {fields['file']} engine" if fields.get("file") else "these TensorRT engines"
    if not here.get("tensorrt_version"):
        raise EngineMismatchError(f"{what} needs TensorRT {fields['tensorrt_version']}, which is not installed here: "
                                  "install it, or use the ONNX graphs with --backend ort-cpu / ort-cuda")
    if here["tensorrt_version"] != fields["tensorrt_version"]:
        raise EngineMismatchError(f"{what} was built with TensorRT {fields['tensorrt_version']}; this machine has "
                                  f"TensorRT {here['tensorrt_version']}: {REBUILD}")
    built, cc = compute_capability(fields["compute_capability"]), compute_capability(here["compute_capability"])
    level = fields.get("hardware_compatibility_level", "none")
    if level == "ampere_plus":
        if cc < (8, 0):
            raise EngineMismatchError(f"{what} was built for Ampere or newer (compute capability >= 8.0); this GPU "
                                      f"({here['gpu_name']}) has {here['compute_capability']}: {REBUILD}")
    elif cc != built:
        raise EngineMismatchError(
            f"{what} was built for compute capability {fields['compute_capability']} ({fields['gpu_name']}); this "
            f"GPU ({here['gpu_name']}) has {here['compute_capability']}: {REBUILD}")
    warnings = []
    if here["gpu_name"] != fields["gpu_name"]:
        warnings.append(f"{what} was tuned on {fields['gpu_name']}, this is {here['gpu_name']} (same architecture): "
                        "it runs, possibly slower; rebuild here for tuned tactics")
    return warnings


def compute_capability(s) -> tuple[int, int]:
    major, minor = str(s).split(".")
    return int(major), int(minor)
