"""What differs between a CUDA device and the CPU, behind one small interface, and the
CPU implementation of it (numpy buffers) that the tests drive.

    Device
      alloc(shape, dtype) -> Buffer      fixed memory, allocated once; .address never changes
      host(shape, dtype)  -> HostBuffer  reused host staging memory
      write(buf, host)                   host -> buf, in place (same address)
      read(buf, host)                    buf -> host (the host array is reused)
      copy(dst, dst_off, src, src_off, n) n bytes device -> device (a batched cache's row move)
      sync()                             wait for the device's stream
      eager(step)                        run a step now, no graph
      capture(step) -> graph             record the step as a graph AND leave its outputs computed
      replay(graph)                      run the recorded graph again (same buffers, new contents)
      release(graph), free(buf)

A `Step` is one static-shape graph bound to fixed buffers: `run(run_options)` enqueues
it once (run options: ONNX Runtime only; None elsewhere), `addresses()` lists every
buffer address it reads or writes. CUDA graphs bake those addresses in, so a buffer
that is re-bound after capture must invalidate the graph (lifecycle.GraphLifecycle.invalidate).

CpuDevice emulates capture: `capture` records the step and runs it once, `replay` runs
the recording, and refuses (StaleGraphError) when an address changed since the capture,
which a real CUDA graph would silently ignore (it would read the old buffer).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from specrt.runtime.backends.gpu_errors import StaleGraphError


@dataclass(frozen=True)
class Buffer:
    shape: tuple[int, ...]
    dtype: np.dtype
    address: int          # what a captured graph reads and writes
    handle: object        # numpy array (CPU), device pointer (cudart), OrtValue (ONNX Runtime)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class HostBuffer:
    array: np.ndarray
    handle: object = None   # ONNX Runtime: an OrtValue over `array`, the target of device -> host copies


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[object], None]
    addresses: Callable[[], tuple[int, ...]]
    owner: object = None    # the session / execution context it runs on (ORT releases graphs per session)


class Device(Protocol):
    name: str

    def alloc(self, shape, dtype) -> Buffer: ...
    def host(self, shape, dtype) -> HostBuffer: ...
    def write(self, dst: Buffer, src: HostBuffer | np.ndarray) -> None: ...
    def read(self, src: Buffer, dst: HostBuffer) -> None: ...
    def copy(self, dst: Buffer, dst_offset: int, src: Buffer, src_offset: int, nbytes: int) -> None: ...
    def sync(self) -> None: ...
    def eager(self, step: Step) -> None: ...
    def capture(self, step: Step) -> object: ...
    def replay(self, graph) -> None: ...
    def release(self, graph) -> None: ...
    def free(self, buf: Buffer) -> None: ...


@dataclass
class RecordedGraph:
    """CPU stand-in for a CUDA graph: the step and the addresses it was captured with."""
    step: Step
    addresses: tuple[int, ...]
    released: bool = False


@dataclass
class CpuDevice:
    """numpy buffers; capture records the step callable, replay calls it."""
    name: str = "cpu"
    graphs: list[RecordedGraph] = field(default_factory=list)   # every graph captured (tests read it)

    def alloc(self, shape, dtype) -> Buffer:
        arr = np.zeros(tuple(shape), dtype)
        return Buffer(tuple(arr.shape), arr.dtype, arr.ctypes.data, arr)

    def host(self, shape, dtype) -> HostBuffer:
        return HostBuffer(np.zeros(tuple(shape), dtype))

    def write(self, dst: Buffer, src) -> None:
        np.copyto(dst.handle, src.array if isinstance(src, HostBuffer) else src)

    def read(self, src: Buffer, dst: HostBuffer) -> None:
        np.copyto(dst.array, src.handle)

    def copy(self, dst: Buffer, dst_offset: int, src: Buffer, src_offset: int, nbytes: int) -> None:
        assert 0 <= dst_offset and dst_offset + nbytes <= dst.nbytes and 0 <= src_offset and \
            src_offset + nbytes <= src.nbytes, (dst_offset, src_offset, nbytes)
        ctypes.memmove(dst.address + dst_offset, src.address + src_offset, nbytes)

    def sync(self) -> None:
        pass

    def eager(self, step: Step) -> None:
        step.run(None)

    def capture(self, step: Step) -> RecordedGraph:
        graph = RecordedGraph(step, step.addresses())
        self.graphs.append(graph)
        step.run(None)
        return graph

    def replay(self, graph: RecordedGraph) -> None:
        assert not graph.released, graph.step.name
        now = graph.step.addresses()
        if now != graph.addresses:
            raise StaleGraphError(
                f"the {graph.step.name} graph was captured with buffers at {graph.addresses} and is replayed with "
                f"{now}: a CUDA graph would read the old buffers; the runner must invalidate the graph when it "
                "re-binds a buffer (GraphLifecycle.invalidate)")
        graph.step.run(None)

    def release(self, graph: RecordedGraph) -> None:
        graph.released = True

    def free(self, buf: Buffer) -> None:
        pass


class DeviceKVCache:
    """The KV cache on a device, allocated once (gpt-fast style) and zeroed.

        keys[i], values[i]: Buffer [batch=1, kv_heads, capacity, head_dim]

    Rows [0, length) are valid; the graphs write rows [start, start+T) in place (past and
    present are the same buffer). Rewinding moves an integer; nothing is copied."""

    def __init__(self, device: Device, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype=np.float16):
        self.device = device
        self.capacity = capacity
        self.dtype = np.dtype(dtype)
        shape = (1, kv_heads, capacity, head_dim)
        zeros = np.zeros(shape, self.dtype)   # masked rows must hold finite numbers (0 x NaN is NaN)
        self.keys = [device.alloc(shape, self.dtype) for _ in range(layers)]
        self.values = [device.alloc(shape, self.dtype) for _ in range(layers)]
        for buf in (*self.keys, *self.values):
            device.write(buf, zeros)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in (*self.keys, *self.values))

    def rewind_to(self, length: int) -> None:
        assert 0 <= length <= self.capacity, (length, self.capacity)
        self.length = length

    def free(self) -> None:
        for buf in (*self.keys, *self.values):
            self.device.free(buf)
        self.keys, self.values = [], []
