"""ONNX Runtime (CPU) backend, "ort-cpu": every graph of one model, with static IO binding.
Implements base.ModelRunner; registered for manifests with device {"backend": "onnxruntime",
"kind": "cpu"}.

Why it is built this way (measured on 2 cores, see docs/runtime.md):
- One global intra-op thread pool for the whole process, and spinning stopped after
  each run: with per-session pools, idle sessions spin and steal the cores from the
  session that is working, and speculation runs slower than plain decoding.
- Two memory modes. "fast" (default): each session loads the model's `weights.bin`
  itself and pre-packs its MatMul weights (MLAS); pre-packing is what makes the int8
  draft and the verify pass fast, and it costs one packed copy of the weights per
  session (ORT's Python API cannot share packed weights between sessions). "shared":
  the prefill and one-token graphs of a model use one memory-mapped copy of
  `weights.bin` (`add_initializer`, no pre-packing; ~1.2x / ~1.1x slower steps), while
  the verify graph and the int8 draft still pre-pack, so speculation keeps its speed
  (measured in docs/runtime.md; plain decoding pays the 1.1x).
- Inputs and outputs are bound once to preallocated numpy buffers (`io_binding`);
  a step only writes token ids and `past_len` in place and runs. Output buffers are
  reused: read `logits` before the next `run`.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from specrt import manifest as mf
from specrt.cpu_features import kernel_isa
from specrt.errors import BackendError, ConfigError, GraphFileError, ManifestError
from specrt.manifest import ModelEntry, Shapes
from specrt.runtime.backends.base import Backend, register
from specrt.runtime.backends.huge_pages import collapsed
from specrt.runtime.kv import KVCache

# manifest dtype names -> numpy, and ORT's NodeArg.type strings for the signature check
DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32}
ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)",
             "int32": "tensor(int32)"}

log = logging.getLogger(__name__)
_THREADS_CONFIGURED: int | None = None


def configure_threads(threads: int) -> int | None:
    """Create ORT's global thread pool once per process. Returns the pool size in force,
    or None when another component created the pools first (sessions then use their own
    pools with spinning disabled).

    The pool is process-wide and ONNX Runtime cannot resize it: asking for another size
    later raises ConfigError instead of silently running on the first caller's pool."""
    global _THREADS_CONFIGURED
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ConfigError(f"threads={threads!r} must be an integer >= 1")
    if _THREADS_CONFIGURED is None:
        try:
            ort.set_global_thread_pool_sizes(threads, 1)
            _THREADS_CONFIGURED = threads
        except Exception as e:  # ORT raises its own Fail type once pools exist
            log.warning("ONNX Runtime's global thread pool was created by another component (%s); specrt "
                        "sessions use their own pools of %d threads with spinning disabled", e, threads)
            _THREADS_CONFIGURED = -1
    elif _THREADS_CONFIGURED not in (-1, threads):
        raise ConfigError(
            f"threads={threads}: this process already runs ONNX Runtime's global thread pool with "
            f"{_THREADS_CONFIGURED} threads (set by the first specrt session), and it cannot be resized: pass "
            f"threads={_THREADS_CONFIGURED}, or use a separate process for another thread count")
    return None if _THREADS_CONFIGURED == -1 else _THREADS_CONFIGURED


def pool_threads() -> int | None:
    """Size of the process-wide pool in force (None before the first session, or when another
    component owns the pools)."""
    return _THREADS_CONFIGURED if _THREADS_CONFIGURED and _THREADS_CONFIGURED > 0 else None


MEMORY_MODES = ("fast", "shared")


def session_options(threads: int, memory: str = "fast") -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if configure_threads(threads) is not None:
        so.use_per_session_threads = False
    else:
        so.intra_op_num_threads = threads
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.add_session_config_entry("session.force_spinning_stop", "1")
    if memory == "shared":
        so.add_session_config_entry("session.disable_prepacking", "1")
    return so


def check_weights_file(root: Path, entry: ModelEntry) -> Path:
    path = root / entry.weights["file"]
    if not path.is_file():
        raise GraphFileError(f"weights file {path} is missing: rebuild the engines")
    size = path.stat().st_size
    if size != entry.weights["bytes"]:
        raise GraphFileError(f"{path} has {size} bytes, the manifest says {entry.weights['bytes']}: "
                             "the file is truncated or replaced; rebuild the engines")
    return path


class SharedWeights:
    """`weights.bin` mapped read-only once; one OrtValue per initializer, shared by sessions."""

    def __init__(self, path: Path, entry: ModelEntry):
        self.map = np.memmap(path, dtype=np.uint8, mode="r")
        self.values: dict[str, ort.OrtValue] = {}
        self.specs: dict[str, tuple] = {}   # name -> (shape, dtype, offset, length) from the manifest
        self._arrays = []  # keep the views alive as long as the OrtValues
        for name, (offset, length, dtype, shape) in entry.weights["initializers"].items():
            arr = self.map[offset:offset + length].view(np.dtype(dtype)).reshape(shape)
            self._arrays.append(arr)
            self.values[name] = ort.OrtValue.ortvalue_from_numpy(arr)
            self.specs[name] = (tuple(arr.shape), arr.dtype, offset, length)

    def add_to(self, so: ort.SessionOptions, graph_initializers: dict, path: Path) -> None:
        """graph_initializers: name -> the graph's TensorProto (dims, type and where its data
        lies in weights.bin; no data). The manifest's entry must be the (hashed) graph's own:
        the same shape and dtype, and the same bytes of the file, or it is refused here (a
        shifted offset would otherwise run, silently, on other weights)."""
        for name in graph_initializers.keys() & self.values.keys():
            t, (shape, dtype, offset, length) = graph_initializers[name], self.specs[name]
            ext = {e.key: e.value for e in t.external_data}
            want = (tuple(t.dims), np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)),
                    int(ext.get("offset", offset)), int(ext.get("length", length)))
            if (shape, dtype, offset, length) != want:
                raise ManifestError(f"the weights entry {name!r} in the manifest is {dtype}{list(shape)} at bytes "
                                    f"[{offset}, {offset + length}), but {path} has {want[1]}{list(want[0])} at "
                                    f"[{want[2]}, {want[2] + want[3]}) (damaged manifest): restore it or rebuild "
                                    "the engines")
            so.add_initializer(name, self.values[name])


class GraphRunner:
    """One static-shape graph bound to fixed buffers.

    ids: [1, T] int64   past_len: [1] int64   logits: [1, T, V] float32 (reused)
    new_k/new_v: L arrays [1, KVH, T, D] (reused)   past: bound to the cache buffers.
    """

    def __init__(self, path: Path, tokens: int, entry: ModelEntry, cache: KVCache,
                 weights: SharedWeights | None, threads: int, memory: str, profile_prefix: str | None = None):
        if not path.is_file():
            raise GraphFileError(f"graph file {path} is missing: rebuild the engines")
        so = session_options(threads, memory)
        if profile_prefix:   # ONNX Runtime's per-node profile (Chrome trace JSON) on end_profiling()
            so.enable_profiling = True
            so.profile_file_prefix = profile_prefix
        try:
            proto = onnx.load(str(path), load_external_data=False)
        except Exception as e:  # not a protobuf at all: the file is damaged
            raise GraphFileError(f"graph file {path} is not a readable ONNX file ({type(e).__name__}: {e}); it is "
                                 "corrupt: rebuild the engines") from None
        if weights is not None:
            weights.add_to(so, {i.name: i for i in proto.graph.initializer}, path)
        del proto
        try:
            self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as e:  # a graph ORT rejects: version, memory, or a damaged file (hash-checked by the caller)
            raise BackendError(
                f"ONNX Runtime {ort.__version__} could not load {path} ({type(e).__name__}: "
                f"{str(e).strip()[:500]}). If the engine files are intact, ONNX Runtime rejected the graph: install "
                f"the onnxruntime version the engines were built with (`specrt inspect` lists it), free memory, "
                "or rebuild the engines with this installation") from e
        d, io = entry.dims, entry.io
        dt = io_dtypes(entry)
        self.tokens = tokens
        self.in_place = entry.in_place
        self.ids = np.zeros((1, tokens), DTYPES[dt["input_ids"]])
        self.past_len = np.zeros((1,), DTYPES[dt["past_len"]])
        self.logits = np.zeros((1, tokens, int(d["vocab"])), DTYPES[dt["logits"]])
        kv_shape = (1, int(d["kv_heads"]), tokens, int(d["head_dim"]))
        out_kv = ("present_key", "present_value") if self.in_place else ("new_key", "new_value")
        # in place: the graph writes rows [past_len, past_len+T) of the cache itself
        self.new_k = [] if self.in_place else [np.zeros(kv_shape, cache.dtype) for _ in range(entry.layers)]
        self.new_v = [] if self.in_place else [np.zeros(kv_shape, cache.dtype) for _ in range(entry.layers)]
        cache_shape = cache.keys[0].shape
        kv = (cache_shape, dt["kv"])
        _check_signature(self.session, path, {
            io["input_ids"]: (self.ids.shape, dt["input_ids"]), io["past_len"]: (self.past_len.shape, dt["past_len"]),
            **{io[k] % i: kv for i in range(entry.layers) for k in ("past_key", "past_value")},
        }, {
            io["logits"]: (self.logits.shape, dt["logits"]),
            **{io[k] % i: kv if self.in_place else (kv_shape, dt["kv"])
               for i in range(entry.layers) for k in out_kv},
            **hidden_output(entry, self.logits.shape[1]),
        })
        b = self.binding = self.session.io_binding()
        self._hold = []  # OrtValues must outlive the binding

        def value(arr):
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            self._hold.append(v)
            return v

        b.bind_ortvalue_input(io["input_ids"], value(self.ids))
        b.bind_ortvalue_input(io["past_len"], value(self.past_len))
        b.bind_ortvalue_output(io["logits"], value(self.logits))
        for i in range(entry.layers):
            for j, (buf, past) in enumerate(((cache.keys[i], "past_key"), (cache.values[i], "past_value"))):
                v = value(buf)
                b.bind_ortvalue_input(io[past] % i, v)
                if self.in_place:   # one buffer for past and present: GroupQueryAttention's share-buffer mode
                    b.bind_ortvalue_output(io[out_kv[j]] % i, v)
                else:
                    b.bind_ortvalue_output(io[out_kv[j]] % i, value((self.new_k, self.new_v)[j][i]))

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


def hidden_output(entry: ModelEntry, tokens: int) -> dict:
    """The graphs' optional hidden-states output (export hidden_layers; read by trained draft
    heads, not bound here, so ONNX Runtime does not return it): name -> (shape, dtype)."""
    name = entry.io.get("hidden_states")
    if name is None:
        return {}
    layers = entry.dims.get("hidden_layers")
    if not layers:
        raise ManifestError(f"the {entry.role} graphs return {name} but dims.hidden_layers says which layers it "
                            "holds: the manifest is damaged; rebuild the engines")
    return {name: ((1, tokens, len(layers) * int(entry.dims["hidden"])), "float32")}


def io_dtypes(entry: ModelEntry) -> dict[str, str]:
    """The manifest's tensor dtypes (older manifests: the fp32 defaults), checked against what
    this backend can bind."""
    dt = {"input_ids": "int64", "past_len": "int64", "logits": "float32", "kv": entry.kv.get("dtype", "float32"),
          **(entry.io.get("dtypes") or {})}
    for name, v in dt.items():
        if v not in DTYPES:
            raise ManifestError(f"the manifest gives {entry.role} tensor {name} dtype {v!r}; the ort-cpu backend "
                                f"binds {sorted(DTYPES)}: rebuild the engines")
    return dt


def _check_signature(session, path: Path, inputs: dict, outputs: dict) -> None:
    """The graph's tensors are exactly the manifest's, with the static shapes and dtypes it promises.
    inputs/outputs: name -> (shape, manifest dtype)."""
    for kind, want, have in (("input", inputs, session.get_inputs()), ("output", outputs, session.get_outputs())):
        got = {t.name: (tuple(t.shape), t.type) for t in have}
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got))[:3], sorted(set(got) - set(want))[:3]
            raise GraphFileError(f"graph file {path} does not match the manifest: {kind}s missing {missing}, "
                                 f"unexpected {extra}; it belongs to another build: rebuild the engines")
        for name, (shape, dtype) in want.items():
            if got[name][0] != tuple(shape):
                raise GraphFileError(f"graph file {path}: {kind} {name} has shape {list(got[name][0])}, the manifest "
                                     f"implies {list(shape)}; graph and manifest are from different builds: "
                                     "rebuild the engines")
            if got[name][1] != ORT_TYPES[dtype]:
                raise GraphFileError(f"graph file {path}: {kind} {name} is {got[name][1]}, the manifest says "
                                     f"{dtype}; graph and manifest are from different builds: rebuild the engines")


class OrtModel:
    """All graphs of one model over one KV cache.

    `step(graph, tokens, start)` runs `graph` on `tokens` at positions start.., writes
    their K/V into the cache and returns the logits rows [n, V] (a view, reused).
    """

    def __init__(self, root: Path, entry: ModelEntry, shapes: Shapes, *, cache: KVCache | None = None,
                 graphs: tuple[str, ...] | None = None, threads: int = 2, memory: str = "fast",
                 profile_dir: Path | None = None):
        """profile_dir: record ONNX Runtime's per-operator profile of every graph there
        (costs time on every step: for `specrt profile`, never for serving)."""
        d = entry.dims
        self.entry = entry
        self.shares_cache = cache is not None      # steps write into another model's cache
        self.cache = cache or KVCache(entry.layers, int(d["kv_heads"]), shapes.kv_capacity, int(d["head_dim"]),
                                      dtype=DTYPES[io_dtypes(entry)["kv"]])
        weights_path = check_weights_file(root, entry)
        names = graphs or tuple(entry.graphs)
        # the verify pass and a single-graph model (the int8 draft: MatMulNBits is slow
        # unpacked) always pre-pack; in "shared" mode the others share the mapped weights
        modes = {g: "fast" if g == "verify" or len(entry.graphs) == 1 else memory for g in names}
        self.weights = SharedWeights(weights_path, entry) if "shared" in modes.values() else None
        with collapsed(f"{entry.role} graphs"):      # their packed weights on 2 MiB pages (huge_pages.py)
            self.graphs = {g: GraphRunner(root / entry.graphs[g].file, entry.graphs[g].tokens, entry, self.cache,
                                          self.weights if modes[g] == "shared" else None, threads, modes[g],
                                          str(Path(profile_dir) / f"{entry.role}-{g}") if profile_dir else None)
                           for g in names}

    def argmax_step(self, graph: str, tokens, start: int, out: np.ndarray) -> None:
        """Greedy choice of each row, into out [n] int64 (no allocation)."""
        np.argmax(self.step(graph, tokens, start), axis=-1, out=out)

    def end_profiling(self) -> dict[str, str]:
        """Stop profiling; graph -> the Chrome-trace JSON file ONNX Runtime wrote."""
        return {g: r.session.end_profiling() for g, r in self.graphs.items()}

    def step(self, graph: str, tokens, start: int) -> np.ndarray:
        r = self.graphs[graph]
        n = len(tokens)
        assert 0 < n <= r.tokens, (graph, n, r.tokens)
        r.ids[0, :n] = tokens
        if n < r.tokens:
            r.ids[0, n:] = 0   # padding rows: computed, written past the length, never read
        r.past_len[0] = start
        r.run()
        if not r.in_place:
            self.cache.write(r.new_k, r.new_v, start, n)
        return r.logits[0, :n]


def kernel_fingerprint() -> str | None:
    """What ONNX Runtime's CPU kernels, hence their rounding, depend on here: its version and
    the CPU's instruction set (cpu_features.kernel_isa); None where the flags cannot be read.
    Not the thread count: MLAS splits rows and columns between threads, never a sum
    (tests/runtime/test_thread_count.py, docs/precision.md)."""
    isa = kernel_isa()
    return None if isa is None else f"onnxruntime {ort.__version__}, {isa}"


def gate_record(by: str) -> dict | None:
    """An entry of a CPU manifest's device.gated_on: these kernels, who measured the gates, when."""
    import datetime
    here = kernel_fingerprint()
    return None if here is None else {
        "kernels": here, "by": by,
        "at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _check_device(man) -> None:
    mf.check_device(man, backend="onnxruntime")
    mf.check_gated(man, kernel_fingerprint())


BACKEND = register(Backend(name="ort-cpu", device_backend="onnxruntime", device_kind="cpu",
                           memory_modes=MEMORY_MODES, open_model=OrtModel, check_device=_check_device))
