"""The weights ONNX Runtime loads for a session, on 2 MiB pages (Linux).

ONNX Runtime's CPU provider pre-packs every MatMul's weights into memory it allocates with
malloc: 4 KiB pages, since the host's transparent huge pages are most often "madvise" only and
nothing advises them. A step streams all of them (an fp32 SmolLM2-135M target, ~540 MB), so a
call walks ~130k pages; on a VM a TLB miss is a two-level walk. Measured 2026-12-07 on a 2-core
AMD EPYC VM (AVX2, THP "madvise"), one process, the same graphs interleaved: a verify window of
5 tokens on the batched fp32 graph 23.6-25.0 ms on 4 KiB pages, 22.4 on 2 MiB; the one-row GQA
verify graph 22.6 -> 21.6 (and which model was created first in a process was up to 6 % slower
on 4 KiB pages, not on 2 MiB). Starting the process with GLIBC_TUNABLES=glibc.malloc.hugetlb=1
gave about the same, but only a process's launcher can set that.

`collapsed()` (a context manager around session creation) finds the anonymous memory that
appeared while its body ran (the sessions' packed weights and arenas) and asks the kernel to
back it with huge pages now (madvise MADV_COLLAPSE, Linux 6.1+), so nothing depends on
khugepaged's background pace. Memory that asked for small pages (the lazily paged KV caches,
runtime/kv.py lazy_zeros: MADV_NOHUGEPAGE) and memory that existed before are left alone. Only
whole 2 MiB blocks inside a region are collapsed; a region smaller than MIN_BYTES is skipped
(an arena's spare tail would be filled in for nothing). A kernel or platform without it, or a
refusal (EAGAIN when memory is short), leaves the pages as they were: never an error, and the
answers never depend on it (the same bytes, on other pages). SPECRT_HUGE_PAGES=0 turns it off.
Two threads opening models at once each collapse the other's new memory too, which is harmless.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import sys
import time

log = logging.getLogger(__name__)

HUGE = 2 << 20                   # x86-64 and arm64 (4 KiB base pages) PMD size
MIN_BYTES = 8 << 20              # smaller regions are not worth a collapse
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25
ENV = "SPECRT_HUGE_PAGES"
WHY_HINT = ("Linux before 6.1 has no MADV_COLLAPSE, and a kernel short of free huge pages refuses; the pages stay as "
            f"they were, steps may run a few percent slower; {ENV}=0 skips the attempt")


def enabled() -> bool:
    return sys.platform.startswith("linux") and os.environ.get(ENV, "1") != "0"


def anonymous_regions(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """([start, end) of the writable anonymous mappings (the brk heap counts), the subset of
    them advised MADV_NOHUGEPAGE) from /proc/self/maps or /proc/self/smaps text; only smaps has
    the VmFlags ("nh") that the second list needs."""
    regions, small, cur = [], [], None
    for line in text.splitlines():
        head = line.split(None, 6)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            cur = None
            name = head[5] if len(head) > 5 else ""
            if "w" in head[1] and name in ("", "[heap]"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                cur = (a, b)
                regions.append(cur)
        elif line.startswith("VmFlags:") and cur is not None and " nh" in line + " ":
            small.append(cur)
    return regions, small


def new_blocks(before: list[tuple[int, int]], after: list[tuple[int, int]],
               min_bytes: int = MIN_BYTES) -> list[tuple[int, int]]:
    """The whole HUGE-aligned blocks of `after` not inside any range of `before`, as ranges of
    at least min_bytes (the parts of a region that grew count; what was there is left)."""
    old = sorted(before)
    out = []
    for a, b in sorted(after):
        pieces = [(a, b)]
        for oa, ob in old:                       # subtract each old range
            nxt = []
            for pa, pb in pieces:
                if ob <= pa or oa >= pb:
                    nxt.append((pa, pb))
                    continue
                if pa < oa:
                    nxt.append((pa, oa))
                if ob < pb:
                    nxt.append((ob, pb))
            pieces = nxt
        for pa, pb in pieces:
            ha, hb = -(-pa // HUGE) * HUGE, pb // HUGE * HUGE
            if hb - ha >= min_bytes:
                out.append((ha, hb))
    return out


def _read(name: str) -> str:
    with open(f"/proc/self/{name}") as f:
        return f.read()


def _madvise():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


@contextlib.contextmanager
def collapsed(what: str = "ONNX Runtime sessions"):
    """Back the anonymous memory allocated inside the block with 2 MiB pages (module doc).
    Yields a dict that gets "bytes" (collapsed) and "seconds" after the block."""
    report: dict = {}
    if not enabled():
        yield report
        return
    try:
        before = anonymous_regions(_read("maps"))[0]          # maps: cheap (smaps sums every page)
    except OSError:                               # no /proc: not Linux as we know it
        yield report
        return
    yield report
    t0 = time.perf_counter()
    try:
        blocks = new_blocks(before, anonymous_regions(_read("maps"))[0])
        if blocks:                                # which of them asked for small pages: smaps' VmFlags
            after, small = anonymous_regions(_read("smaps"))
            blocks = new_blocks(before + small, after)
        madvise = _madvise()
    except (OSError, AttributeError):
        return
    done = refused = 0
    why = None
    for a, b in blocks:
        # MADV_HUGEPAGE first: it lets khugepaged finish what a refused collapse leaves, and
        # the VMA keeps it for memory that grows later
        madvise(a, b - a, MADV_HUGEPAGE)
        if madvise(a, b - a, MADV_COLLAPSE) == 0:
            done += b - a
        else:
            refused += b - a
            why = why or os.strerror(ctypes.get_errno())
    report.update(bytes=done, refused=refused, seconds=time.perf_counter() - t0)
    if refused or report["seconds"] > 1.0:      # slow (a large model) or refused: say so once a load
        log.info("%s: %d MiB of packed weights moved to 2 MiB pages in %.1f s%s", what, done >> 20,
                 report["seconds"], f"; {refused >> 20} MiB refused ({why}: {WHY_HINT})" if refused else "")
    elif done:
        log.debug("%s: %d MiB on 2 MiB pages in %.2f s", what, done >> 20, report["seconds"])


__all__ = ["collapsed", "anonymous_regions", "new_blocks", "enabled", "ENV"]
