"""ONNX -> runnable artifacts, described by a manifest.

CPU: the ONNX graphs themselves, run by ONNX Runtime with the session settings the
runtime applies (global thread pool, shared memory-mapped weights). TensorRT engines
are the engines issue's work.
"""
