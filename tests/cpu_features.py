"""What this CPU's integer kernels can do, for tests whose expected result depends on it.

ONNX Runtime's x86 int8 kernels (MLAS) take one path on CPUs with a dot-product instruction
(AVX-512 VNNI, AVX-VNNI, AMX) and another on AVX2 alone, which adds u8 x s8 product pairs in
int16 (saturating) and rounds MatMulNBits' int8-compute rows differently by row count
(specrt/cpu_features.py tells them apart; the manifest records it, the runtime compares it).
Measured 2026-12-03 on an AVX2-only AMD EPYC (Zen 1): see the tests that use INT8_DOT."""
from __future__ import annotations

from specrt.cpu_features import int8_kernels

# non-x86 (ARM's sdot/i8mm paths: not measured here) and unreadable flags: expect the exact path
INT8_DOT = int8_kernels() != "avx2"
AVX2_ONLY_REASON = ("ONNX Runtime's int8 kernels on an x86 CPU without VNNI/AMX (AVX2 only) break this property "
                    "(measured on an AVX2 EPYC, 2026-12-03); strict: it must pass on a CPU with VNNI/AMX")
