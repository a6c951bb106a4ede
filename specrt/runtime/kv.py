"""Preallocated KV cache (gpt-fast style): allocated once, written by position.

    keys[i], values[i]: [batch=1, kv_heads, capacity, head_dim]   capacity = max_context + window

Rows [0, length) are valid. A graph returns the K/V of its T new tokens; `write` puts
them at [start, start + T). Rejecting draft tokens is `rewind_to(n)`: rows past the
length are masked by the graphs and overwritten later, never copied back.
"""
from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype=np.float32):
        self.capacity = capacity
        self.dtype = np.dtype(dtype)
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [np.zeros(shape, dtype) for _ in range(layers)]
        self.values = [np.zeros(shape, dtype) for _ in range(layers)]
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def write(self, new_keys: list[np.ndarray], new_values: list[np.ndarray], start: int, n: int) -> None:
        """Copy the first n rows of each new_k/new_v [1, KVH, T, D] into rows [start, start+n)."""
        assert 0 <= start and start + n <= self.capacity, (start, n, self.capacity)
        for cache, new in zip(self.keys, new_keys):
            np.copyto(cache[:, :, start:start + n], new[:, :, :n])
        for cache, new in zip(self.values, new_values):
            np.copyto(cache[:, :, start:start + n], new[:, :, :n])

    def rewind_to(self, length: int) -> None:
        assert 0 <= length <= self.capacity, (length, self.capacity)
        self.length = length
