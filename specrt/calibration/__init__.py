"""Quantized variants of an exported model, with their cost in agreement measured.

This stage so far provides dynamic INT8 (ONNX Runtime `quantize_dynamic`), which is
enough for a CPU draft. Static INT8 with symmetric Q/DQ for TensorRT and weight-only
INT4 are the calibration issue's work.
"""
