"""The batched engine's model on a device: static row buckets, one CUDA graph per bucket and
graph (what TensorRT-LLM and vLLM do on a GPU). Implements runtime/batch/model.py's BatchModel.

    cache    per layer, K and V: one device buffer [rows, KVH, capacity, D], allocated once;
             row r is one contiguous slab, so rows [0, b) are a prefix bound by pointer
    buckets  (1, 2, 4, 8, 16, ...) up to `rows`: a decode/verify step over n running rows runs
             the smallest bucket b >= n; rows n..b-1 are padding (token 0, logits ignored)
    per (graph, bucket): ids [b, T], past_len [b], logits [b, T, V] device buffers and one IO
             binding, made once; the lifecycle (lifecycle.GraphLifecycle) warms each one up,
             captures it once, then replays it every step (its addresses never change)
    prefill  one row at `first_row`, [1, prefill_chunk] padded, eager (never captured)

Static shapes only: prefill T = the prefill chunk, decode T = 1, verify T = k + 1, whatever
the graph file allows (a `--batch` graph with symbolic rows and T serves all of them).

Where padding rows write: a padding row's T tokens go to its cache at its "extent", the end
of what was last written into that row. Past a row's length nothing is read before it is
written again (a request being prefilled in a padding row writes its next chunk from its
length on), so padding never changes a real row. Starting padding rows at 0 would overwrite
the first positions of a prompt being prefilled (tests/gpu_fakes/test_device_batch.py).

GPU-ONLY, NOT YET RUN ON A GPU: execution "cuda" (OrtCudaDevice, the CUDA provider with
`enable_cuda_graph`, device-to-device row moves). `specrt build --batch` does not yet make
the fp16 batched graphs with a constant total_sequence_length that ONNX Runtime CUDA needs
(with or without CUDA graphs: a computed one gave wrong prompt logits on an H100), and
whether CUDA kernels keep a row's result independent of the bucket (batch invariance) must
be measured on the GPU before it is trusted (docs/gpu.md). execution "cpu" runs this class on
CPUExecutionProvider with CPU OrtValues and device.CpuDevice's capture emulation (which
refuses a replay whose addresses changed): that is how the tests drive the buckets, the
padding, the row moves and the graph lifecycle through the real batched graphs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from specrt.errors import BackendError, ConfigError, ManifestError
from specrt.manifest import KV_POS, LOGIT_POS, ModelEntry, Shapes
from specrt.runtime.backends.device import Buffer, Step
from specrt.runtime.backends.lifecycle import GraphLifecycle
from specrt.runtime.backends.ort_batch import OrtBatchModel, batch_graphs, cache_length_symbolic, check_multi_token_rows
from specrt.runtime.backends.ort_cpu import DTYPES, check_weights_file, io_dtypes, session_options

BUCKETS = (1, 2, 4, 8, 16)
EXECUTIONS = ("cuda", "cpu")
WARMUP_RUNS = 3             # eager runs per (graph, bucket) before capture (GPU.md A3)
CAPTURED = ("decode", "verify")


def bucket_plan(rows: int, buckets: Sequence[int] = BUCKETS) -> tuple[int, ...]:
    """The row counts a step may run: the buckets below `rows`, and `rows` itself."""
    if rows < 1 or any(not isinstance(b, int) or b < 1 for b in buckets):
        raise ConfigError(f"buckets={tuple(buckets)!r}, rows={rows}: give positive integers")
    return tuple(sorted({b for b in buckets if b < rows} | {rows}))


def bucket_for(n: int, plan: tuple[int, ...], min_rows: int = 1) -> int:
    """The smallest bucket that holds n rows and at least `min_rows` rows (kernels whose
    one-row path rounds differently never run one row: see the manifest's min_rows)."""
    for b in plan:
        if b >= max(n, min_rows):
            return b
    raise BackendError(f"{n} rows do not fit the largest bucket {plan[-1]}")


class DeviceBatchKV:
    """keys[i], values[i]: device Buffers [rows, KVH, capacity, D], zeroed (masked positions
    must hold finite numbers). Moving a row copies its slab on the device."""

    def __init__(self, device, layers: int, kv_heads: int, capacity: int, head_dim: int, rows: int, dtype):
        self.device, self.rows, self.capacity, self.dtype = device, rows, capacity, np.dtype(dtype)
        shape = (rows, kv_heads, capacity, head_dim)
        zeros = np.zeros(shape, self.dtype)
        self.keys = [device.alloc(shape, self.dtype) for _ in range(layers)]
        self.values = [device.alloc(shape, self.dtype) for _ in range(layers)]
        for b in self.keys + self.values:
            device.write(b, zeros)
        self.row_nbytes = kv_heads * capacity * head_dim * self.dtype.itemsize
        self.on_move = None       # the model's hook: a moved row's extent moves with it

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.keys + self.values)

    def row_address(self, buf: Buffer, row: int) -> int:
        return buf.address + row * self.row_nbytes

    def move_row(self, src: int, dst: int, length: int) -> None:
        for b in self.keys + self.values:
            self.device.copy(b, dst * self.row_nbytes, b, src * self.row_nbytes, self.row_nbytes)
        if self.on_move is not None:
            self.on_move(src, dst, length)

    def forget(self, first_free: int) -> None:
        """Allocated once at the capacity (a captured graph's fixed shapes): nothing to drop."""

    def free(self) -> None:
        for b in self.keys + self.values:
            self.device.free(b)
        self.keys, self.values = [], []


class _Call:
    """One static shape (graph, rows b, tokens T, first cache row) bound to fixed buffers."""

    def __init__(self, model: "DeviceBatchModel", name: str, b: int, T: int, first_row: int):
        dev, dt, entry, io = model.device, model.dtypes, model.entry, model.entry.io
        self.name, self.session, self.b, self.T = name, model.session, b, T
        self.ids_host = dev.host((b, T), DTYPES[dt["input_ids"]])
        self.past_host = dev.host((b,), DTYPES[dt["past_len"]])
        self.logits_host = dev.host((b, T, model.vocab), DTYPES[dt["logits"]])
        self.ids = dev.alloc((b, T), DTYPES[dt["input_ids"]])
        self.past = dev.alloc((b,), DTYPES[dt["past_len"]])
        self.logits = dev.alloc((b, T, model.vocab), DTYPES[dt["logits"]])
        self.binding = model.session.io_binding()
        self.binding.bind_ortvalue_input(io["input_ids"], self.ids.handle)
        self.binding.bind_ortvalue_input(io["past_len"], self.past.handle)
        self.binding.bind_ortvalue_output(io["logits"], self.logits.handle)
        self.positions = None
        if model.has_positions:     # every position's logits: logit_pos = 0..T-1 in each row, written once
            self.positions = dev.alloc((b, T), np.int64)
            dev.write(self.positions, np.ascontiguousarray(np.broadcast_to(np.arange(T, dtype=np.int64), (b, T))))
            self.binding.bind_ortvalue_input(LOGIT_POS, self.positions.handle)
        cache = model.cache
        kv_shape = [b, *cache.keys[0].shape[1:]]
        self._cache_ptrs = []
        for i in range(entry.layers):
            for buf, past, present in ((cache.keys[i], "past_key", "present_key"),
                                       (cache.values[i], "past_value", "present_value")):
                ptr = cache.row_address(buf, first_row)      # rows [first_row, first_row + b): in place
                self._cache_ptrs.append(ptr)
                for bind, n in ((self.binding.bind_input, past), (self.binding.bind_output, present)):
                    bind(io[n] % i, model.ort_device, model.device_id, cache.dtype.type, kv_shape, ptr)

    def addresses(self) -> tuple[int, ...]:
        return (self.ids.address, self.past.address, self.logits.address,
                *((self.positions.address,) if self.positions is not None else ()), *self._cache_ptrs)

    def run(self, run_options) -> None:
        self.session.run_with_iobinding(self.binding, run_options)


class DeviceBatchModel:
    """The batch model of an engine folder on a device, over `rows` cache rows."""

    def __init__(self, root: Path, entry: ModelEntry, shapes: Shapes, *, rows: int, buckets: Sequence[int] = BUCKETS,
                 execution: str = "cuda", warmup: int = WARMUP_RUNS, cuda_graphs: bool = True, threads: int = 2,
                 device_id: int = 0, ort=None):
        from specrt.runtime.backends.ort_cuda import _check_static_total, _import_ort, _providers, \
            _require_cuda_provider, check_on_cuda
        from specrt.runtime.backends.ort_device import OrtCudaDevice, OrtDevice
        if execution not in EXECUTIONS:
            raise ConfigError(f"execution={execution!r}; choose one of {EXECUTIONS}")
        if not batch_graphs(entry):
            raise ManifestError(f"the {entry.role} graphs have no batch dimension: rebuild with `specrt build --batch`")
        if not entry.in_place:
            raise ManifestError(f"the {entry.role} graphs return their K/V instead of writing the cache in place; "
                                "device buckets bind one buffer as past and present: rebuild with attention gqa")
        ort = ort or _import_ort()
        self.entry, self.rows, self.shapes = entry, rows, shapes
        self.plan = bucket_plan(rows, buckets)
        self.dtypes, d = io_dtypes(entry), entry.dims
        self.vocab = int(d["vocab"])
        files = {g.file for g in entry.graphs.values()}
        if len(files) != 1:
            raise ManifestError(f"the {entry.role} model has {len(files)} graph files; device buckets run one batched "
                                "graph: rebuild with `specrt build --batch --batch-prefill same` (the rowwise prefill "
                                "graph, the int4 default, is a CPU option)")
        path = Path(root) / files.pop()
        capture = cuda_graphs and execution == "cuda"
        if execution == "cuda":        # GPU-ONLY, NOT YET RUN ON A GPU
            _require_cuda_provider(ort)
            if self.dtypes["kv"] != "float16":
                raise ManifestError(f"the {entry.role} KV cache is {self.dtypes['kv']}; ONNX Runtime's CUDA "
                                    "GroupQueryAttention runs fp16 only: device buckets need fp16 batched graphs, which "
                                    "no build makes yet (`specrt build --batch` is CPU-only)")
            # before any device memory; with or without capture: see ort_cuda._check_static_total
            _check_static_total(path, shapes.kv_capacity, batched=True)
            self.device, self.ort_device = OrtCudaDevice(ort, device_id), "cuda"
        else:
            self.device, self.ort_device = OrtDevice(ort, "cpu"), "cpu"
        self.device_id = device_id
        self.shares_cache = False
        self.cache = DeviceBatchKV(self.device, entry.layers, int(d["kv_heads"]), shapes.kv_capacity,
                                   int(d["head_dim"]), rows, DTYPES[self.dtypes["kv"]])
        self.cache.on_move = self._moved
        self._extent = np.zeros(rows, np.int64)        # per cache row: end of what was last written
        check_weights_file(root, entry)
        providers = _providers(capture, device_id) if execution == "cuda" else ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(path), session_options(threads), providers=providers)
        except Exception as e:
            raise BackendError(f"ONNX Runtime {ort.__version__} could not load {path} on {execution} "
                               f"({type(e).__name__}: {str(e).strip()[:500]})") from e
        if execution == "cuda":
            check_on_cuda(self.session, path)
        self.has_positions = any(i.name == LOGIT_POS for i in self.session.get_inputs())
        if any(i.name == KV_POS for i in self.session.get_inputs()) or cache_length_symbolic(self.session, entry):
            raise ManifestError(f"the {entry.role} graph was built with --batch-attention rows, whose calls read a "
                                "cache length that changes with every step (no fixed shape to capture): device "
                                "buckets need the gqa batched graph (rebuild without --batch-attention rows)")
        if int(entry.io.get("row_multiple", 1)) > 1:
            raise ManifestError(f"the {entry.role} graph was built with --batch-block-size, whose kernels need an even "
                                "number of rows per call; device buckets run fixed row counts (1 among them): "
                                "rebuild without --batch-block-size for buckets")
        self.graph_tokens = {"prefill": shapes.prefill_chunk, "decode": 1, "verify": shapes.k + 1}
        self.min_rows = int(entry.io.get("min_rows", 1))
        # ONNX Runtime's CPU GroupQueryAttention runs several tokens per row for one row only
        self.multi_token_rows = 1 if execution == "cpu" and OrtBatchModel._attention(root, entry) == "gqa" else None
        self.lifecycle = GraphLifecycle(self.device, warmup=warmup, enabled=cuda_graphs)
        self._calls: dict[tuple, _Call] = {}

    def step(self, graph: str, tokens: np.ndarray, starts: np.ndarray, first_row: int = 0,
             positions: np.ndarray | None = None, pad_start: int | None = None) -> np.ndarray:
        """positions [n, P]: those positions' logits, [n, P, V] (picked on the host: a static
        bucket computes and reads all T). pad_start: unused (no row_multiple here)."""
        n, T = tokens.shape
        if T != self.graph_tokens[graph]:
            raise BackendError(f"the {graph} step runs {self.graph_tokens[graph]} tokens a row, not {T}")
        if graph == "prefill":
            b = n
            assert n == 1, n
        else:
            assert first_row == 0, first_row       # running rows are 0..n-1 (the engine keeps them contiguous)
            b = bucket_for(n, self.plan, -(-self.min_rows // T))
        check_multi_token_rows(self.multi_token_rows, b, T)
        call = self._call(graph, b, T, first_row)
        ids, past = call.ids_host.array, call.past_host.array
        ids[:n] = tokens
        ids[n:] = 0
        past[:n] = starts
        cap = self.cache.capacity
        past[n:] = np.minimum(self._extent[first_row + n:first_row + b], cap - T)    # padding: see the docstring
        self.device.write(call.ids, call.ids_host)
        self.device.write(call.past, call.past_host)
        self.lifecycle.run(call.name)
        self.device.read(call.logits, call.logits_host)
        self._extent[first_row:first_row + n] = starts + T     # padding rows keep theirs
        logits = call.logits_host.array[:n]
        if positions is not None:
            return np.take_along_axis(logits, np.asarray(positions)[:, :, None], axis=1)
        return logits

    def _call(self, graph: str, b: int, T: int, first_row: int) -> _Call:
        key = (graph, b, T, first_row)
        call = self._calls.get(key)
        if call is None:
            name = f"{graph}[{b}x{T}]" + (f"@{first_row}" if first_row else "")
            call = self._calls[key] = _Call(self, name, b, T, first_row)
            self.lifecycle.add(Step(name, call.run, call.addresses, owner=self.session), capture=graph in CAPTURED)
        return call

    def _moved(self, src: int, dst: int, length: int) -> None:
        self._extent[dst] = length

    def graph_stats(self) -> dict:
        """(graph[b x T]) -> lifecycle.ShapeStats: phase, eager runs, captures, replays, fallback."""
        return self.lifecycle.stats()

    def close(self) -> None:
        self.lifecycle.release()
        self.cache.free()


__all__ = ["BUCKETS", "DeviceBatchKV", "DeviceBatchModel", "bucket_for", "bucket_plan"]
