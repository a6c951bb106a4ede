"""Quantized variants of an exported model, and the data they are calibrated on.

- `quantize.py`: weight-only quantization of exported graphs with ONNX Runtime's tools
  (MatMulNBits 4/8-bit, `quantize_dynamic`), repacked into one shared weights file.
- `int8.py`: the INT8 draft copies of a target.
- `qdq.py`, `qdq_rules.py`, `qdq_parity.py`: static INT8 Q/DQ graphs in TensorRT's form
  (`specrt qdq`, built into a folder by specrt/builder/qdq_engine.py).
- `dataset.py`, `data/`: the calibration / evaluation prompt set.
The build's gates (agreement, identity, plans) are in specrt/builder/gates/.
"""
