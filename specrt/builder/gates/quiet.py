"""Was this machine free while the build (or `specrt retime`) timed the folder's steps?

The step costs (manifest build.speculation) and the kernel table (build.kernels) are timings:
they choose every speculation round, and timed beside other work they mislead. Measured
2026-12-04: an int4 build timed beside a test run recorded its batched int8 draft step at
x1.77 a target step (x1.36 when retimed quiet) and every step 1.6-2.5x slower than it is;
2026-12-07: a build beside CI recorded a one-row decode step of 22 ms, 8.4 quiet.

The timing runs ONNX Runtime on `threads` threads. On a quiet machine this process gets about
all of them while it times (CPU time / wall time / threads near 1: its threads compute, or spin
between a step's operators); beside other work the OS shares the cores and it gets less.
`cpu_share` measures that over the timing (os.times: this process's user + system time, all
threads); below BUSY the record says the machine was busy, the build and retime print a warning
naming `specrt retime`, and `specrt inspect` repeats it. The share measures contention for the
cores, not the costs' error: a share of 0.9 does not promise exact costs (a memory-bound
neighbour slows steps without taking a core).
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator

BUSY = 0.8      # below this share of its threads' time, the timing shared the cores with other work


def _cpu_seconds() -> float:
    """This process's user + system CPU time, all its threads (ONNX Runtime's pool included)."""
    t = os.times()
    return t.user + t.system


def _wall() -> float:
    return time.perf_counter()


@contextmanager
def cpu_share(threads: int, by: str) -> Iterator[dict]:
    """with cpu_share(2, "specrt build") as rec: ...timing...; rec then holds {"cpu_share",
    "threads", "seconds", "load_1min", "busy", "by"} (the manifest's build.speculation.conditions)."""
    rec: dict = {}
    cores = min(threads, os.cpu_count() or threads)
    t0, c0 = _wall(), _cpu_seconds()
    yield rec
    wall, cpu = _wall() - t0, _cpu_seconds() - c0
    share = cpu / (wall * cores) if wall > 0 else 1.0
    rec.update(cpu_share=round(share, 3), threads=threads, seconds=round(wall, 1), busy=share < BUSY, by=by,
               **({"load_1min": round(os.getloadavg()[0], 2)} if hasattr(os, "getloadavg") else {}))


def warning(rec: dict | None) -> str | None:
    """The line a build, retime and `specrt inspect` print for a busy timing (None: quiet or unknown)."""
    if not isinstance(rec, dict) or not rec.get("busy"):
        return None
    return (f"timed on a busy machine: this process had x{rec.get('cpu_share', 0):.2f} of its {rec.get('threads')} "
            f"threads' time (load {rec.get('load_1min', '?')}), so the step costs and the kernel table may be "
            "1.5-2.5x off and choose speculation badly; run `specrt retime FOLDER` where it serves, when it is quiet")


__all__ = ["BUSY", "cpu_share", "warning"]
