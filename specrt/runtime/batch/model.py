"""What the batched engine needs from a backend: one model's graphs over a cache of many rows.

    cache   [rows, kv_heads, length, head_dim] per layer and K/V (rows = max_num_seqs):
            length = the capacity, allocated once, or (ONNX Runtime's "rows" graphs) the
            positions the rows hold, re-laid out as that changes (batch_kv.py BatchKV; the
            engine calls forget() with the first free row). Row r holds one request; rows in
            use are kept contiguous from 0 (the engine moves a row down when one before it
            leaves), so a step over n rows binds the first n rows of the buffer, a view, no copy.

    step(graph, tokens [n, T], starts [n], first_row, positions=None) -> logits [n, T, V]
            rows first_row..first_row+n-1; row i's tokens sit at positions starts[i]..+T-1,
            their K/V written into its cache rows (padding tokens past a row's own tokens
            write rows past its length, which nothing reads). The result is a reused buffer.
            positions [n, P] (window offsets): only those positions' logits, [n, P, V] (a
            prefill chunk needs its last token's; graphs with a logit_pos input skip the
            LM head for the rest).
            pad_start: where a padding row may write. A model whose kernels round a call's odd
            last row apart (manifest io row_multiple 2: --batch-block-size) adds one padding
            row, cache row first_row+n, to a call with an odd number of rows; the engine gives
            that row's own length there (0 for a free row), so the padding K/V land where
            nothing reads them. Backends without row_multiple ignore it.

A shared-cache draft (the int8 copy of the target) is a second BatchModel over the same
cache (`shares_cache`); moving a row moves it for both.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class BatchCache(Protocol):
    rows: int
    capacity: int

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy K/V rows [0, length) of cache row `src` into cache row `dst`."""
        ...

    def forget(self, first_free: int) -> None:
        """Rows first_free.. hold no request now (the engine keeps its rows contiguous from 0):
        a cache that sizes itself to what its rows hold may drop their K/V."""
        ...


@runtime_checkable
class BatchModel(Protocol):
    cache: BatchCache
    shares_cache: bool
    graph_tokens: dict[str, int]     # static T of each graph ("prefill", "decode", "verify"); 0: any T
    min_rows: int                    # never run fewer rows (n*T) than this in one call (see manifest)

    def step(self, graph: str, tokens: np.ndarray, starts: np.ndarray, first_row: int = 0,
             positions: np.ndarray | None = None, pad_start: int | None = None) -> np.ndarray: ...
