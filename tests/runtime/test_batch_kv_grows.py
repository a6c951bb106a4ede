"""A growing batch cache (runtime/backends/batch_kv.py BatchKV, grows=True): the "rows" graphs
take a cache of just the positions the rows use, so the cache is reallocated as that changes.
What must never happen: a row's K/V lost or changed by a reallocation, a row cut below what it
holds, or a cache shorter than a call writes. Pure numpy: no graph."""
from __future__ import annotations

import numpy as np
import pytest

from specrt.errors import BackendError
from specrt.runtime.backends.batch_kv import KV_BLOCK, BatchKV

CAP = 5 * KV_BLOCK


def _kv(rows: int = 4) -> BatchKV:
    return BatchKV(layers=2, kv_heads=2, capacity=CAP, head_dim=3, rows=rows, grows=True)


def _write(kv: BatchKV, row: int, start: int, n: int, seed: int) -> None:
    """What a graph call does: row's positions start..start+n-1 written, then `written`."""
    rng = np.random.default_rng(seed)
    for a in kv.keys + kv.values:
        a[row, :, start:start + n] = rng.standard_normal((a.shape[1], n, a.shape[3]))
    kv.written(row, np.array([start]), n)


def _held(kv: BatchKV) -> dict:
    """Each row's K/V up to its end: what a reallocation must keep."""
    return {r: [a[r, :, :int(kv.end[r])].copy() for a in kv.keys + kv.values] for r in np.flatnonzero(kv.end)}


def _same(kv: BatchKV, held: dict) -> None:
    for r, arrays in held.items():
        for a, want in zip(kv.keys + kv.values, arrays):
            np.testing.assert_array_equal(a[r, :, :want.shape[1]], want, err_msg=f"row {r}")


def test_it_starts_at_one_block_and_grows_to_what_a_call_writes_keeping_every_row():
    kv = _kv()
    assert kv.length == KV_BLOCK and kv.keys[0].shape == (4, 2, KV_BLOCK, 3) and kv.generation == 1
    _write(kv, 0, 0, 40, seed=1)
    _write(kv, 1, 0, 10, seed=2)
    held = _held(kv)
    assert kv.fit(KV_BLOCK) == KV_BLOCK and kv.generation == 1        # fits: no reallocation
    assert kv.fit(KV_BLOCK + 1) == 2 * KV_BLOCK and kv.generation == 2
    assert all(a.shape == (4, 2, 2 * KV_BLOCK, 3) for a in kv.keys + kv.values)
    _same(kv, held)
    assert kv.fit(CAP - 3) == CAP                                       # rounded up, capped at the capacity
    _same(kv, held)
    with pytest.raises(BackendError, match="maximum context"):
        kv.fit(CAP + 1)                                                  # never cut a row silently


def test_it_never_shrinks_below_a_row_the_call_does_not_touch():
    """The length is every row's end, not only the calling rows': a one-row call near position 0
    (a new request's first prompt chunk) must not drop a long row beside it."""
    kv = _kv()
    kv.fit(3 * KV_BLOCK)
    _write(kv, 0, 0, 3 * KV_BLOCK - 5, seed=3)
    held = _held(kv)
    assert kv.fit(1) == 3 * KV_BLOCK
    _same(kv, held)


def test_it_shrinks_once_rows_are_forgotten_and_two_blocks_are_unused():
    kv = _kv()
    kv.fit(4 * KV_BLOCK)
    _write(kv, 0, 0, 20, seed=4)
    _write(kv, 1, 0, 4 * KV_BLOCK - 1, seed=5)      # the long row
    _write(kv, 2, 0, 2 * KV_BLOCK + 3, seed=6)
    assert kv.fit(21) == 4 * KV_BLOCK                  # the long row still holds its K/V
    kv.move_row(2, 1, 2 * KV_BLOCK + 3)               # the long row left; the last row takes its place
    kv.forget(2)
    assert list(kv.end[:3]) == [20, 2 * KV_BLOCK + 3, 0]
    held = _held(kv)
    gen = kv.generation
    assert kv.fit(21) == 4 * KV_BLOCK and kv.generation == gen        # one block unused: kept
    kv.move_row(0, 1, 20)
    kv.forget(2)
    held = _held(kv)
    assert kv.fit(21) == KV_BLOCK and kv.generation == gen + 1        # three unused: down to what rows hold
    _same(kv, held)


def test_an_exact_length_is_what_the_gate_asks_and_never_less_than_a_row_holds():
    kv = _kv()
    _write(kv, 0, 0, 30, seed=7)
    held = _held(kv)
    assert kv.fit(31, exact=31) == 31 and kv.keys[0].shape[2] == 31
    _same(kv, held)
    assert kv.fit(31, exact=CAP) == CAP
    _same(kv, held)
    with pytest.raises(BackendError, match="kv_len=29"):
        kv.fit(5, exact=29)                            # row 0 holds 30 positions
    with pytest.raises(BackendError, match="kv_len"):
        kv.fit(5, exact=CAP + 1)


def test_a_reallocation_copies_each_row_to_its_own_end_only():
    """Past a row's end nothing is copied (a short row beside a long one keeps its tail unpaged:
    copying to the longest row's end would fault every row's pages in at each growth)."""
    kv = _kv()
    _write(kv, 0, 0, 50, seed=8)
    _write(kv, 1, 0, 5, seed=9)
    for a in kv.keys + kv.values:
        a[1, :, 5:50] = 7.0             # junk past row 1's end (a rejected window, a padded chunk)
    held = _held(kv)
    kv.fit(2 * KV_BLOCK)
    _same(kv, held)
    assert all(not a[1, :, 5:].any() for a in kv.keys + kv.values)


def test_every_subscriber_is_told_of_a_reallocation_and_a_dead_one_is_dropped():
    class Model:
        def __init__(self):
            self.told = 0

        def reallocated(self):
            self.told += 1
    kv, kept, dropped = _kv(), Model(), Model()
    kv.subscribe(kept.reallocated)
    kv.subscribe(dropped.reallocated)
    kv.fit(2 * KV_BLOCK)
    assert kept.told == dropped.told == 1
    del dropped
    kv.fit(3 * KV_BLOCK)
    assert kept.told == 2 and len(kv._listeners) == 1
    kv.fit(3 * KV_BLOCK)                # no reallocation: nobody told
    assert kept.told == 2


def test_a_fixed_cache_is_the_capacity_once():
    kv = BatchKV(layers=1, kv_heads=2, capacity=CAP, head_dim=3, rows=2)
    assert not kv.grows and kv.length == CAP and kv.keys[0].shape == (2, 2, CAP, 3)


def test_random_writes_moves_and_refits_keep_every_row_bit_for_bit():
    """A reference copy of what each row holds, against 600 random operations: writes at a
    row's end or inside it (a rewound window), growing and shrinking fits, rows moved and
    forgotten as the engine does. Every re-layout moves blocks that may overlap their old place."""
    rng = np.random.default_rng(11)
    rows, heads, hd, layers = 5, 3, 2, 2
    kv = BatchKV(layers=layers, kv_heads=heads, capacity=CAP, head_dim=hd, rows=rows, grows=True)
    ref = np.zeros((rows, 2 * layers, heads, CAP, hd), np.float32)
    live, grew, shrank = 0, 0, 0

    def check():
        for r in range(rows):
            n = int(kv.end[r])
            for j, a in enumerate(kv.keys + kv.values):
                np.testing.assert_array_equal(a[r, :, :n], ref[r, j, :, :n], err_msg=f"row {r}")
    for step in range(600):
        op, before = rng.integers(0, 6), kv.length
        if op <= 2 or live == 0:                                   # a row writes a window
            r = int(rng.integers(0, live + 1)) if live < rows else int(rng.integers(0, live))
            live = max(live, r + 1)
            start = int(rng.integers(max(0, int(kv.end[r]) - 5), int(kv.end[r]) + 1))
            T = int(rng.integers(1, 40))
            if start + T > CAP:
                continue
            kv.fit(start + T)
            vals = rng.standard_normal((2 * layers, heads, T, hd)).astype(np.float32)
            for j, a in enumerate(kv.keys + kv.values):
                a[r, :, start:start + T] = vals[j]
            ref[r, :, :, start:start + T] = vals
            kv.written(r, np.array([start]), T)
        elif op == 3 and live > 1:                                 # a row leaves, the last takes its place
            gone, last = int(rng.integers(0, live - 1)), live - 1
            n = int(kv.end[last])
            kv.move_row(last, gone, n)
            ref[gone] = ref[last]
            live -= 1
            kv.forget(live)
        else:                                                      # a call that needs little: maybe a shrink
            if op == 5 and rng.random() < 0.2:                     # every row left
                live = 0
                kv.forget(0)
            kv.fit(1)
        grew, shrank = grew + (kv.length > before), shrank + (kv.length < before)
        check()
    assert grew >= 5 and shrank >= 3, (grew, shrank)
