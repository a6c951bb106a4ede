"""The KV caches take memory for the positions written, not for their capacity (runtime/kv.py
lazy_zeros). With np.zeros, numpy's transparent huge pages faulted a batch row's whole cache at
its first token (SmolLM2, 24 rows: +1037 MB and 0.4 s per new row on a VM). Memory is read from
/proc (Linux); no timing is asserted."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from specrt.runtime.backends.batch_kv import BatchKV
from specrt.runtime.kv import KVCache, lazy_zeros

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")


def _rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_lazy_zeros_is_a_writable_zero_array():
    a = lazy_zeros((3, 2, 5, 4), np.float16)
    assert a.shape == (3, 2, 5, 4) and a.dtype == np.float16 and a.flags.writeable and a.flags.c_contiguous
    assert not a.any()
    a[1, :, 2] = 7
    assert a.sum() == 7 * 2 * 4 and not a[0].any() and not a[2].any()
    assert lazy_zeros((0, 4)).shape == (0, 4)


@linux
def test_a_batch_cache_costs_memory_for_the_positions_written():
    """24 rows x 30 layers x K/V of [3, 1024, 64] fp32 = 1.1 GiB of capacity; 16 positions
    written in each of 24 rows take a few MiB (with huge pages they took the whole 1.1 GiB)."""
    before = _rss_mib()
    kv = BatchKV(layers=30, kv_heads=3, capacity=1024, head_dim=64, rows=24)
    for a in kv.keys + kv.values:
        a[:, :, :16] = 1.0
    grown = _rss_mib() - before
    assert kv.nbytes > 1000 * 2 ** 20
    assert grown < 200, f"writing 16 of 1024 positions grew RSS by {grown:.0f} MiB: the cache is not lazy"
    kv.move_row(0, 5, 16)
    assert (kv.keys[3][5, :, :16] == 1).all() and not kv.keys[3][5, :, 16:].any()


@linux
def test_a_one_row_cache_is_lazy_too():
    before = _rss_mib()
    kv = KVCache(layers=16, kv_heads=8, capacity=8192, head_dim=128)       # 1 GiB of capacity
    kv.write([np.ones((1, 8, 4, 128), np.float32)] * 16, [np.ones((1, 8, 4, 128), np.float32)] * 16, 0, 4)
    assert _rss_mib() - before < 200
    assert kv.keys[0][0, :, :4].all() and not kv.keys[0][0, :, 4:].any()


@linux
def test_a_forked_process_does_not_share_the_cache():
    import os
    a = lazy_zeros((4, 1024))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                      # the child writes its copy and exits, whatever happens
        try:
            a[:] = 5
            os.write(w, b"ok")
        finally:
            os._exit(0)
    try:
        os.waitpid(pid, 0)
        assert os.read(r, 2) == b"ok"
    finally:
        os.close(r)
        os.close(w)
    assert not a.any()                # the parent's cache is untouched
