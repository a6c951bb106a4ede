"""Which int8 kernels ONNX Runtime runs on this CPU: the manifest records it at build time,
the runtime compares it before loading a quantized engine (manifest.check_device).

ONNX Runtime's x86 int8 kernels (MLAS; MatMulNBits with accuracy_level 4, MatMulIntegerToFloat,
DynamicQuantizeMatMul) take one path on CPUs with a dot-product instruction (AVX-512 VNNI,
AVX-VNNI, AMX) and another without (AVX2: u8 x s8 product pairs added in int16, saturating,
rows rounded differently by row count). The build's exactness gates (decode vs verify rows,
batch and window invariance) hold for the path they were measured on, not for the other.

Pure stdlib: manifest.py imports it.
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
