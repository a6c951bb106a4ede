"""Was this machine free while the build (or `specrt retime`) timed the folder's steps?

The step costs (manifest build.speculation) and the kernel table (build.kernels) are timings:
they choose every speculation round, and timed beside other work they mislead. Measured
2026-12-04: an int4 build timed beside a test run recorded its batched int8 draft step at
x1.77 a target step (x1.36 when retimed quiet) and every step 1.6-2.5x slower than it is;
2026-12-07: `specrt retime` beside a test run recorded SmolLM2 int4's one-row decode step at
16.0 ms, 7.6 quiet.

`cpu_share` measures, over the timing, the share of the machine's CPU time that other
processes (and the hypervisor: steal) used: the machine's busy time from /proc/stat less this
process's own (os.times, all its threads). Measured on the 2-core AVX2 EPYC, SmolLM2 int4:
0.004 quiet; 0.25 with two busy loops beside it for most of the timing, which made every cost
2.5x its quiet value (one-row decode 22.4 ms against 8.9): contention costs more than the CPU
time it takes, as ONNX Runtime's threads wait for each other at every operator.
Above BUSY the record says the machine was busy, the build and retime print a warning naming
`specrt retime`, and `specrt inspect` repeats it. It also records this process's share of its
threads' time (informative only: a small model's timing spends much of its time in Python
between ONNX Runtime's calls, so that share is low on a quiet machine too, 0.71 for the tiny
test models against 0.88 for SmolLM2). Where /proc/stat cannot be read (macOS, Windows) the
record has no verdict. Neither promises exact costs: a memory-bound neighbour slows steps
while taking little CPU time.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

BUSY = 0.1      # above this share of the machine's CPU time used by others, the timing shared the cores


def _cpu_seconds() -> float:
    """This process's user + system CPU time, all its threads (ONNX Runtime's pool included)."""
    t = os.times()
    return t.user + t.system


def _wall() -> float:
    return time.perf_counter()


def _machine_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, summed over its CPUs, from
    /proc/stat's first line (user nice system idle iowait irq softirq steal ...; steal counts
    as busy: another guest had the core); None where it cannot be read."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = user + nice + system + irq + softirq + steal
    return busy / hz, (busy + idle + iowait) / hz


@contextmanager
def cpu_share(threads: int, by: str) -> Iterator[dict]:
    """with cpu_share(2, "specrt build") as rec: ...timing...; rec then holds {"others_share",
    "cpu_share", "threads", "seconds", "load_1min", "busy", "by"} (build.speculation.conditions;
    others_share and busy None where /proc/stat cannot be read)."""
    rec: dict = {}
    cores = min(threads, os.cpu_count() or threads)
    t0, c0, m0 = _wall(), _cpu_seconds(), _machine_seconds()
    yield rec
    wall, cpu, m1 = _wall() - t0, _cpu_seconds() - c0, _machine_seconds()
    others = None
    if m0 is not None and m1 is not None and m1[1] > m0[1]:
        others = max(0.0, (m1[0] - m0[0]) - cpu) / (m1[1] - m0[1])
    rec.update(others_share=None if others is None else round(others, 3),
               cpu_share=round(cpu / (wall * cores), 3) if wall > 0 else None, threads=threads,
               seconds=round(wall, 1), busy=None if others is None else others > BUSY, by=by,
               **({"load_1min": round(os.getloadavg()[0], 2)} if hasattr(os, "getloadavg") else {}))


def warning(rec: dict | None) -> str | None:
    """The line a build, retime and `specrt inspect` print for a busy timing (None: quiet or unknown)."""
    if not isinstance(rec, dict) or not rec.get("busy"):
        return None
    return (f"timed on a busy machine: other processes used x{rec.get('others_share', 0):.2f} of its CPU time "
            f"meanwhile (load {rec.get('load_1min', '?')}), so the step costs and the kernel table may be 1.5-2.5x "
            "off and choose speculation badly; run `specrt retime FOLDER` where it serves, when it is quiet")


__all__ = ["BUSY", "cpu_share", "warning"]
