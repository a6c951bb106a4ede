"""A manifest's device and the machines it may run on (re-exported by specrt/manifest.py).

The device a build was made for (`this_device` for CPU builds, `gpu_device`), and the checks
the runtime makes before loading a folder: the backend, processor and OS (`check_device`), the
CPU's int8 path for quantized models (`check_int8_kernels`, cpu_features.py), and the kernels a
CPU folder's exactness gates were measured on (`device.gated_on`: `gated_kernels`,
`check_gated`; `specrt retime` adds a machine, builder/gates/here.py).

Pure stdlib, as manifest.py.
"""
from __future__ import annotations

import platform

from specrt.cpu_features import int8_kernels
from specrt.errors import GatesNotMeasuredError, Int8KernelsError, ManifestError

# `man` below is a specrt.manifest.Manifest and `entry` a ModelEntry: not imported, as manifest.py
# imports this module (imports point one way)


def this_device() -> dict:
    """The device field of a CPU build; int8_kernels: the int8 path ONNX Runtime takes on this
    CPU (cpu_features.py), which the exactness gates of quantized models were measured on."""
    return {"kind": "cpu", "backend": "onnxruntime", "machine": platform.machine(), "os": platform.system(),
            "int8_kernels": int8_kernels()}


def gpu_device(backend: str, **facts) -> dict:
    """The device field of a GPU build: {"backend": "onnxruntime" | "tensorrt", "kind": "cuda",
    "machine", "os", ...facts} (facts: where parity was verified, the GPU, ...)."""
    return {"kind": "cuda", "backend": backend, "machine": platform.machine(), "os": platform.system(), **facts}


def check_device(man, backend: str = "onnxruntime") -> None:
    """Refuse artifacts built for another backend / processor / OS, with what to do."""
    here, built = this_device(), man.device
    if built.get("backend") != backend:
        raise ManifestError(
            f"engines were built for backend {built.get('backend')!r} on {built.get('kind')!r}; this runtime "
            f"runs {backend!r}: rebuild with `specrt build` on this machine")
    for key in ("kind", "machine", "os"):
        if built.get(key) != here[key]:
            raise ManifestError(
                f"engines were built for {key}={built.get(key)!r}; this machine has {key}={here[key]!r}: "
                "rebuild the engines on this machine")
    check_int8_kernels(man, here["int8_kernels"])


def gated_kernels(man) -> list[str] | None:
    """The kernels (runtime/backends/ort_cpu.py kernel_fingerprint) a CPU folder's exactness
    gates hold on: its build's and every `specrt retime` that measured them again; None for
    folders built before specrt recorded them."""
    gated = man.device.get("gated_on")
    if gated is None:
        return None
    if not isinstance(gated, list) or not all(isinstance(g, dict) and isinstance(g.get("kernels"), str) for g in gated):
        raise ManifestError(f"device.gated_on={str(gated)[:200]!r} is not a list of {{\"kernels\": ...}} records: the "
                            "manifest was edited; run `specrt retime` on the folder to measure its gates again, or rebuild")
    return [g["kernels"] for g in gated]


def check_gated(man, here: str | None) -> None:
    """Refuse a CPU folder whose exactness gates were not measured on this machine's kernels
    (`here`: onnxruntime version and instruction set; None where /proc/cpuinfo cannot be read).
    Every guarantee of a folder is a property of the kernels that compute it: the decode and
    verify graphs' rows equal bit for bit, a batched row the same whatever the rows beside it,
    a prompt the same in any chunk or cache row. ONNX Runtime picks its kernels by instruction
    set (AVX2, AVX-512, VNNI, AMX) and changes them between versions, and another kernel may
    sum in another order. Folders built before the record, and machines whose flags cannot be
    read, have nothing to compare."""
    where = gated_kernels(man)
    if where is None or here is None or here in where:
        return
    raise GatesNotMeasuredError(
        f"this folder's exactness gates (greedy speculative output = plain decoding; a batched request's tokens "
        f"independent of its batch and of its prompt's chunks) were measured on [{'; '.join(map(str, where))}], "
        f"and this machine runs [{here}]: ONNX Runtime picks its CPU kernels by instruction set and version, and "
        "another kernel may round otherwise. Run `specrt retime ENGINES` on this machine (ENGINES: this folder; "
        "it measures the gates here and records them when they hold), or rebuild the engines here")


_KERNEL_NAMES = {"dot": "VNNI/AMX dot products", "avx2": "AVX2 without VNNI/AMX", "other": "not x86"}


def uses_int8_kernels(entry) -> bool:
    """Do this model's tokens depend on ONNX Runtime's int8 kernels? Its weights are quantized
    (precision int8 / int4 / int8-qdq: MatMulNBits with int8 compute, Q/DQ), or its prompt
    chunks run an int8 graph (the batched model's `--batch-prefill rowwise`, source.prefill_graph)."""
    return entry.precision not in ("fp32", "fp16") or "prefill_graph" in (entry.source or {})


def check_int8_kernels(man, here: str) -> None:
    """Refuse a target or batched model whose tokens depend on int8 kernels when the build's CPU
    took another int8 path than this one (`here`, cpu_features.int8_kernels()): the build's gates
    (decode rows = verify rows, batch and window invariance) were measured on the build's path.
    A draft is not checked: it changes which tokens are proposed, never which are emitted.
    Manifests written before the field existed, and "unknown" on either side, have nothing to compare."""
    built = man.device.get("int8_kernels")
    if built is None or "unknown" in (built, here) or built == here:
        return
    bound = [f"{role} ({m.precision})" for role, m in man.models.items()
             if role in ("target", "batch") and uses_int8_kernels(m)]
    if bound:
        raise Int8KernelsError(
            f"models {' and '.join(bound)} were built and gated on a CPU whose ONNX Runtime int8 kernels take the "
            f"{built!r} path ({_KERNEL_NAMES.get(built, 'unrecorded')}); this CPU takes the {here!r} path "
            f"({_KERNEL_NAMES.get(here, here)}), which rounds int8 products differently: the build's guarantees "
            "(greedy speculative output = plain decoding, a batched request's tokens independent of its batch) "
            "were not measured here. Rebuild the engines on this machine (`specrt build ...` with the same "
            "options); fp32 targets do not depend on the int8 path")
