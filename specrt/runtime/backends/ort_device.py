"""device.Device over ONNX Runtime OrtValues: fixed buffers written and read with
`OrtValue.update_inplace` (the address never changes), on "cpu" (OrtDevice, with the CPU
capture emulation of device.CpuDevice) or "cuda" (OrtCudaDevice, whose graphs are ONNX
Runtime's own, selected per run by the `gpu_graph_id` run option, GPU.md A1/A8).

    eager:    run with gpu_graph_id -1 (no capture, no replay)
    capture:  first run with a fresh id >= 1; ORT captures it (after up to ORT_PRECAPTURE_RUNS
              regular runs of its own, GPU.md A3) and replays it within the same run
    replay:   run with that id
"""
from __future__ import annotations

import itertools

import numpy as np

from specrt.errors import BackendError
from specrt.runtime.backends.device import Buffer, CpuDevice, HostBuffer, Step
from specrt.runtime.backends.gpu_errors import CaptureError

ORT_PRECAPTURE_RUNS = 2  # regular runs ORT itself may make under a new gpu_graph_id before it captures
EAGER_GRAPH_ID = "-1"    # gpu_graph_id that disables capture/replay for one run (prefill, warm-up)
_graph_ids = itertools.count(1)   # 0 is ORT's default id: never used


class OrtDevice(CpuDevice):
    """Buffers are OrtValues on `device_type` ("cpu" here; "cuda" in OrtCudaDevice); capture
    is CpuDevice's emulation. Writes and reads go through OrtValue.update_inplace, which
    keeps the destination's address."""

    def __init__(self, ort, device_type: str = "cpu", device_id: int = 0):
        super().__init__(name=f"onnxruntime-{device_type}")
        self.ort, self.device_type, self.device_id = ort, device_type, device_id

    def alloc(self, shape, dtype) -> Buffer:
        v = self.ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype).type, self.device_type,
                                                           self.device_id)
        return Buffer(tuple(shape), np.dtype(dtype), v.data_ptr(), v)

    def host(self, shape, dtype) -> HostBuffer:
        arr = np.zeros(tuple(shape), dtype)
        return HostBuffer(arr, self.ort.OrtValue.ortvalue_from_numpy(arr))   # shares arr's memory

    def write(self, dst: Buffer, src) -> None:
        dst.handle.update_inplace(src.array if isinstance(src, HostBuffer) else np.ascontiguousarray(src))

    def read(self, src: Buffer, dst: HostBuffer) -> None:
        dst.handle.update_inplace(src.handle)   # device -> host into dst.array (ORT copies across devices)


class OrtCudaDevice(OrtDevice):
    """GPU-ONLY; ran on an H100 once (2026-12-05, tiny model, docs/gpu.md). CUDA OrtValues; graphs are ONNX Runtime's own, chosen
    per run by the run option `gpu_graph_id` (GPU.md A1/A8): eager runs use -1, a graph's
    first run with its id captures it (after up to ORT_PRECAPTURE_RUNS regular runs ORT
    makes itself), later runs with the id replay it."""

    def __init__(self, ort, device_id: int = 0):
        super().__init__(ort, "cuda", device_id)
        self.eager_options = self._options(EAGER_GRAPH_ID)

    def _options(self, graph_id: str):
        ro = self.ort.RunOptions()
        ro.add_run_config_entry("gpu_graph_id", graph_id)
        return ro

    def eager(self, step: Step) -> None:
        """GPU-ONLY; ran on an H100 once (2026-12-05, tiny model, docs/gpu.md)."""
        step.run(self.eager_options)

    def copy(self, dst: Buffer, dst_offset: int, src: Buffer, src_offset: int, nbytes: int) -> None:
        """GPU-ONLY, NOT YET RUN ON A GPU. Device -> device with cudaMemcpy (synchronous). ONNX
        Runtime synchronizes its stream at the end of every run, so no kernel still uses the rows."""
        from specrt.runtime.backends.cuda_device import load_cudart
        rt = load_cudart()
        err, *_ = rt.cudaMemcpy(dst.address + dst_offset, src.address + src_offset, nbytes,
                                rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice)
        if err != rt.cudaError_t.cudaSuccess:
            raise BackendError(f"cudaMemcpy of a cache row failed ({err}): check the GPU (nvidia-smi)")

    def capture(self, step: Step):
        """GPU-ONLY; ran on an H100 once (2026-12-05, tiny model, docs/gpu.md). Failures are CaptureError (the lifecycle runs the step eagerly)."""
        graph_id = str(next(_graph_ids))
        graph = {"id": graph_id, "options": self._options(graph_id), "step": step, "runs": 0}
        self._run(graph)
        return graph

    def replay(self, graph) -> None:
        """GPU-ONLY; ran on an H100 once (2026-12-05, tiny model, docs/gpu.md)."""
        self._run(graph)

    def _run(self, graph) -> None:
        graph["runs"] += 1
        try:
            graph["step"].run(graph["options"])
        except Exception as e:
            if graph["runs"] > ORT_PRECAPTURE_RUNS + 1:   # long captured: a real failure, not a capture one
                raise
            raise CaptureError(f"ONNX Runtime could not capture gpu_graph_id {graph['id']}: {e}") from e

    def release(self, graph) -> None:
        """GPU-ONLY, NOT YET RUN ON A GPU. `release_captured_graph` exists from ORT 1.31 (GPU.md A1)."""
        session = graph["step"].owner
        if hasattr(session, "release_captured_graph"):
            session.release_captured_graph(int(graph["id"]))
