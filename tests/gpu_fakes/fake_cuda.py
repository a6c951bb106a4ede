"""A fake `cuda.bindings.runtime` and a fake `tensorrt` runtime that record every call.

Device memory is host memory (numpy arrays; a "device pointer" is the array's address),
so copies really move bytes. Stream capture is emulated: between cudaStreamBeginCapture
and cudaStreamEndCapture an enqueue is recorded instead of executed, and cudaGraphLaunch
runs the recording. The fake TensorRT engine computes a toy model, so runners built on
these fakes can be checked for the tokens they produce, not only for the calls they make:

    toy:  K_cache[layer 0][0, 0, p, 0] = token at position p (written in place)
          next token after position p = (token_p + token_{p-1} + bias(token_p)) % vocab
"""
from __future__ import annotations

import ctypes
import enum
import types

import numpy as np


class _Stream(int):
    pass


def fake_cudart(calls: list, *, devices: int = 1, gpu=("NVIDIA H200", 9, 0), fail: tuple = ()):
    rt = types.SimpleNamespace()
    rt.cudaError_t = enum.Enum("cudaError_t", {"cudaSuccess": 0, "cudaErrorNoDevice": 100,
                                               "cudaErrorStreamCaptureUnsupported": 900,
                                               "cudaErrorStreamCaptureInvalidated": 901})
    rt.cudaMemcpyKind = enum.Enum("cudaMemcpyKind", "cudaMemcpyHostToDevice cudaMemcpyDeviceToHost")
    rt.cudaStreamCaptureMode = enum.Enum("cudaStreamCaptureMode", "cudaStreamCaptureModeGlobal")
    ok = rt.cudaError_t.cudaSuccess
    rt.mem, rt.capturing = {}, None

    def err(name):
        return rt.cudaError_t.cudaErrorStreamCaptureInvalidated if name in fail else ok

    def cudaGetDeviceCount():
        return (ok, devices) if devices else (rt.cudaError_t.cudaErrorNoDevice, 0)

    def cudaGetDeviceProperties(i):
        return ok, types.SimpleNamespace(name=gpu[0].encode(), major=gpu[1], minor=gpu[2])

    def cudaStreamCreate():
        calls.append(("cudaStreamCreate",))
        return ok, _Stream(7)

    def cudaMalloc(n):
        arr = np.zeros(max(n, 1), np.uint8)
        rt.mem[arr.ctypes.data] = arr
        calls.append(("cudaMalloc", n))
        return ok, arr.ctypes.data

    def cudaFree(ptr):
        calls.append(("cudaFree", ptr))
        rt.mem.pop(ptr)
        return (ok,)

    def cudaMemcpyAsync(dst, src, n, kind, stream):
        assert rt.capturing is None, "a copy during capture would be baked into the graph"
        calls.append(("cudaMemcpyAsync", kind.name))
        ctypes.memmove(dst, src, n)
        return (ok,)

    def cudaStreamSynchronize(stream):
        if rt.capturing is not None:
            return (rt.cudaError_t.cudaErrorStreamCaptureUnsupported,)
        return (ok,)

    def cudaStreamBeginCapture(stream, mode):
        calls.append(("cudaStreamBeginCapture", mode.name))
        if "begin" in fail:
            return (err("begin"),)
        rt.capturing = []
        return (ok,)

    def cudaStreamEndCapture(stream):
        calls.append(("cudaStreamEndCapture",))
        ops, rt.capturing = rt.capturing, None
        return (err("end"), types.SimpleNamespace(ops=ops))

    def cudaGraphInstantiate(graph, flags):
        calls.append(("cudaGraphInstantiate", flags))
        return err("instantiate"), types.SimpleNamespace(ops=graph.ops)

    def cudaGraphLaunch(exe, stream):
        calls.append(("cudaGraphLaunch",))
        if "launch" in fail:
            return (err("launch"),)
        for op in exe.ops:
            op()
        return (ok,)

    def simple(name):
        def f(*a):
            calls.append((name,))
            return (ok,)
        return f

    def enqueue(stream, fn):
        if rt.capturing is not None:
            rt.capturing.append(fn)
        else:
            fn()

    def view(ptr, shape, dtype):
        return rt.mem[ptr].view(dtype)[:int(np.prod(shape))].reshape(shape)

    for f in (cudaGetDeviceCount, cudaGetDeviceProperties, cudaStreamCreate, cudaMalloc, cudaFree, cudaMemcpyAsync,
              cudaStreamSynchronize, cudaStreamBeginCapture, cudaStreamEndCapture, cudaGraphInstantiate,
              cudaGraphLaunch):
        setattr(rt, f.__name__, f)
    for name in ("cudaGraphExecDestroy", "cudaGraphDestroy", "cudaStreamDestroy"):
        setattr(rt, name, simple(name))
    rt.enqueue, rt.view = enqueue, view
    return rt


def fake_tensorrt(calls: list, cudart, entries: dict, capacity: int, *, version: str = "11.1.0.106", bias=None,
                  aliases: bool = True):
    """entries: role -> ModelEntry; capacity: KV rows. A plan file's bytes are b"PLAN <role> <graph>" (b"BAD..." does
    not deserialize). bias(role, token) -> int perturbs the toy model (a draft that differs)."""
    trt = types.ModuleType("tensorrt")
    trt.__version__ = version
    trt.TensorIOMode = enum.Enum("TensorIOMode", "INPUT OUTPUT")
    trt.DataType = enum.Enum("DataType", "FLOAT HALF INT64 INT32")
    dtypes = {"float32": trt.DataType.FLOAT, "float16": trt.DataType.HALF, "int64": trt.DataType.INT64}

    class Logger:
        WARNING = "WARNING"

        def __init__(self, severity):
            self.severity = severity

    class Context:
        def __init__(self, engine):
            self.engine, self.addresses = engine, {}

        def set_tensor_address(self, name, ptr):
            calls.append(("set_tensor_address", self.engine.label, name, ptr))
            self.addresses[name] = ptr
            return True

        def execute_async_v3(self, stream_handle):
            calls.append(("execute_async_v3", self.engine.label, cudart.capturing is not None))
            cudart.enqueue(stream_handle, self._compute)
            return True

        def _compute(self):
            e, a = self.engine, self.addresses
            m = e.entry
            io, T, V = m.io, e.tokens, int(m.dims["vocab"])
            ids = cudart.view(a[io["input_ids"]], (1, T), np.int64)[0]
            start = int(cudart.view(a[io["past_len"]], (1,), np.int64)[0])
            kv = (1, int(m.dims["kv_heads"]), e.capacity, int(m.dims["head_dim"]))
            k0 = cudart.view(a[io["past_key"] % 0], kv, np.float16)
            assert a[io["present_key"] % 0] == a[io["past_key"] % 0]
            logits = cudart.view(a[io["logits"]], (1, T, V), np.float32)
            k0[0, 0, start:start + T, 0] = ids
            logits[:] = 0
            for i in range(T):
                p = start + i
                prev = int(k0[0, 0, p - 1, 0]) if p > 0 else 0
                nxt = (int(ids[i]) + prev + (bias(e.role, int(ids[i])) if bias else 0)) % V
                logits[0, i, nxt] = 1.0

    class Engine:
        def __init__(self, role, graph):
            self.role, self.graph, self.label = role, graph, f"{role}/{graph}"
            self.entry = m = entries[role]
            self.tokens = m.graphs[graph].tokens
            self.capacity = capacity
            kv = (1, int(m.dims["kv_heads"]), self.capacity, int(m.dims["head_dim"]))
            io, kvd = m.io, dtypes[m.kv["dtype"]]
            self.tensors = {io["input_ids"]: ("INPUT", (1, self.tokens), trt.DataType.INT64),
                            io["past_len"]: ("INPUT", (1,), trt.DataType.INT64)}
            for i in range(m.layers):
                self.tensors[io["past_key"] % i] = ("INPUT", kv, kvd)
                self.tensors[io["past_value"] % i] = ("INPUT", kv, kvd)
            self.tensors[io["logits"]] = ("OUTPUT", (1, self.tokens, int(m.dims["vocab"])), trt.DataType.FLOAT)
            self.alias = {}
            for i in range(m.layers):
                self.tensors[io["present_key"] % i] = ("OUTPUT", kv, kvd)
                self.tensors[io["present_value"] % i] = ("OUTPUT", kv, kvd)
                self.alias[io["present_key"] % i] = io["past_key"] % i if aliases else io["past_value"] % i
                self.alias[io["present_value"] % i] = io["past_value"] % i
            self.names = list(self.tensors)

        num_io_tensors = property(lambda self: len(self.names))

        def get_tensor_name(self, i):
            return self.names[i]

        def get_tensor_mode(self, name):
            return trt.TensorIOMode[self.tensors[name][0]]

        def get_tensor_shape(self, name):
            return self.tensors[name][1]

        def get_tensor_dtype(self, name):
            return self.tensors[name][2]

        def get_aliased_input_tensor(self, name):
            return self.alias.get(name)

        def create_execution_context(self):
            calls.append(("create_execution_context", self.label))
            return Context(self)

    class Runtime:
        def __init__(self, logger):
            assert isinstance(logger, Logger)

        def deserialize_cuda_engine(self, blob):
            calls.append(("deserialize_cuda_engine", bytes(blob)))
            if bytes(blob).startswith(b"BAD"):
                return None
            _, role, graph = bytes(blob).decode().split()
            return Engine(role, graph)

    trt.Logger, trt.Runtime = Logger, Runtime
    return trt
