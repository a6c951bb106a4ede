"""The batched engine's KV cache on the CPU (runtime/backends/ort_batch.py binds it): per layer,
K and V of `rows` sequences, [rows, KVH, length, D], in place. Fixed at the capacity, or (the
"rows" graphs since 2026-12-06) sized to the positions its rows hold and re-laid out as that
changes; see BatchKV."""
from __future__ import annotations

import ctypes
import weakref

import numpy as np

from specrt.errors import BackendError
from specrt.runtime.kv import lazy_zeros

KV_BLOCK = 64      # a "rows" graph reads the cache in multiples of this many positions


def blocks(n: int, capacity: int) -> int:
    """n positions rounded up to whole KV_BLOCKs, at most the capacity."""
    return min(-(-n // KV_BLOCK) * KV_BLOCK, capacity)


class BatchKV:
    """The KV cache of `rows` sequences: keys[i], values[i]: [rows, KVH, length, D].

    fixed (grows=False: graphs that read a prefix of the cache through kv_pos): length =
    capacity, allocated once.

    grows=True (the "rows" graphs exported since 2026-12-06: the cache's position axis is
    symbolic and a call attends to every position it is given): length = the positions the
    rows hold, rounded up to KV_BLOCK. `fit` re-lays it out (each row's K/V moved to where the
    new length puts it) when a call needs more, and when two blocks or more are unused (the
    rows that held the longest contexts left: `forget`). A step then reads no position that no
    row uses, and copies none: the fixed cache's graphs copied a prefix of every row, K and V,
    in every layer, every step (ONNX Runtime has no strided views), which was most of a
    many-row step at long contexts. Each layer's K and V live in one flat buffer of the
    capacity (lazy pages), viewed as [rows, KVH, length, D]: a new length moves the rows'
    K/V within it (about what one such step copied, once per KV_BLOCK positions of growth)
    and maps no fresh memory (fresh pages are slow to fault in on a VM: a new map per
    reallocation made a 930-token prompt's prefill x1.5 slower). `generation` counts
    re-layouts: IO bindings over older views are stale.

    end[r]: past the last position written to row r (a high-water mark: a rewound row keeps it;
    a moved row's is the length moved; `forget` clears the rows the engine freed)."""

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, rows: int, dtype=np.float32,
                 grows: bool = False):
        self.rows, self.capacity, self.dtype, self.grows = rows, capacity, np.dtype(dtype), grows
        self._shape = (layers, kv_heads, head_dim)
        self.end = np.zeros(rows, np.int64)
        self.generation = 0
        self.length = 0
        self._listeners: list[weakref.WeakMethod] = []     # told at each re-layout (subscribe)
        # lazy: a row's pages are given as its positions are written (runtime/kv.py lazy_zeros)
        self._flat = [lazy_zeros((rows * kv_heads * capacity * head_dim,), dtype) for _ in range(2 * layers)]
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self._allocate(min(KV_BLOCK, capacity) if grows else capacity)

    def _views(self, length: int) -> list[np.ndarray]:
        layers, kvh, hd = self._shape
        return [f[:self.rows * kvh * length * hd].reshape(self.rows, kvh, length, hd) for f in self._flat]

    def _allocate(self, length: int) -> None:
        """View the buffers at `length` positions a row, each row's K/V (each head's block, to
        the row's own end) moved to where the new view puts it, by memmove (a block may overlap
        its old place). Longer: the last block first (each moves up, past where the blocks
        before it still are); shorter: the first block first (each moves down)."""
        layers, kvh, hd = self._shape
        item = self.dtype.itemsize
        moves = [((r * kvh + h) * self.length * hd * item, (r * kvh + h) * length * hd * item,
                  min(int(self.end[r]), self.length, length) * hd * item)
                 for r in map(int, np.flatnonzero(self.end)) for h in range(kvh)]
        if length > self.length:
            moves.reverse()
        for f in self._flat:
            base = f.ctypes.data
            for src, dst, n in moves:
                if src != dst and n:
                    ctypes.memmove(base + dst, base + src, n)
        new = self._views(length)
        self.keys, self.values, self.length = new[:layers], new[layers:], length
        self.generation += 1
        for listener in list(self._listeners):
            method = listener()
            if method is None:
                self._listeners.remove(listener)
            else:
                method()

    def subscribe(self, on_reallocate) -> None:
        """on_reallocate (a bound method, held weakly) runs after each reallocation: a model
        sharing this cache drops its IO bindings at once, so they do not keep the old arrays."""
        self._listeners.append(weakref.WeakMethod(on_reallocate))

    def fit(self, need: int, exact: int | None = None) -> int:
        """A growing cache's length for a call that writes positions up to need - 1: at least
        that and every row's end, rounded up to KV_BLOCK (at most the capacity); reallocated
        when shorter, or when two blocks or more longer. exact: that length (the build's gate
        reads a step over more of the cache than it needs). Returns the length."""
        if need > self.capacity:    # the engine never asks this; a row past the cache must not be cut silently
            raise BackendError(f"a row would reach position {need} of a {self.capacity}-position cache: the "
                               "engine must finish a request at the maximum context")
        live = max(need, int(self.end.max(initial=0)))
        if exact is not None:
            if not live <= exact <= self.capacity:
                raise BackendError(f"kv_len={exact}: give {live}..{self.capacity} (the longest row's length after "
                                   "the step .. the cache capacity)")
            want = exact
        else:
            want = blocks(live, self.capacity)
            if want <= self.length < want + 2 * KV_BLOCK:
                return self.length
        if want != self.length:
            self._allocate(want)
        return self.length

    def written(self, first_row: int, starts: np.ndarray, tokens: int) -> None:
        """Rows first_row.. wrote positions starts[i] .. starts[i] + tokens - 1."""
        ends = self.end[first_row:first_row + len(starts)]
        np.maximum(ends, np.asarray(starts) + tokens, out=ends)

    def forget(self, first_free: int) -> None:
        """Rows first_free.. hold no request any more (the engine keeps its rows contiguous from 0)."""
        self.end[first_free:] = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def move_row(self, src: int, dst: int, length: int) -> None:
        for a in self.keys + self.values:
            np.copyto(a[dst, :, :length], a[src, :, :length])
        self.end[dst] = length
