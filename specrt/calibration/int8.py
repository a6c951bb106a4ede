"""INT8 copies of an exported model for a CPU draft, packed with shared weights like the export.

Methods (measured on SmolLM2-135M, 2 cores; top-1 agreement with the fp32 target in
the shared-cache regime, decode step time relative to the fp32 target's):
- "blockwise" (default): ONNX Runtime's MatMulNBits, 8-bit weights in blocks of 64
  along K, symmetric, int8 compute (accuracy_level 4). Agreement ~0.98, ~0.4x time.
  Blocks of 64, not 32 (2026-12-06, the fp32 folder's batched draft graph): a draft step
  x0.93 / x0.83 / x0.89 of block 32's at 1 / 4 / 8 rows, the build's top-1 agreement
  0.989 (32: 0.995; 128: 0.940, its step x0.82). The single stream on the rebuilt default
  folder: x1.01 of block 32's in one interleaved run, same tokens (docs/benchmarks.md: what
  a faster draft buys depends more on how often the policy drafts). A draft's numbers never
  change a row's tokens.
- "dynamic": `quantize_dynamic`, per-channel int8 weights, activations quantized at run
  time. Agreement ~0.95, ~0.40x time. (Per-tensor scales: ~0.86.)
Neither needs calibration data. Static Q/DQ INT8 for TensorRT is the calibration issue's.
"""
from __future__ import annotations

from pathlib import Path

from specrt.calibration.quantize import QuantSpec, quantize_graphs

METHODS = ("blockwise", "dynamic")
BLOCK = 64
SPECS = {"blockwise": QuantSpec("matmulnbits", bits=8, block_size=BLOCK, accuracy_level=4),
         "dynamic": QuantSpec("dynamic")}


def quantize_model(export_dir: Path, export: dict, out_dir: Path, graphs: tuple[str, ...],
                   method: str = "blockwise", prepare: dict | None = None) -> dict:
    """prepare: graph -> transform of its fp32 ModelProto before quantization (e.g.
    vocab.trim_lm_head)."""
    assert method in METHODS, method
    return quantize_graphs(export_dir, export, out_dir, graphs, SPECS[method], prepare=prepare)
