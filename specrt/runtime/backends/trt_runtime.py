"""TensorRT backend, "tensorrt": one deserialized engine and one execution context per
static-shape graph, every tensor address set once, one CUDA graph per decode/verify engine.
Implements base.ModelRunner; registered (lazily, backends/__init__.py) for manifests with
device {"backend": "tensorrt", "kind": "cuda"}.

GPU-ONLY, NOT YET RUN ON A GPU: TensorRT cannot be installed where this was written. The
calls follow the TensorRT 11 Python API (GPU.md B6) and are tested against a fake
`tensorrt` module and a fake cudart (tests/gpu_fakes/test_trt_runtime.py); the buffer plan,
lifecycle and refusals are the same code the CPU tests run.

    activate: trt.Runtime ─ deserialize_cuda_engine(plan) ─ create_execution_context
              ─ set_tensor_address(name, ptr) for every I/O tensor, once
                  (present_k_i / present_v_i bound to past_k_i / past_v_i: the KV cache is
                   one device buffer [1, KVH, capacity, D], TensorScatter writes it in place)
    step:     ids, past_len -> device (same addresses) ─ lifecycle.run(graph) ─ logits -> host
              prefill: execute_async_v3 every time; decode/verify: one plain enqueue, then
              capture (cudaStreamBeginCapture ... cudaGraphInstantiate), then cudaGraphLaunch
"""
from __future__ import annotations

import importlib
import logging
from pathlib import Path


from specrt.errors import BackendError, ConfigError, GraphFileError, ManifestError
from specrt.manifest import ModelEntry, Shapes
from specrt.runtime.backends.base import check_built_for
from specrt.runtime.backends.cuda_device import CudaDevice, gpu_identity, load_cudart
from specrt.runtime.backends.device import Buffer, DeviceKVCache, Step
from specrt.runtime.backends.gpu_errors import CudaUnavailableError, TensorRTUnavailableError
from specrt.runtime.backends.lifecycle import GraphLifecycle, DeviceRunner
from specrt.runtime.backends.ort_cpu import DTYPES, io_dtypes
from specrt.runtime.backends.trt_compat import check_engine_compat

WARMUP_RUNS = 1   # plain enqueues before capture (trtexec: "at least once", GPU.md B6)
CAPTURED_GRAPHS = ("decode", "verify")
TRT_DTYPES = {"FLOAT": "float32", "HALF": "float16", "INT64": "int64", "INT32": "int32"}
log = logging.getLogger(__name__)


def load_tensorrt():
    """The `tensorrt` module, or TensorRTUnavailableError saying what is missing."""
    try:
        return importlib.import_module("tensorrt")
    except ImportError as e:
        raise TensorRTUnavailableError(
            f"TensorRT is not installed ({e}): these engines need the `tensorrt` Python package (TensorRT 11, CUDA 13) "
            "on a machine with an NVIDIA GPU; or rebuild with `specrt build` on this machine (`--backend ort-cpu`)") from None


def engines_info(man) -> dict | None:
    """The manifest's top-level "engines" fields (TensorRT version, GPU, compute capability,
    hardware-compatibility level), from a Manifest, a namespace or the raw dict."""
    info = man.get("engines") if isinstance(man, dict) else getattr(man, "engines", None)
    return info if isinstance(info, dict) else None


def engine_file(entry: ModelEntry, graph: str) -> dict:
    """{"file", "sha256", "bytes"} of one graph's plan, from the manifest's graph entry."""
    g = entry.graphs[graph]
    info = g.get("engine") if isinstance(g, dict) else getattr(g, "engine", None)
    if not isinstance(info, dict) or not isinstance(info.get("file"), str):
        raise ManifestError(f"the manifest names no TensorRT engine for the {entry.role} {graph} graph: rebuild with "
                            "`specrt build --backend tensorrt`")
    return info


def check_device(man, *, trt=None, cudart=None) -> None:
    """Backend.check_device: refuse engines for another backend / OS / processor, a machine
    without TensorRT, cuda-python or a GPU, and a GPU or TensorRT the plans were not built for."""
    check_built_for(man["device"] if isinstance(man, dict) else man.device, "tensorrt", "tensorrt", "cuda")
    info = engines_info(man)
    if info is None:
        raise ManifestError("the manifest has no \"engines\" section (TensorRT version, GPU): it is damaged or from "
                            "another build: rebuild with `specrt build --backend tensorrt`")
    trt = trt if trt is not None else load_tensorrt()
    gpu = gpu_identity(cudart if cudart is not None else load_cudart())
    if gpu is None:
        raise CudaUnavailableError(
            f"these TensorRT engines were built for an NVIDIA GPU ({info.get('gpu_name')}, compute capability "
            f"{info.get('compute_capability')}); this machine has no usable CUDA device: run them on such a GPU, "
            "or rebuild with `specrt build` on this machine (`--backend ort-cpu`)")
    for warning in check_engine_compat(info, {"tensorrt_version": str(trt.__version__), **gpu}):
        log.warning(warning)


class _Engine:
    """One engine, its execution context and its fixed buffers (addresses set once)."""

    def __init__(self, trt, engine, name: str, tokens: int, entry: ModelEntry, cache: DeviceKVCache, device):
        io, dt, d = entry.io, io_dtypes(entry), entry.dims
        if io.get("hidden_states"):
            raise ManifestError(f"the {entry.role} graphs return {io['hidden_states']} (export hidden_layers); the "
                                "TensorRT runner does not bind it yet: export without hidden_layers")
        self.name, self.tokens, self.engine = name, tokens, engine
        self.context = engine.create_execution_context()
        self.ids_host = device.host((1, tokens), DTYPES[dt["input_ids"]])
        self.past_len_host = device.host((1,), DTYPES[dt["past_len"]])
        self.logits_host = device.host((1, tokens, int(d["vocab"])), DTYPES[dt["logits"]])
        self.ids = device.alloc((1, tokens), DTYPES[dt["input_ids"]])
        self.past_len = device.alloc((1,), DTYPES[dt["past_len"]])
        self.logits = device.alloc(self.logits_host.array.shape, DTYPES[dt["logits"]])
        self.device = device
        inputs = {io["input_ids"]: self.ids, io["past_len"]: self.past_len}
        outputs = {io["logits"]: self.logits}
        for i in range(entry.layers):
            for past, present, buf in ((io["past_key"], io["present_key"], cache.keys[i]),
                                       (io["past_value"], io["present_value"], cache.values[i])):
                inputs[past % i] = buf
                outputs[present % i] = buf   # aliases its input: TensorRT requires the same address
        _check_engine(trt, engine, name, inputs, outputs)
        self.bound: dict[str, Buffer] = {}
        for tensor, buf in {**inputs, **outputs}.items():
            if not self.context.set_tensor_address(tensor, buf.address):
                raise BackendError(f"TensorRT refused the address of {tensor} in the {name} engine: rebuild the engines")
            self.bound[tensor] = buf

    def run(self, _run_options=None) -> None:
        if not self.context.execute_async_v3(self.device.stream_handle):
            raise BackendError(f"TensorRT could not enqueue the {self.name} engine: see TensorRT's log above")

    def addresses(self) -> tuple[int, ...]:
        return tuple(b.address for b in self.bound.values())


def _check_engine(trt, engine, name: str, inputs: dict, outputs: dict) -> None:
    """The engine's I/O tensors are the manifest's, with its static shapes and dtypes, and
    each cache output aliases its cache input."""
    got = {}
    for i in range(engine.num_io_tensors):
        t = engine.get_tensor_name(i)
        mode = "input" if engine.get_tensor_mode(t) == trt.TensorIOMode.INPUT else "output"
        got[t] = (mode, tuple(int(x) for x in engine.get_tensor_shape(t)),
                  TRT_DTYPES.get(getattr(engine.get_tensor_dtype(t), "name", ""), "?"))
    want = {**{t: ("input", b.shape, b.dtype.name) for t, b in inputs.items()},
            **{t: ("output", b.shape, b.dtype.name) for t, b in outputs.items()}}
    if got != want:
        diff = {t: (got.get(t), w) for t, w in want.items() if got.get(t) != w}
        extra = sorted(set(got) - set(want))[:3]
        raise GraphFileError(f"the {name} TensorRT engine does not match the manifest (tensor: (engine, manifest)) "
                             f"{dict(list(diff.items())[:3])} unexpected {extra}: rebuild the engines")
    if hasattr(engine, "get_aliased_input_tensor"):   # TensorRT >= 10.x: which input an output must share
        for t, buf in outputs.items():
            want_alias = next((i for i, b in inputs.items() if b is buf), None)
            alias = engine.get_aliased_input_tensor(t) or None
            if alias != want_alias:
                raise GraphFileError(f"the {name} engine aliases output {t} to {alias}; the cache layout needs "
                                     f"{want_alias}: rebuild with `specrt build --backend tensorrt`")


class TrtModel(DeviceRunner):
    """All engines of one model over one device KV cache (Polygraphy-style lifecycle:
    `activate()` deserializes and binds, `deactivate()` releases graphs, contexts and buffers;
    usable as a context manager). `step` returns a view of a reused host buffer.

    trt / device: a `tensorrt` module and a device.Device (default: the real ones) — the
    tests pass fakes. warmup: plain enqueues per decode/verify engine before capture."""

    def __init__(self, root: Path, entry: ModelEntry, shapes: Shapes, *, cache: DeviceKVCache | None = None,
                 graphs: tuple[str, ...] | None = None, threads: int = 2, memory: str = "fast",
                 profile_dir: Path | None = None, warmup: int = WARMUP_RUNS, cuda_graphs: bool = True,
                 trt=None, device=None):
        if memory != "fast":
            raise ConfigError(f"memory={memory!r}: TensorRT engines hold their own weights; use memory='fast'")
        if profile_dir is not None:
            raise ConfigError("profile_dir: per-operator profiles are an ONNX Runtime feature; profile TensorRT "
                              "engines with `nsys profile` (NVTX ranges are on)")
        self.root, self.entry, self.shapes = Path(root), entry, shapes
        self.names = tuple(graphs or entry.graphs)
        self.shares_cache = cache is not None
        self.cache = cache
        self._trt, self._device, self._warmup, self._cuda_graphs = trt, device, warmup, cuda_graphs
        self.lifecycle: GraphLifecycle | None = None
        self.active = False

    def activate(self) -> "TrtModel":
        if self.active:
            return self
        trt = self._trt if self._trt is not None else load_tensorrt()
        entry, dt, d = self.entry, io_dtypes(self.entry), self.entry.dims
        device = self.cache.device if self.cache is not None else (self._device or CudaDevice())
        self.device = device
        if self.cache is None:
            self.cache = DeviceKVCache(device, entry.layers, int(d["kv_heads"]), self.shapes.kv_capacity,
                                       int(d["head_dim"]), DTYPES[dt["kv"]])
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self.lifecycle = GraphLifecycle(device, warmup=self._warmup, enabled=self._cuda_graphs)
        self.engines: dict[str, _Engine] = {}
        for g in self.names:
            engine = self._deserialize(g)
            e = self.engines[g] = _Engine(trt, engine, g, entry.graphs[g].tokens, entry, self.cache, device)
            self.lifecycle.add(Step(g, e.run, e.addresses, owner=e.context), capture=g in CAPTURED_GRAPHS)
        self.active = True
        return self

    def _deserialize(self, graph: str):
        info = engine_file(self.entry, graph)
        path = self.root / info["file"]
        if not path.is_file():
            raise GraphFileError(f"TensorRT engine {path} is missing: rebuild with `specrt build --backend tensorrt`")
        blob = path.read_bytes()
        if "bytes" in info and len(blob) != info["bytes"]:
            raise GraphFileError(f"{path} has {len(blob)} bytes, the manifest says {info['bytes']}: the engine is "
                                 "truncated or replaced; rebuild with `specrt build --backend tensorrt`")
        engine = self._runtime.deserialize_cuda_engine(blob)
        if engine is None:   # TensorRT logs why: version, device, or a damaged plan
            raise BackendError(f"TensorRT could not deserialize {path} (built for another TensorRT version or GPU, or "
                               "damaged; see TensorRT's log above): rebuild the TensorRT engines on this machine "
                               "(`specrt build --backend tensorrt`)")
        return engine

    def deactivate(self) -> None:
        if not self.active:
            return
        self.lifecycle.release()
        for e in self.engines.values():
            for buf in (e.ids, e.past_len, e.logits):
                self.device.free(buf)
        self.engines = {}            # contexts and engines are freed with their Python objects
        if not self.shares_cache:
            self.cache.free()
            self.cache = None
        self.active = False

    def _shape(self, graph: str):
        return self.engines[graph]

    def end_profiling(self) -> dict[str, str]:
        return {}



def open_model(root, entry, shapes, **kw) -> TrtModel:
    """Backend.open_model: an activated TrtModel."""
    return TrtModel(root, entry, shapes, **kw).activate()
