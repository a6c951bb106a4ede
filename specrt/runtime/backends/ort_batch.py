"""ONNX Runtime (CPU) for the batched engine: one model's batch graphs over a cache of many rows.
Implements runtime/batch/model.py's BatchModel for graphs exported with a symbolic batch
dimension (export/batch.py; manifest graph `batch: "dynamic"`), and a symbolic or static T.

    cache    per layer, K and V: [rows, KVH, length, D] (rows = max_num_seqs): length = the
             capacity, allocated once, for graphs that read a prefix of it (kv_pos); for the
             "rows" graphs exported since 2026-12-06 (a symbolic cache length), the positions
             the rows use, rounded up to KV_BLOCK, reallocated as that changes (BatchKV.fit)
    step     rows first_row..first_row+n-1 bind the view cache[first_row:first_row+n] (the
             leading axis: a contiguous view, no copy); ids [n, T], past_len [n], logit_pos
             [n, P] and logits [n, P, V] are views of flat buffers made once for the largest call

A model built with `--batch-prefill rowwise` has a second graph, "prefill" (the same graph with
int8 per-channel weights, MatMulIntegerToFloat), in its own session: prompt chunks run there,
decode and verify steps in "step"; both write the same cache. With `--batch-prefill rowwise-gqa`
(the int4 default) "prefill" attends with GroupQueryAttention over the "rows" step graph's
growing cache, one row a call.

Graph entries that name one file (a dynamic-T graph serving prefill, decode and verify) share
one session: one pre-packed copy of the weights (ONNX Runtime's Python API cannot share
pre-packed weights between sessions, so each session holds its own). IO bindings are made
once per (graph, first_row, n, T) and reused; output buffers are reused: read the logits
before the next step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from specrt.errors import BackendError, GraphFileError, ManifestError
from specrt.manifest import KV_POS, LOGIT_POS, ModelEntry, Shapes
from specrt.runtime.backends.huge_pages import collapsed
from specrt.runtime.backends.ort_cpu import DTYPES, ORT_TYPES, check_weights_file, io_dtypes, session_options
from specrt.runtime.backends.batch_calls import lone_prefill_tokens, padded_call
from specrt.runtime.backends.batch_kv import BatchKV, blocks
from specrt.runtime.kv import lazy_zeros


ALIASES = ("prefill", "decode", "verify")     # the engine's graph names, served by "step" unless named


def batch_graphs(entry: ModelEntry) -> bool:
    """Were this model's graphs exported with a batch dimension?"""
    return all(getattr(g, "batch", None) == "dynamic" for g in entry.graphs.values())


class OrtBatchModel:
    def __init__(self, root: Path, entry: ModelEntry, shapes: Shapes, *, rows: int, cache: BatchKV | None = None,
                 graphs: tuple[str, ...] | None = None, threads: int = 2, min_rows: int | None = None,
                 serves: str = "step", call_tokens: int | None = None):
        """graphs: the entry's graphs to load (default: all). serves: the graph that runs the
        engine's prefill, decode and verify calls not named by a graph of their own: "step" for
        the target; "draft" for the int8 self-draft inside a batch (graphs=("draft",), over the
        target's cache). call_tokens: the longest one-row call (default: a prompt chunk of a
        request alone, lone_prefill_tokens; the buffers hold it)."""
        if not batch_graphs(entry):
            raise ManifestError(f"the {entry.role} graphs of these engines have no batch dimension (built by an "
                                "older specrt): rebuild them with `specrt build` to serve many requests at once, "
                                "or use the one-stream SpeculativeGenerator")
        d = entry.dims
        self.entry, self.rows = entry, rows
        self.shares_cache = cache is not None
        dt = io_dtypes(entry)
        # kernels that round a call's odd last row apart (MatMulNBits int8 compute, block > 32:
        # --batch-block-size) run every call with an even number of rows: one padding row, the row
        # after the call's, so the cache holds one spare row past the max_num_seqs rows
        self.row_multiple = int(entry.io.get("row_multiple", 1))
        if self.row_multiple not in (1, 2):
            raise ManifestError(f"models.{entry.role}.io.row_multiple={self.row_multiple}: this specrt pads calls to "
                                "a multiple of 1 or 2 rows; rebuild the engines with this specrt")
        spare = int(self.row_multiple > 1)
        check_weights_file(root, entry)
        names = graphs or tuple(entry.graphs)
        # the batched model of `specrt build --batch` has one graph, "step", with a symbolic T: it
        # serves the engine's prefill chunks, decode steps and verify windows alike; with
        # `--batch-prefill rowwise` a second graph, "prefill" (int8 weights), runs prompt chunks
        # (the int8 self-draft's graph, serves="draft", runs one-token decode steps only: it may
        # have a static T of 1)
        alias = {g: serves for g in (ALIASES if serves != "draft" else ("decode",)) if g not in names} \
            if serves in names else {}
        self.graph_tokens = {g: int(entry.graphs[g].tokens) if not getattr(entry.graphs[g], "dynamic_tokens", False)
                             else 0 for g in names}
        self.graph_tokens.update({a: self.graph_tokens[s] for a, s in alias.items()})
        check_static_tokens(entry, shapes, self.graph_tokens, alias)

        # kernels whose one-row path rounds differently from their multi-row path (MatMulNBits with int8
        # compute) must never see a one-row call: the manifest says so (builder/gates/rows.py)
        self.min_rows = int(min_rows if min_rows is not None else entry.io.get("min_rows", 1))
        self.in_place = entry.in_place
        self.io = entry.io
        self._sessions: dict[str, ort.InferenceSession] = {}
        self._file_of = {g: entry.graphs[g].file for g in names}
        self._file_of.update({a: self._file_of[s] for a, s in alias.items()})
        with collapsed(f"{entry.role} graphs"):      # their packed weights on 2 MiB pages (huge_pages.py)
            for g in names:
                f = self._file_of[g]
                if f not in self._sessions:
                    self._sessions[f] = _session(root / f, threads)
                    _check_signature(self._sessions[f], root / f, entry, dt, shapes.kv_capacity,
                                     hidden_optional=g == "draft")
        # graphs built before logit_pos existed return every position: the positions are picked here
        self.has_positions = {f: any(i.name == LOGIT_POS for i in s.get_inputs()) for f, s in self._sessions.items()}
        # "rows" graphs read L cache positions (a row's result does not depend on L): the rows'
        # longest length after the step, rounded up to KV_BLOCK. Graphs exported since 2026-12-06
        # take a cache of L positions (a symbolic length: the cache grows, BatchKV); older ones
        # read the first L positions of the whole cache, L = the length of their kv_pos input
        self.has_kv_pos = {f: any(i.name == KV_POS for i in s.get_inputs()) for f, s in self._sessions.items()}
        # the int8 self-draft's own graph returns no hidden states (export_model's graph_attention)
        self.has_hidden = {f: any(o.name == entry.io.get("hidden_states") for o in s.get_outputs())
                           for f, s in self._sessions.items()}
        grows = {f: cache_length_symbolic(s, entry) and not self.has_kv_pos[f] for f, s in self._sessions.items()}
        if len(set(grows.values())) > 1:
            raise GraphFileError(f"the {entry.role} graphs {sorted(grows)} disagree on the cache's length (symbolic in "
                                 "some, fixed in others) but share one cache: they come from different builds; rebuild "
                                 "the engines")
        self.grows = any(grows.values())
        if self.grows and entry.kv.get("capacity") != shapes.kv_capacity:
            # the graphs no longer fix the capacity; their rotary tables (and the build's checks)
            # end at the one built for, which the manifest records beside the cache's layout
            raise ManifestError(f"models.{entry.role}.kv.capacity={entry.kv.get('capacity')!r}, but shapes.max_context "
                                f"{shapes.max_context} implies a cache of {shapes.kv_capacity} positions: the manifest "
                                "was edited or belongs to other graphs; rebuild the engines")
        self._kv_pos = np.arange(shapes.kv_capacity, dtype=np.int64)
        self._kv_values: dict[int, ort.OrtValue] = {}    # L -> kv_pos[:L] (at most capacity / KV_BLOCK + 1)
        self.kv_len = self.max_kv_len = 0                # the last and the largest L bound
        self.cache = cache or BatchKV(entry.layers, int(d["kv_heads"]), shapes.kv_capacity, int(d["head_dim"]),
                                      rows + spare, DTYPES[dt["kv"]], grows=self.grows)
        if self.cache.rows < rows + spare:
            raise BackendError(f"a shared cache of {self.cache.rows} rows for {rows} rows of a model that pads calls to "
                               "an even number of rows: it needs one spare row")
        if getattr(self.cache, "grows", False) != self.grows:
            raise GraphFileError(f"the {entry.role} graphs {'take' if self.grows else 'do not take'} a cache of a "
                                 "symbolic length, the cache they share was made for graphs that "
                                 f"{'do not' if self.grows else 'do'}: the graphs come from different builds; rebuild "
                                 "the engines")
        self._generation = self.cache.generation      # the cache arrays the bindings below were made over
        if self.grows:
            self.cache.subscribe(self._cache_reallocated)
        # GroupQueryAttention on the CPU runs several tokens per row only for a single row (ONNX
        # Runtime refuses B > 1 with T > 1 over a filled cache): the engine must not ask for it of
        # the graph that serves its steps (a "prefill" graph of its own, --batch-prefill
        # rowwise-gqa, runs one row a call anyway: the limit is checked per graph file)
        self._token_rows = {f: 1 if self._attention(root, entry, (g,)) == "gqa" else None
                            for g, f in self._file_of.items() if g in names}
        self.multi_token_rows = self._token_rows[self._file_of[serves if serves in names else names[0]]]
        t_max = max(max(shapes.prefill_chunk, shapes.k + 1), 2) + spare
        if call_tokens is None:
            call_tokens = lone_prefill_tokens(entry, shapes) if serves != "draft" else 0
        V = int(d["vocab"])
        R = rows + spare
        flat = max(R * t_max, call_tokens + spare)          # rows x tokens of the largest call
        self._ids = np.zeros(flat, DTYPES[dt["input_ids"]])
        self._past = np.zeros(R, DTYPES[dt["past_len"]])
        self._pos = np.zeros(flat, np.int64)
        self._every = np.arange(max(t_max, call_tokens + spare), dtype=np.int64)   # logit_pos: every position
        self._logits = np.zeros(flat * V, DTYPES[dt["logits"]])
        kvh, hd = int(d["kv_heads"]), int(d["head_dim"])
        self._new = [np.zeros(flat * kvh * hd, self.cache.dtype) for _ in range(2 * entry.layers)] \
            if not self.in_place else []
        self._vocab, self._kvh, self._hd = V, kvh, hd
        # graphs built with --hidden-layers also return the tapped layers' outputs at every position
        # (a trained draft head reads them): bound to one buffer; `hidden` is the last call's [n, T, F]
        self.hidden_width = len(d.get("hidden_layers") or ()) * int(d["hidden"]) if io_has_hidden(entry) else 0
        self._hidden = np.zeros(flat * self.hidden_width, np.float32)
        self.hidden: np.ndarray | None = None
        self._bindings: dict[tuple, tuple] = {}
        self._alone: list[np.ndarray] = []     # a one-row call's own cache (_alone_views), made at first use

    @staticmethod
    def _attention(root: Path, entry: ModelEntry, names: tuple[str, ...] | None = None) -> str:
        """The attention variant of the graphs `names` (default: the entry's first), read off the
        first of them: "gqa" when it has GroupQueryAttention (the batched int8 self-draft's
        graph may, beside a "rows" step graph)."""
        g = entry.graphs[names[0]] if names else next(iter(entry.graphs.values()))
        model = onnx.load(str(root / g.file), load_external_data=False)
        return "gqa" if any(n.op_type == "GroupQueryAttention" for n in model.graph.node) else "other"

    def step(self, graph: str, tokens: np.ndarray, starts: np.ndarray, first_row: int = 0,
             positions: np.ndarray | None = None, kv_len: int | None = None,
             pad_start: int | None = None) -> np.ndarray:
        """positions [n, P]: return only those positions' logits, [n, P, V] (None: all T).
        kv_len: the cache positions a "rows" graph reads (default: the longest row's length
        after the step, rounded up to KV_BLOCK, at most the capacity); the build's gate sets
        it to show that a row's logits do not depend on it.
        pad_start: with row_multiple 2, an odd call of several rows gets a padding row, cache
        row first_row+n, whose T tokens are written from pad_start on: the length of the row
        there (runtime/batch/model.py); may be left out when that row is the spare row."""
        n, T = tokens.shape
        file = self._file_of[graph]
        check_multi_token_rows(self._token_rows[file], n, T)
        if T == 1 and n == 1 and graph == "prefill" and self._token_rows[file] == 1:
            # a one-token prompt chunk (a prompt one past a multiple of the chunk) through
            # GroupQueryAttention: its one-token path rounds apart from the several-token path the
            # prompt's other positions take (~4e-6 in a K/V, amplified by int8 row scales to ~1.4
            # in a logit on SmolLM2 int4), so the chunk runs as two tokens, the second written one
            # past the row's length, where nothing reads it (the row's next call overwrites it)
            tokens = np.concatenate([tokens, np.zeros_like(tokens)], axis=1)
            if positions is None or not self.has_positions[file]:
                return self.step(graph, tokens, starts, first_row, None, kv_len, pad_start)[:, :1]
            n, T = tokens.shape
        assert n * T >= self.min_rows, (graph, n, T, self.min_rows)
        assert first_row + n <= self.rows, (first_row, n, self.rows)
        static = self.graph_tokens[graph]
        assert not static or T == static, (graph, T, static)
        gathered = positions is not None and self.has_positions[file]
        P = positions.shape[1] if gathered else T
        assert not gathered or n * P >= self.min_rows, (graph, n, P, self.min_rows)
        n2, T2, P2 = padded_call(n, T, P, self.row_multiple)     # the call as run
        if T2 > T and static:
            raise BackendError(f"a one-row {graph} step of {T} tokens on a model that pads calls to an even "
                               "number of rows needs a graph with a dynamic T")
        if n2 > n and pad_start is None and first_row + n < self.rows:
            raise BackendError(f"an odd call of {n} rows pads with cache row {first_row + n}, which may hold "
                               "a request: give pad_start (that row's length)")
        need = int(starts.max()) + T2          # the furthest position the call writes, plus one
        if n2 > n:
            pad_at = 0 if pad_start is None else int(pad_start)
            need = max(need, pad_at + T)
        if (n2, T2) != (n, T) and need > self.cache.capacity:
            raise BackendError(f"a padded call would write position {need - 1} of a {self.cache.capacity}-position "
                               "cache")
        alone = None
        if self.grows:
            self._fit(need, kv_len)
            alone = self._alone_length(graph, n2, need, kv_len)
            if alone is not None:   # one row, much shorter than the cache: its prefix into a cache of its own
                self.kv_len = alone     # what the call attends to
                start = int(starts[0])
                for src, dst in zip(self.cache.keys + self.cache.values, self._alone_views(alone)):
                    np.copyto(dst[0, :, :start], src[first_row, :, :start])
        binding, ids, past, logits, new, pos = self._binding(graph, first_row, n2, T2, P2, alone)
        if self.has_kv_pos[file]:
            binding.bind_ortvalue_input(KV_POS, self._kv_value(need, kv_len))
        if n2 == n and T2 == T:
            np.copyto(ids, tokens)
            np.copyto(past, starts)
        else:
            ids.fill(0)
            ids[:n, :T] = tokens
            past[:n] = starts
            if n2 > n:
                past[n] = pad_at
        if pos is not None:     # filled every call: bindings of other shapes share the buffer
            if gathered:
                pos[:n, :P] = positions
                pos[:n, P:] = positions[:, -1:]             # the one-row pad: its last position again
                pos[n:] = 0
            else:
                pos[:] = self._every[:T2]
        self._sessions[file].run_with_iobinding(binding)
        if alone is not None:   # what the call wrote, back into the row
            for dst, src in zip(self.cache.keys + self.cache.values, self._alone_views(alone)):
                np.copyto(dst[first_row, :, start:start + T2], src[0, :, start:start + T2])
        self.cache.written(first_row, past, T2)
        if self.hidden_width:
            self.hidden = self._hidden[:n2 * T2 * self.hidden_width].reshape(n2, T2, -1)[:n, :T] \
                if self.has_hidden[file] else None
        if not self.in_place:   # returned K/V: row i's T new rows go to its cache at starts[i]
            for j, buf in enumerate(self.cache.keys + self.cache.values):
                nk = new[j]
                for i in range(n):
                    s = int(starts[i])
                    np.copyto(buf[first_row + i, :, s:s + T], nk[i, :, :T])
        if (n2, T2, P2) != (n, T, P):
            logits = logits[:n, :P] if gathered else logits[:n, :T]
        if positions is not None and not gathered:
            return np.take_along_axis(logits, np.asarray(positions)[:, :, None], axis=1)
        return logits

    def _fit(self, need: int, kv_len: int | None) -> None:
        """A growing cache: room for this call (and every row's K/V); bindings made over the
        arrays a reallocation replaced are dropped (by every model sharing the cache, at once:
        _cache_reallocated; the generation check is the fallback)."""
        L = self.cache.fit(need, kv_len)
        if self.cache.generation != self._generation:
            self._cache_reallocated()
        self.kv_len, self.max_kv_len = L, max(self.max_kv_len, L)

    def _cache_reallocated(self) -> None:
        self._bindings.clear()
        self._generation = self.cache.generation

    def _alone_length(self, graph: str, n: int, need: int, kv_len: int | None) -> int | None:
        """A prompt chunk (one row) of a growing cache that other rows made longer than this row
        needs runs over a cache of its own: the row's need rounded up to KV_BLOCK. Else its
        attention would read every position the longest row holds (a new request's first chunk
        at 64 positions beside rows at 900 would attend to 960); graphs built before the growing
        cache read the first L positions of this row alone (kv_pos), which this keeps. Only
        prompt chunks: a one-row decode or verify step (a batch of one whose cache is a block or
        two longer than it needs) would copy its whole prefix each call for little."""
        if graph != "prefill" or n != 1 or kv_len is not None:
            return None
        L = blocks(need, self.cache.capacity)
        return L if L < self.cache.length else None

    def _alone_views(self, L: int) -> list[np.ndarray]:
        """The one-row cache, K and V per layer: [1, KVH, L, D], contiguous (the first L
        positions' worth of one flat buffer each; lazy: pages as written)."""
        if not self._alone:
            per = self._kvh * self.cache.capacity * self._hd
            self._alone = [lazy_zeros((per,), self.cache.dtype) for _ in range(2 * self.entry.layers)]
        return [a[:self._kvh * L * self._hd].reshape(1, self._kvh, L, self._hd) for a in self._alone]

    def _kv_value(self, need: int, kv_len: int | None) -> ort.OrtValue:
        cap = len(self._kv_pos)
        if need > cap:      # the engine never asks this; a row past the cache must not be cut silently
            raise BackendError(f"a row would reach position {need} of a {cap}-position cache: the engine must "
                               "finish a request at the maximum context")
        L = blocks(need, cap) if kv_len is None else kv_len
        if not need <= L <= cap:
            raise BackendError(f"kv_len={L}: give {need}..{cap} (the longest row's length after the step .. the "
                               "cache capacity)")
        if L not in self._kv_values:
            self._kv_values[L] = ort.OrtValue.ortvalue_from_numpy(self._kv_pos[:L])
        self.kv_len, self.max_kv_len = L, max(self.max_kv_len, L)
        return self._kv_values[L]

    def _binding(self, graph: str, first_row: int, n: int, T: int, P: int, alone: int | None = None):
        """alone: bind the one-row cache of that many positions (_alone_views), not cache rows."""
        key = (self._file_of[graph], first_row if alone is None else -alone, n, T, P)   # n may count a padding row
        if key in self._bindings:
            return self._bindings[key][:6]
        sess, io = self._sessions[key[0]], self.io
        ids = self._ids[:n * T].reshape(n, T)
        past = self._past[:n]
        logits = self._logits[:n * P * self._vocab].reshape(n, P, self._vocab)
        pos = self._pos[:n * P].reshape(n, P) if self.has_positions[key[0]] else None
        b = sess.io_binding()
        hold = []

        def value(arr):
            v = ort.OrtValue.ortvalue_from_numpy(arr)
            hold.append(v)
            return v

        b.bind_ortvalue_input(io["input_ids"], value(ids))
        b.bind_ortvalue_input(io["past_len"], value(past))
        b.bind_ortvalue_output(io["logits"], value(logits))
        if pos is not None:
            b.bind_ortvalue_input(LOGIT_POS, value(pos))
        if self.hidden_width and self.has_hidden[key[0]]:
            b.bind_ortvalue_output(io["hidden_states"],
                                   value(self._hidden[:n * T * self.hidden_width].reshape(n, T, -1)))
        new = []
        layers = self.entry.layers
        own = self._alone_views(alone) if alone is not None else None
        for i in range(layers):
            for j, (buf, past_name, out_name) in enumerate((
                    (self.cache.keys[i], "past_key", "present_key" if self.in_place else "new_key"),
                    (self.cache.values[i], "past_value", "present_value" if self.in_place else "new_value"))):
                # (the one-row cache's views are ordered as cache.keys + cache.values)
                view = value(buf[first_row:first_row + n] if own is None else own[i + j * layers])
                b.bind_ortvalue_input(io[past_name] % i, view)
                if self.in_place:   # GroupQueryAttention / TensorScatter write the new rows in place
                    b.bind_ortvalue_output(io[out_name] % i, view)
                else:
                    nb = self._new[2 * i + j][:n * self._kvh * T * self._hd].reshape(n, self._kvh, T, self._hd)
                    new.append(nb)
                    b.bind_ortvalue_output(io[out_name] % i, value(nb))
        if not self.in_place:       # keys first, then values, as cache.keys + cache.values
            new = new[0::2] + new[1::2]
        self._bindings[key] = entry = (b, ids, past, logits, new, pos, hold)
        return entry[:6]


def cache_length_symbolic(session, entry: ModelEntry) -> bool:
    """Does this graph take a cache whose position axis is symbolic ("rows" graphs since
    2026-12-06: the runtime binds the positions its rows use)?"""
    first = entry.io["past_key"] % 0
    return any(i.name == first and isinstance(i.shape[2], str) for i in session.get_inputs())


def io_has_hidden(entry: ModelEntry) -> bool:
    """Do this model's graphs return `hidden_states` (built with --hidden-layers)?"""
    return bool(entry.io.get("hidden_states"))


def check_static_tokens(entry: ModelEntry, shapes: Shapes, graph_tokens: dict[str, int],
                        alias: dict[str, str]) -> None:
    """Refuse a graph with a static T (manifest dynamic_tokens false) that the engine would call
    with another T: it runs a static prefill graph with prompt chunks of exactly prefill_chunk
    tokens (runtime/batch/engine.py), and verify windows of up to k + 1 tokens (padded to a
    static T); decode steps take the graph's T. graph_tokens: engine graph -> T (0: dynamic)."""
    want = {"prefill": (shapes.prefill_chunk, "exactly"), "verify": (shapes.k + 1, "up to")}
    for g, (need, how) in want.items():
        T = graph_tokens.get(g, 0)
        if T and (T < need or (how == "exactly" and T != need)):
            raise ManifestError(
                f"models.{entry.role}.graphs.{alias.get(g, g)} has a static T of {T} tokens (dynamic_tokens false or "
                f"absent), but the batched engine runs its {g} calls with {how} {need} tokens a row: the manifest was "
                "edited or belongs to other shapes; rebuild the engines with `specrt build ... --batch`")


def check_multi_token_rows(limit: int | None, n: int, T: int) -> None:
    """Refuse n rows of T > 1 tokens where the kernels run several tokens for at most `limit`
    rows (ONNX Runtime's CPU GroupQueryAttention: 1; None: no limit)."""
    if limit is not None and T > 1 and n > limit:
        raise BackendError(f"{n} rows of {T} tokens in one call: these GroupQueryAttention graphs run several "
                           f"tokens per row for at most {limit} row(s) on the CPU")


def _check_signature(session, path: Path, entry: ModelEntry, dt: dict, capacity: int,
                     hidden_optional: bool = False) -> None:
    """The graph's tensors are the manifest's: the names, dtypes and static dims (KV heads, head
    size, vocabulary, and the cache capacity where the graph fixes it: shapes.max_context edited
    alone must not reach ONNX Runtime; rows and tokens are symbolic), as ort_cpu checks its
    graphs. logit_pos and kv_pos are the graph's own optional inputs; hidden_optional: so is
    hidden_states (the int8 self-draft's graph, whose hidden states no head reads)."""
    io, d = entry.io, entry.dims
    past = (None, int(d["kv_heads"]), capacity, int(d["head_dim"]))     # [rows, KVH, capacity, D]
    new = (None, int(d["kv_heads"]), None, int(d["head_dim"]))          # [rows, KVH, T, D] (copied back)
    out_kv = ("present_key", "present_value") if entry.in_place else ("new_key", "new_value")
    inputs = {io["input_ids"]: ((), dt["input_ids"]), io["past_len"]: ((), dt["past_len"]),
              **{io[k] % i: (past, dt["kv"]) for i in range(entry.layers) for k in ("past_key", "past_value")}}
    outputs = {io["logits"]: ((None, None, int(d["vocab"])), dt["logits"]),
               **{io[k] % i: (past if entry.in_place else new, dt["kv"]) for i in range(entry.layers)
                  for k in out_kv}}
    if io_has_hidden(entry) and not (hidden_optional and all(o.name != io["hidden_states"]
                                                              for o in session.get_outputs())):
        outputs[io["hidden_states"]] = ((None, None, len(d["hidden_layers"]) * int(d["hidden"])), "float32")
    for kind, want, have in (("input", inputs, session.get_inputs()), ("output", outputs, session.get_outputs())):
        got = {t.name: (tuple(t.shape), t.type) for t in have if t.name not in (LOGIT_POS, KV_POS)}
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got))[:3], sorted(set(got) - set(want))[:3]
            raise GraphFileError(f"graph file {path} does not match the manifest: {kind}s missing {missing}, "
                                 f"unexpected {extra}; it belongs to another build: rebuild the engines")
        for name, (dims, dtype) in want.items():
            shape, typ = got[name]
            if typ != ORT_TYPES[dtype] or any(isinstance(g, int) and w is not None and g != w
                                              for w, g in zip(dims, shape)):
                raise GraphFileError(f"graph file {path}: {kind} {name} is {typ}{list(shape)}, the manifest implies "
                                     f"{dtype}{['?' if w is None else w for w in dims]}; graph and manifest are from "
                                     "different builds: rebuild the engines")


def _session(path: Path, threads: int) -> ort.InferenceSession:
    if not path.is_file():
        raise GraphFileError(f"graph file {path} is missing: rebuild the engines")
    try:
        onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise GraphFileError(f"graph file {path} is not a readable ONNX file ({type(e).__name__}): rebuild the "
                             "engines") from None
    try:
        return ort.InferenceSession(str(path), session_options(threads, "fast"), providers=["CPUExecutionProvider"])
    except Exception as e:
        raise BackendError(f"ONNX Runtime {ort.__version__} could not load {path} ({type(e).__name__}: "
                           f"{str(e).strip()[:500]}): install the onnxruntime version the engines were built with "
                           "(`specrt inspect` lists it), or rebuild them") from e


__all__ = ["BatchKV", "OrtBatchModel", "batch_graphs", "check_multi_token_rows", "check_static_tokens", "ORT_TYPES"]
