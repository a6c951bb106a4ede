"""Per-backend engine builders over a finished ONNX build (its manifest in, engine files and
their manifest fields out). The ONNX Runtime backends run the ONNX graphs themselves and
need none; TensorRT plans are built here:

- `tensorrt.py`: the engine plan, the builder (TensorRT 11 API, GPU-only), Q/DQ rules, the
  compatibility check's build-side wrapper.
- `trt_build.py`: every planned engine built and written into manifest.json
  (`add_engines` during `specrt build --backend tensorrt`, `build_engines` on an existing folder).
- `errors.py`: their typed errors.
The build's orchestration (backend choice, manifest writer) is in specrt/builder/.
"""
