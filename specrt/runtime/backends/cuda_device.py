"""device.Device on a CUDA GPU through the CUDA runtime bindings
(`from cuda.bindings import runtime as cudart`, cuda-python >= 12.6 / 13): raw device
pointers, one non-default stream, and CUDA graphs captured by stream capture (GPU.md B6).

    capture(step):  cudaStreamBeginCapture(stream, Global) ─ step.run ─ cudaStreamEndCapture
                    ─ cudaGraphInstantiate(graph, 0) ─ cudaGraphLaunch   (capture does not execute)
    replay(graph):  cudaGraphLaunch(exec, stream)

Every cudart call returns (cudaError_t, *values); `_call` turns a failure into BackendError
(CaptureError during capture). Host staging buffers are ordinary numpy arrays (pageable):
cudaMemcpyAsync from them is staged by the driver before it returns, so they may be reused
at once. Nothing here imports cuda at module import; `load_cudart()` does, with a typed error.
"""
from __future__ import annotations

import importlib

import numpy as np

from specrt.errors import BackendError
from specrt.runtime.backends.device import Buffer, HostBuffer, Step
from specrt.runtime.backends.gpu_errors import CaptureError, TensorRTUnavailableError


def load_cudart():
    """`cuda.bindings.runtime`, or TensorRTUnavailableError naming the package to install."""
    try:
        return importlib.import_module("cuda.bindings.runtime")
    except ImportError as e:
        raise TensorRTUnavailableError(
            f"the CUDA runtime bindings are not installed ({e}): `pip install cuda-python` (cuda-bindings, CUDA 13) on "
            "a machine with an NVIDIA GPU, or rebuild with `specrt build` on this machine (`--backend ort-cpu`)") from None


def gpu_identity(cudart, device: int = 0) -> dict:
    """GPU-ONLY, NOT YET RUN ON A GPU. {"gpu_name", "compute_capability"} of `device`, or None
    when this machine has no usable CUDA device."""
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count <= device:
        return None
    err, prop = cudart.cudaGetDeviceProperties(device)
    if err != cudart.cudaError_t.cudaSuccess:
        return None
    name = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else str(prop.name)
    return {"gpu_name": name.rstrip("\x00"), "compute_capability": f"{prop.major}.{prop.minor}"}


class CudaDevice:
    """GPU-ONLY, NOT YET RUN ON A GPU (tested against a fake cudart). One stream for every
    copy, enqueue, capture and launch of the runners that share this device."""
    name = "cuda"

    def __init__(self, cudart=None):
        self.rt = cudart if cudart is not None else load_cudart()
        self.stream = self._call("cudaStreamCreate", self.rt.cudaStreamCreate())
        self.graphs_captured = 0

    @property
    def stream_handle(self) -> int:
        """The stream as the integer TensorRT's execute_async_v3 takes."""
        return int(self.stream)

    def _call(self, what: str, result, error=BackendError):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.rt.cudaError_t.cudaSuccess:
            raise error(f"{what} failed ({err}): check the GPU (nvidia-smi) and the CUDA 13 driver")
        return values[0] if len(values) == 1 else tuple(values) or None

    def alloc(self, shape, dtype) -> Buffer:
        """GPU-ONLY, NOT YET RUN ON A GPU."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        ptr = self._call("cudaMalloc", self.rt.cudaMalloc(nbytes))
        return Buffer(tuple(shape), np.dtype(dtype), int(ptr), int(ptr))

    def host(self, shape, dtype) -> HostBuffer:
        return HostBuffer(np.zeros(tuple(shape), dtype))

    def write(self, dst: Buffer, src) -> None:
        """GPU-ONLY, NOT YET RUN ON A GPU. host -> device on the stream (same device address)."""
        arr = src.array if isinstance(src, HostBuffer) else np.ascontiguousarray(src)
        assert arr.nbytes == dst.nbytes, (arr.shape, dst.shape)
        self._call("cudaMemcpyAsync", self.rt.cudaMemcpyAsync(
            dst.address, arr.ctypes.data, arr.nbytes, self.rt.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))

    def read(self, src: Buffer, dst: HostBuffer) -> None:
        """GPU-ONLY, NOT YET RUN ON A GPU. device -> host, then wait: the host array is ready."""
        self._call("cudaMemcpyAsync", self.rt.cudaMemcpyAsync(
            dst.array.ctypes.data, src.address, dst.array.nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDeviceToHost,
            self.stream))
        self.sync()

    def sync(self) -> None:
        self._call("cudaStreamSynchronize", self.rt.cudaStreamSynchronize(self.stream))

    def eager(self, step: Step) -> None:
        """GPU-ONLY, NOT YET RUN ON A GPU. One plain enqueue on the stream."""
        step.run(None)

    def capture(self, step: Step):
        """GPU-ONLY, NOT YET RUN ON A GPU. Record the step's enqueue as a CUDA graph, then launch
        it once (capture itself executes nothing). Global mode: any unsafe CUDA call from another
        thread during capture invalidates it (GPU.md A2)."""
        rt = self.rt
        self._call("cudaStreamBeginCapture", rt.cudaStreamBeginCapture(
            self.stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal), CaptureError)
        try:
            step.run(None)
        except Exception as e:
            rt.cudaStreamEndCapture(self.stream)   # leave the stream usable for the eager fallback
            raise CaptureError(f"enqueue under stream capture failed: {e}") from e
        graph = self._call("cudaStreamEndCapture", rt.cudaStreamEndCapture(self.stream), CaptureError)
        try:
            exe = self._call("cudaGraphInstantiate", rt.cudaGraphInstantiate(graph, 0), CaptureError)
        except CaptureError:
            rt.cudaGraphDestroy(graph)
            raise
        handle = {"graph": graph, "exec": exe}
        self.graphs_captured += 1
        self.replay(handle)
        return handle

    def replay(self, graph) -> None:
        """GPU-ONLY, NOT YET RUN ON A GPU."""
        self._call("cudaGraphLaunch", self.rt.cudaGraphLaunch(graph["exec"], self.stream))

    def release(self, graph) -> None:
        """GPU-ONLY, NOT YET RUN ON A GPU."""
        self.rt.cudaGraphExecDestroy(graph["exec"])
        self.rt.cudaGraphDestroy(graph["graph"])

    def free(self, buf: Buffer) -> None:
        """GPU-ONLY, NOT YET RUN ON A GPU."""
        self.rt.cudaFree(buf.address)

    def close(self) -> None:
        self.rt.cudaStreamDestroy(self.stream)
