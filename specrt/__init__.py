"""specrt: static-shape speculative decoding from Hugging Face checkpoints to ONNX Runtime / TensorRT.

Stages (dependencies point one way): export -> calibration -> engines -> runtime.
The runtime never imports the earlier stages, torch or transformers.
"""

__version__ = "0.1.0"
