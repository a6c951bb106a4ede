"""ONNX Runtime CUDA backend, "ort-cuda": fp16 GroupQueryAttention graphs with a constant
total_sequence_length, a device-resident KV cache and one CUDA graph per decode/verify
graph. Implements base.ModelRunner; registered (lazily, backends/__init__.py) for
manifests with device {"backend": "onnxruntime", "kind": "cuda"}.

    step(graph, tokens, start)
      ids_host[0,:n] = tokens; past_len_host[0] = start     host staging, reused
      ids.update_inplace(ids_host), past_len.update_inplace  same device address every step
      lifecycle.run(graph)     prefill: eager (gpu_graph_id -1); decode/verify: warm-up, capture, replay
      logits_host <- logits    device -> the reused host buffer [1, T, V] float32
    KV: past_k_i and present_k_i are bound to ONE device OrtValue [1, KVH, capacity, D] fp16
    (GQA's share-buffer mode, GPU.md A6); rewinding moves an integer.

`execution="cpu"` runs the same class on CPUExecutionProvider with CPU OrtValues and the
CPU capture emulation (device.CpuDevice semantics): that is how the tests drive the real
fp16 graphs, the in-place updates and the graph lifecycle without a GPU. Everything that
differs on CUDA is in ort_device.OrtCudaDevice and `_providers`, marked GPU-ONLY. It ran
once on an H100 (tiny model, 2026-12-05; docs/gpu.md): output identical to the fp32 CPU
engines, decode captured and replayed; the verify window was never captured there.
"""
from __future__ import annotations

from pathlib import Path

import onnx

from specrt.errors import BackendError, ConfigError, GraphFileError, ManifestError
from specrt.manifest import ModelEntry, Shapes
from specrt.runtime.backends.base import check_built_for
from specrt.runtime.backends.device import Buffer, DeviceKVCache, Step
from specrt.runtime.backends.gpu_errors import INSTALL_CUDA, CudaUnavailableError
from specrt.runtime.backends.lifecycle import GraphLifecycle, DeviceRunner
from specrt.runtime.backends.ort_device import OrtCudaDevice, OrtDevice
from specrt.runtime.backends.ort_cpu import DTYPES, _check_signature, check_weights_file, hidden_output, io_dtypes, \
    session_options

EXECUTIONS = ("cuda", "cpu")
WARMUP_RUNS = 3          # eager runs per graph before capture (GPU.md A3: ORT needs >= 2, do >= 3)
CAPTURED_GRAPHS = ("decode", "verify")
_preloaded = False


class _Graph:
    """One static-shape graph bound to fixed buffers (all allocated here, once).

    ids [1, T] int64   past_len [1] int64   logits [1, T, V] float32   past/present: the cache."""

    def __init__(self, session, name: str, tokens: int, entry: ModelEntry, cache: DeviceKVCache, device):
        d, io, dt = entry.dims, entry.io, io_dtypes(entry)
        self.session, self.name, self.tokens, self.device = session, name, tokens, device
        self.ids_host = device.host((1, tokens), DTYPES[dt["input_ids"]])
        self.past_len_host = device.host((1,), DTYPES[dt["past_len"]])
        self.logits_host = device.host((1, tokens, int(d["vocab"])), DTYPES[dt["logits"]])
        self.ids = device.alloc((1, tokens), DTYPES[dt["input_ids"]])
        self.past_len = device.alloc((1,), DTYPES[dt["past_len"]])
        self.logits = device.alloc(self.logits_host.array.shape, DTYPES[dt["logits"]])
        self.binding = session.io_binding()
        self.bound: dict[str, Buffer] = {}
        self.on_rebind = None   # set by the model: invalidates this graph's CUDA graph
        self.bind(io["input_ids"], self.ids)
        self.bind(io["past_len"], self.past_len)
        self.bind(io["logits"], self.logits, output=True)
        for i in range(entry.layers):
            for past, present, buf in ((io["past_key"], io["present_key"], cache.keys[i]),
                                       (io["past_value"], io["present_value"], cache.values[i])):
                self.bind(past % i, buf)
                self.bind(present % i, buf, output=True)   # same buffer: written in place

    def bind(self, name: str, buf: Buffer, *, output: bool = False) -> None:
        """Bind a tensor to a buffer. Re-binding after capture invalidates this graph's CUDA graph."""
        (self.binding.bind_ortvalue_output if output else self.binding.bind_ortvalue_input)(name, buf.handle)
        if name in self.bound and self.on_rebind is not None:
            self.on_rebind(self.name)
        self.bound[name] = buf

    def addresses(self) -> tuple[int, ...]:
        return tuple(b.handle.data_ptr() for b in self.bound.values())

    def run(self, run_options) -> None:
        self.session.run_with_iobinding(self.binding, run_options)


class OrtCudaModel(DeviceRunner):
    """All graphs of one model over one device KV cache (Polygraphy-style lifecycle:
    `activate()` loads and binds, `deactivate()` releases graphs and buffers; usable as a
    context manager). `step` returns a view of a reused host buffer: read it before the next step.

    execution: "cuda" (default; needs onnxruntime-gpu and an NVIDIA GPU) or "cpu" (the same
    buffers, bindings and lifecycle on CPUExecutionProvider, for tests). warmup: eager runs
    per decode/verify graph before capture. cuda_graphs=False: never capture."""

    def __init__(self, root: Path, entry: ModelEntry, shapes: Shapes, *, cache: DeviceKVCache | None = None,
                 graphs: tuple[str, ...] | None = None, threads: int = 2, memory: str = "fast",
                 profile_dir: Path | None = None, execution: str = "cuda", warmup: int = WARMUP_RUNS,
                 cuda_graphs: bool = True, device_id: int = 0, ort=None):
        if execution not in EXECUTIONS:
            raise ConfigError(f"execution={execution!r}; choose one of {EXECUTIONS}")
        if memory != "fast":
            raise ConfigError(f"memory={memory!r}: the ort-cuda backend keeps one copy of the weights per graph "
                              "on the GPU; use memory='fast'")
        self.root, self.entry, self.shapes = Path(root), entry, shapes
        self.execution, self.threads, self.profile_dir = execution, threads, profile_dir
        self.names = tuple(graphs or entry.graphs)
        self.shares_cache = cache is not None
        self.cache = cache
        self._ort, self._device_id = ort, device_id
        self.lifecycle: GraphLifecycle | None = None
        self._warmup, self._cuda_graphs = warmup, cuda_graphs
        self.active = False

    # --- lifecycle ------------------------------------------------------------------------
    def activate(self) -> "OrtCudaModel":
        if self.active:
            return self
        ort = self._ort or _import_ort()
        entry, dt = self.entry, io_dtypes(self.entry)
        if not entry.in_place:
            raise ManifestError(f"the {entry.role} graphs return their K/V instead of writing the cache in place; the "
                                "ort-cuda backend binds one device buffer as past and present: rebuild with "
                                "`specrt build --backend ort-cuda` (attention gqa)")
        if self.execution == "cuda":
            if dt["kv"] != "float16":
                raise ManifestError(f"the {entry.role} KV cache is {dt['kv']}; ONNX Runtime's CUDA GroupQueryAttention "
                                    "runs fp16 only: rebuild with `specrt build --backend ort-cuda` (fp16 graphs)")
            _require_cuda_provider(ort)
            for g in self.names:   # with or without capture: see _check_static_total
                if (path := self.root / entry.graphs[g].file).is_file():
                    _check_static_total(path, self.shapes.kv_capacity)
            device = OrtCudaDevice(ort, self._device_id)
        else:
            device = OrtDevice(ort, "cpu")
        d = entry.dims
        self.device = device
        if self.cache is None:
            self.cache = DeviceKVCache(device, entry.layers, int(d["kv_heads"]), self.shapes.kv_capacity,
                                       int(d["head_dim"]), DTYPES[dt["kv"]])
        check_weights_file(self.root, entry)
        self.lifecycle = GraphLifecycle(device, warmup=self._warmup, enabled=self._cuda_graphs)
        self.graphs: dict[str, _Graph] = {}
        for g in self.names:
            captured = g in CAPTURED_GRAPHS
            path = self.root / entry.graphs[g].file
            session = self._session(ort, path, captured and self._cuda_graphs)
            kv = (self.cache.keys[0].shape, dt["kv"])
            tokens = entry.graphs[g].tokens
            io = entry.io
            _check_signature(session, path, {
                io["input_ids"]: ((1, tokens), dt["input_ids"]), io["past_len"]: ((1,), dt["past_len"]),
                **{io[k] % i: kv for i in range(entry.layers) for k in ("past_key", "past_value")},
            }, {
                io["logits"]: ((1, tokens, int(d["vocab"])), dt["logits"]),
                **{io[k] % i: kv for i in range(entry.layers) for k in ("present_key", "present_value")},
                **hidden_output(entry, tokens),
            })
            r = self.graphs[g] = _Graph(session, g, tokens, entry, self.cache, device)
            r.on_rebind = self.lifecycle.invalidate
            self.lifecycle.add(Step(g, r.run, r.addresses, owner=session), capture=captured)
        self.active = True
        return self

    def deactivate(self) -> None:
        if not self.active:
            return
        self.lifecycle.release()
        self.graphs = {}
        if not self.shares_cache:
            self.cache.free()
            self.cache = None
        self.active = False

    def _session(self, ort, path: Path, capture: bool):
        if not path.is_file():
            raise GraphFileError(f"graph file {path} is missing: rebuild the engines")
        if capture and self.execution != "cuda":    # on CUDA, activate checked every graph already
            _check_static_total(path, self.shapes.kv_capacity)
        so = session_options(self.threads)
        if self.profile_dir:
            so.enable_profiling = True
            so.profile_file_prefix = str(Path(self.profile_dir) / f"{self.entry.role}-{path.stem}")
        providers = _providers(capture, self._device_id) if self.execution == "cuda" else ["CPUExecutionProvider"]
        try:
            session = ort.InferenceSession(str(path), so, providers=providers)
        except Exception as e:
            raise BackendError(
                f"ONNX Runtime {ort.__version__} could not load {path} on {self.execution} ({type(e).__name__}: "
                f"{str(e).strip()[:500]}): if it says not all nodes are on the CUDA provider, the graph has ops "
                "CUDA graphs cannot capture; rebuild with `specrt build --backend ort-cuda`, or pass "
                "cuda_graphs=False") from e
        if self.execution == "cuda":
            check_on_cuda(session, path)
        return session

    # --- ModelRunner ------------------------------------------------------------------------
    def _shape(self, graph: str):
        return self.graphs[graph]

    def end_profiling(self) -> dict[str, str]:
        return {g: r.session.end_profiling() for g, r in self.graphs.items()}



def open_model(root, entry, shapes, **kw) -> OrtCudaModel:
    """Backend.open_model: an activated OrtCudaModel."""
    return OrtCudaModel(root, entry, shapes, **kw).activate()


def check_device(man, *, ort=None) -> None:
    """Backend.check_device: refuse engines for another backend, OS or processor, and a machine
    without ONNX Runtime's CUDA provider."""
    check_built_for(man.device, "ort-cuda", "onnxruntime", "cuda")
    _require_cuda_provider(ort or _import_ort(), built_for=man.device)


def _require_cuda_provider(ort, built_for: dict | None = None) -> None:
    have = ort.get_available_providers()
    if "CUDAExecutionProvider" not in have:
        gpu = f" ({built_for['gpu_name']})" if built_for and built_for.get("gpu_name") else ""
        raise CudaUnavailableError(
            f"engines were built for backend 'onnxruntime' on 'cuda' (an NVIDIA GPU{gpu}); ONNX Runtime "
            f"{ort.__version__} here has no CUDAExecutionProvider (it has {', '.join(have)}): {INSTALL_CUDA}")
    _preload(ort)


def _preload(ort) -> None:
    """GPU-ONLY; ran on an H100 once (2026-12-05, tiny model, docs/gpu.md). Load the CUDA/cuDNN libraries of the nvidia-* wheels
    (ORT >= 1.21: `onnxruntime.preload_dlls`, GPU.md A9) before the first CUDA session."""
    global _preloaded
    if not _preloaded and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
        _preloaded = True


def _providers(capture: bool, device_id: int) -> list:
    """GPU-ONLY; ran on an H100 once (2026-12-05, tiny model, docs/gpu.md). CUDA provider options: CUDA graphs only for the
    graphs that are captured (decode, verify); prefill sessions never capture."""
    return [("CUDAExecutionProvider", {"device_id": str(device_id), "enable_cuda_graph": "1" if capture else "0"})]


def check_on_cuda(session, path: Path) -> None:
    """ONNX Runtime falls back to the CPU when its CUDA provider fails to start: refuse that."""
    if session.get_providers()[0] != "CUDAExecutionProvider":
        raise CudaUnavailableError(f"ONNX Runtime fell back to {session.get_providers()[0]} for {path} (the CUDA "
                                   f"provider failed to start: CUDA 13 / cuDNN 9 libraries missing?): {INSTALL_CUDA}")


def _check_static_total(path: Path, capacity: int, batched: bool = False) -> None:
    """Every GroupQueryAttention reads a constant total_sequence_length (= the buffer length):
    ORT reads that input on the host, so a computed one would be frozen into the CUDA graph.
    Required on CUDA with or without capture: measured on an H100 (2026-12-05, onnxruntime-gpu
    1.31.1, scripts/gpu_check.sh), the fp16 gqa graph with a computed length gave prefill
    logits off by up to 17 (tolerance 0.32) on the tiny model, the constant-length form 0.05."""
    proto = onnx.load(str(path), load_external_data=False)
    consts = {i.name for i in proto.graph.initializer}
    consts |= {n.output[0] for n in proto.graph.node if n.op_type == "Constant"}
    gqa = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    computed = [n.name or n.output[0] for n in gqa if len(n.input) < 7 or n.input[6] not in consts]
    if not gqa or computed:
        raise ManifestError(
            f"{path} computes GroupQueryAttention's total_sequence_length ({', '.join(computed[:3]) or 'no GQA'}); "
            f"on CUDA it must be the constant buffer length {capacity} (a computed one is frozen into a "
            "CUDA graph, and gave wrong prompt logits on ONNX Runtime 1.31.1 CUDA even without one): "
            + ("no build makes such batched graphs yet (`specrt build --batch` is CPU-only); run the batched "
               "graph on the CPU" if batched else
               "rebuild with `specrt build --backend ort-cuda` (static total_sequence_length)"))


def _import_ort():
    import onnxruntime
    return onnxruntime
