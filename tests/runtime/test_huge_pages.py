"""The sessions' packed weights on 2 MiB pages (runtime/backends/huge_pages.py): which memory
is collapsed (anonymous, new, whole 2 MiB blocks of regions >= MIN_BYTES, never a region that
asked for small pages such as the KV caches), and that session creation runs inside it. The
kernel part reads /proc and calls madvise (Linux); a kernel that refuses MADV_COLLAPSE reports
the bytes as refused, which these tests accept: they assert what was chosen and what was left
alone, never a speed."""
from __future__ import annotations

import contextlib
import logging
import mmap
import sys

import numpy as np
import pytest

from specrt.runtime.backends import huge_pages
from specrt.runtime.backends.huge_pages import HUGE, MIN_BYTES, anonymous_regions, collapsed, new_blocks
from specrt.runtime.kv import lazy_zeros

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps (Linux)")
M = 1 << 20

SMAPS = """\
00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
Size:                328 kB
VmFlags: rd ex mr mw me dw
01000000-03000000 rw-p 00000000 00:00 0           [heap]
Size:              32768 kB
VmFlags: rd wr mr mw me ac
7f0000000000-7f0002000000 rw-p 00000000 00:00 0
Size:              32768 kB
AnonHugePages:         0 kB
VmFlags: rd wr mr mw me ac
7f0010000000-7f0012000000 rw-p 00000000 00:00 0
Size:              32768 kB
VmFlags: rd wr mr mw me ac nh
7f0020000000-7f0022000000 rw-p 00000000 08:02 99  /data/weights.bin
VmFlags: rd wr mr mw me
7f0030000000-7f0032000000 r--p 00000000 00:00 0
VmFlags: rd mr mw me
7ffc0000000-7ffc0021000 rw-p 00000000 00:00 0      [stack]
VmFlags: rd wr mr mw me gd ac
"""


def test_only_writable_anonymous_memory_that_allows_huge_pages_is_a_candidate():
    """The brk heap and anonymous maps count; a file map, a read-only map, the stack and a map
    advised MADV_NOHUGEPAGE (VmFlags "nh": the lazily paged KV caches) do not."""
    regions, small = anonymous_regions(SMAPS)
    assert regions == [(0x01000000, 0x03000000), (0x7f0000000000, 0x7f0002000000), (0x7f0010000000, 0x7f0012000000)]
    assert small == [(0x7f0010000000, 0x7f0012000000)]
    maps = "\n".join(line for line in SMAPS.splitlines() if "-" in line.split()[0])   # /proc/self/maps: no flags
    assert anonymous_regions(maps) == (regions, [])


def test_only_new_whole_huge_blocks_of_big_enough_regions_are_collapsed():
    base = 1 << 40
    # a region that grew: only its new part, rounded in to whole 2 MiB blocks
    assert new_blocks([(base, base + 10 * M)], [(base, base + 31 * M)]) == [(base + 10 * M, base + 30 * M)]
    # an old range inside a new region splits it; a piece under MIN_BYTES is dropped
    assert new_blocks([(base + 20 * M, base + 22 * M)], [(base, base + 26 * M)]) == [(base, base + 20 * M)]
    # nothing new: nothing
    assert new_blocks([(base, base + 40 * M)], [(base, base + 40 * M)]) == []
    # an unaligned start rounds up, an unaligned end rounds down
    got = new_blocks([], [(base + 1, base + 20 * M - 1)])
    assert got == [(base + 2 * M, base + 18 * M)] and all(a % HUGE == 0 and b % HUGE == 0 for a, b in got)
    assert new_blocks([], [(base, base + MIN_BYTES - HUGE)]) == []


def _region(addr: int) -> dict:
    """The smaps fields of the mapping that holds addr."""
    fields, inside = {}, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and not head[0].endswith(":"):
            a, b = (int(x, 16) for x in head[0].split("-"))
            if inside:
                break
            inside = a <= addr < b
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def _anon(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(m, np.uint8)
    a[::4096] = 1                                  # every page written, as packed weights are
    return m, a


@linux
def test_memory_allocated_inside_is_collapsed_and_a_kv_cache_is_left_on_small_pages():
    with collapsed("test") as report:
        m, weights = _anon(64 * M)
        cache = lazy_zeros((32 * M // 4,))
        cache[:1024] = 1.0
    blocks = new_blocks([], [(weights.ctypes.data, weights.ctypes.data + weights.nbytes)])
    want = sum(b - a for a, b in blocks)
    # the whole new region was chosen: collapsed, or refused by a kernel without MADV_COLLAPSE
    assert report["bytes"] + report["refused"] >= want >= 60 * M
    if report["bytes"]:     # (the first whole block's mapping: an unaligned head is a mapping of its own now)
        assert int(_region(blocks[0][0])["AnonHugePages"].split()[0]) > 0
    kv = _region(cache.ctypes.data)
    assert " nh" in " " + kv["VmFlags"] and kv["AnonHugePages"].split()[0] == "0"
    assert (weights[::4096] == 1).all() and cache[:1024].all() and not cache[1024:].any()
    del weights, cache
    m.close()


@linux
def test_memory_that_existed_before_is_left_alone(monkeypatch):
    m, before = _anon(32 * M)
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda a, n, advice: calls.append((a, a + n)) or 0)
    with collapsed("test"):
        pass
    lo, hi = before.ctypes.data, before.ctypes.data + before.nbytes
    assert not [c for c in calls if c[0] < hi and c[1] > lo]
    del before
    m.close()


@linux
def test_it_is_off_with_the_environment_switch(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda *a: calls.append(a) or 0)
    with collapsed("test") as report:
        m, a = _anon(32 * M)
    assert report == {} and calls == []
    del a
    m.close()


def test_a_refusal_leaves_the_pages_and_is_reported_not_raised(monkeypatch, caplog):
    monkeypatch.setattr(huge_pages, "enabled", lambda: True)
    region = "7f0000000000-7f0002000000 rw-p 00000000 00:00 0\n"
    monkeypatch.setattr(huge_pages, "_read", lambda name, texts=iter(["", region, region + "VmFlags: rd wr\n"]): next(texts))
    monkeypatch.setattr(huge_pages, "_madvise", lambda: lambda a, n, advice: -1)
    with caplog.at_level(logging.INFO, logger=huge_pages.__name__), collapsed("test") as report:
        pass
    assert report["bytes"] == 0 and report["refused"] == 32 * M
    assert "32 MiB refused" in caplog.text and "MADV_COLLAPSE" in caplog.text and huge_pages.ENV in caplog.text


def test_the_batched_model_creates_its_sessions_inside_it(tiny_batch_engines, monkeypatch):
    """OrtBatchModel's sessions (and with them ONNX Runtime's packed weights) are made inside
    collapsed(); its KV cache after it (the cache asks for small pages anyway)."""
    from specrt import manifest
    from specrt.runtime.backends import ort_batch

    state = {"inside": False, "sessions_inside": 0, "sessions_outside": 0}

    @contextlib.contextmanager
    def fake(what="x"):
        state["inside"] = True
        yield {}
        state["inside"] = False

    real = ort_batch._session

    def session(path, threads):
        state["sessions_inside" if state["inside"] else "sessions_outside"] += 1
        return real(path, threads)

    monkeypatch.setattr(ort_batch, "collapsed", fake)
    monkeypatch.setattr(ort_batch, "_session", session)
    root = tiny_batch_engines
    man = manifest.load(root)
    ort_batch.OrtBatchModel(root, man.models["batch"], man.shapes, rows=2)
    assert state["sessions_inside"] >= 1 and state["sessions_outside"] == 0
