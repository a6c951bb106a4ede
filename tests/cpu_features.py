"""What this CPU's integer kernels can do, for tests whose expected result depends on it.

ONNX Runtime's x86 int8 kernels (MLAS) take one path on CPUs with a dot-product instruction
(AVX-512 VNNI, AVX-VNNI, AMX) and another on AVX2 alone, which adds u8 x s8 product pairs in
int16 (saturating) and rounds MatMulNBits' int8-compute rows differently by row count.
Measured 2026-12-03 on an AVX2-only AMD EPYC (Zen 1): see the tests that use INT8_DOT."""
from __future__ import annotations

import platform
from pathlib import Path


def _int8_dot() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True                 # ARM's sdot/i8mm paths: not measured here; expect the exact path
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


INT8_DOT = _int8_dot()
AVX2_ONLY_REASON = ("ONNX Runtime's int8 kernels on an x86 CPU without VNNI/AMX (AVX2 only) break this property "
                    "(measured on an AVX2 EPYC, 2026-12-03); strict: it must pass on a CPU with VNNI/AMX")
