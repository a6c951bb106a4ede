"""Quantized variants of an exported model, with their cost in agreement measured.

- `quantize.py`: weight-only quantization of exported graphs with ONNX Runtime's tools
  (MatMulNBits 4/8-bit, `quantize_dynamic`), repacked into one shared weights file.
- `int8.py`: the INT8 draft copies of a target.
- `rows.py`: a one-token graph on the multi-row kernels (plain decoding that rounds as
  the verify pass does).
- `identity.py`: decode-vs-verify agreement (the build refuses a target whose verify
  rows pick other tokens) and a quantized target's agreement with fp32.
- `measure.py`: a draft's top-1 agreement with its target.
Static Q/DQ INT8 for TensorRT and calibration data sets are later work.
"""
