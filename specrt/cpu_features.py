"""Which int8 kernels ONNX Runtime runs on this CPU: the manifest records it at build time,
the runtime compares it before loading a quantized engine (manifest_device.check_device).

ONNX Runtime's x86 int8 kernels (MLAS; MatMulNBits with accuracy_level 4, MatMulIntegerToFloat,
DynamicQuantizeMatMul) take one path on CPUs with a dot-product instruction (AVX-512 VNNI,
AVX-VNNI, AMX) and another without (AVX2: u8 x s8 product pairs added in int16, saturating,
rows rounded differently by row count). The build's exactness gates (decode vs verify rows,
batch and window invariance) hold for the path they were measured on, not for the other.

Pure stdlib: manifest_device.py (the manifest's device checks) imports it.
"""
from __future__ import annotations

import platform
from pathlib import Path

DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})    # /proc/cpuinfo names
# int8_kernels() values: "dot" = x86 with a dot-product instruction; "avx2" = x86 without one
# (AVX2 or older); "other" = not x86 (ARM's sdot/i8mm paths: not measured); "unknown" = an x86
# CPU whose flags cannot be read (no /proc/cpuinfo: macOS, Windows): nothing to compare
KERNELS = ("dot", "avx2", "other", "unknown")


def _machine() -> str:
    return platform.machine()


def _read_cpuinfo() -> str | None:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


# the instruction-set flags ONNX Runtime's CPU kernels (MLAS: platform.cpp) choose their code
# paths by, as /proc/cpuinfo names them (x86 "flags", ARM "Features"): two CPUs that list the
# same of these run the same kernels, hence the same rounding, on the same onnxruntime
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "avx_vnni_int8", "amx_tile", "amx_int8", "amx_bf16",
             "amx_fp16", "asimd", "asimdhp", "asimddp", "fphp", "i8mm", "bf16", "sve", "sve2")


def kernel_isa() -> str | None:
    """This CPU's architecture and the ISA_FLAGS it has, e.g. "x86_64: avx avx2 fma f16c"
    (ISA_FLAGS order); None where /proc/cpuinfo cannot be read (macOS, Windows)."""
    text = _read_cpuinfo()
    line = next((ln for ln in (text or "").splitlines() if ln.startswith(("flags", "Features"))), None)
    if line is None or ":" not in line:
        return None
    have = set(line.split(":", 1)[1].split())
    return f"{_machine()}: " + " ".join(f for f in ISA_FLAGS if f in have)


def int8_kernels() -> str:
    """This CPU's int8 kernel path, one of KERNELS."""
    if _machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return "other"
    text = _read_cpuinfo()
    # every core lists the same flags; the first "flags" line is enough
    line = next((ln for ln in (text or "").splitlines() if ln.startswith("flags")), None)
    if line is None or ":" not in line:
        return "unknown"
    return "dot" if DOT_FLAGS & set(line.split(":", 1)[1].split()) else "avx2"
