"""The graph lifecycle (warm-up, one capture per shape, replay, prefill never captured,
re-binding invalidates, a failed capture falls back to eager) on the CPU device, the CPU
capture emulation's refusal of stale addresses, the device KV cache, and the cudart device
against a fake cudart (the call order of a capture). No GPU has run any of this."""
from __future__ import annotations

import logging

import numpy as np
import pytest
from fake_cuda import fake_cudart

from specrt.runtime.backends.cuda_device import CudaDevice
from specrt.runtime.backends.device import CpuDevice, DeviceKVCache, Step
from specrt.runtime.backends.gpu_errors import CaptureError, StaleGraphError
from specrt.runtime.backends.lifecycle import CAPTURED, EAGER_ONLY, FALLBACK, WARMUP, GraphLifecycle


class Counter:
    """A step that adds 1 to a device buffer, so every run is visible in the output."""

    def __init__(self, device, name="decode"):
        self.device, self.buf, self.runs = device, device.alloc((1,), np.int64), 0
        self.step = Step(name, self.run, lambda: (self.buf.address,))

    def run(self, _options):
        self.runs += 1
        self.buf.handle[0] += 1


def _lifecycle(warmup=3, device=None, **kw):
    device = device or CpuDevice()
    return GraphLifecycle(device, warmup=warmup, **kw), device


def test_warm_up_runs_then_one_capture_then_replay_every_step():
    lc, dev = _lifecycle(warmup=3)
    c = Counter(dev)
    lc.add(c.step, capture=True)
    phases = []
    for _ in range(7):
        lc.run("decode")
        phases.append(lc.stats()["decode"].phase)
    assert phases == [WARMUP] * 3 + [CAPTURED] * 4
    s = lc.stats()["decode"]
    assert (s.eager_runs, s.captures, s.replays, s.fallback) == (3, 1, 3, None)
    assert len(dev.graphs) == 1 and c.runs == 7 and c.buf.handle[0] == 7   # capture also ran its step


def test_zero_warm_up_captures_on_the_first_run():
    lc, dev = _lifecycle(warmup=0)
    c = Counter(dev)
    lc.add(c.step, capture=True)
    lc.run("decode")
    assert lc.stats()["decode"].captures == 1 and lc.stats()["decode"].eager_runs == 0


def test_each_shape_is_captured_once_and_prefill_never():
    lc, dev = _lifecycle(warmup=1)
    steps = {n: Counter(dev, n) for n in ("prefill", "decode", "verify")}
    for n, c in steps.items():
        lc.add(c.step, capture=n != "prefill")
    for _ in range(5):
        for n in steps:
            lc.run(n)
    st = lc.stats()
    assert st["prefill"] == st["prefill"].__class__(EAGER_ONLY, 5, 0, 0, 0, None)
    assert [(st[n].captures, st[n].replays, st[n].eager_runs) for n in ("decode", "verify")] == [(1, 3, 1)] * 2
    assert sorted(g.step.name for g in dev.graphs) == ["decode", "verify"]


def test_disabled_graphs_run_everything_eagerly():
    lc, dev = _lifecycle(warmup=1, enabled=False)
    c = Counter(dev)
    lc.add(c.step, capture=True)
    for _ in range(4):
        lc.run("decode")
    assert lc.stats()["decode"].phase == EAGER_ONLY and not dev.graphs and c.buf.handle[0] == 4


def test_rebinding_a_buffer_invalidates_the_graph_and_it_is_captured_again():
    lc, dev = _lifecycle(warmup=2)
    c = Counter(dev)
    lc.add(c.step, capture=True)
    for _ in range(4):
        lc.run("decode")
    first = dev.graphs[0]
    c.buf = dev.alloc((1,), np.int64)          # re-bound: a new address
    lc.invalidate("decode")
    assert first.released and lc.stats()["decode"].phase == WARMUP
    for _ in range(4):
        lc.run("decode")
    s = lc.stats()["decode"]
    assert (s.captures, s.invalidations, s.eager_runs) == (2, 1, 4)
    assert dev.graphs[1].addresses == (c.buf.address,) and c.buf.handle[0] == 4


def test_replaying_over_a_rebound_buffer_without_invalidating_is_refused_on_cpu():
    """What a CUDA graph would do silently (read the old buffer) the CPU emulation refuses."""
    lc, dev = _lifecycle(warmup=0)
    c = Counter(dev)
    lc.add(c.step, capture=True)
    lc.run("decode")
    c.buf = dev.alloc((1,), np.int64)
    with pytest.raises(StaleGraphError, match="invalidate"):
        lc.run("decode")


class FailingDevice(CpuDevice):
    def __init__(self, on="capture"):
        super().__init__()
        self.on = on

    def capture(self, step):
        if self.on == "capture":
            raise CaptureError("operation not permitted when stream is capturing")
        return super().capture(step)

    def replay(self, graph):
        if self.on == "replay":
            raise CaptureError("graph launch failed")
        return super().replay(graph)


@pytest.mark.parametrize("on", ["capture", "replay"])
def test_a_failed_capture_falls_back_to_eager_with_a_warning_and_a_flag(on, caplog):
    lc, dev = _lifecycle(warmup=1, device=FailingDevice(on))
    c = Counter(dev)
    lc.add(c.step, capture=True)
    with caplog.at_level(logging.WARNING):
        for i in range(6):
            lc.run("decode")
            assert c.buf.handle[0] == i + 1      # every step ran once, the one whose capture/replay failed too
    s = lc.stats()["decode"]
    assert s.phase == FALLBACK and lc.fallbacks == {"decode": s.fallback}
    assert s.fallback in ("operation not permitted when stream is capturing", "graph launch failed")
    assert sum("capture of the decode graph failed" in r.message for r in caplog.records) == 1


def test_invalid_warm_up_counts_are_refused():
    with pytest.raises(ValueError, match="warmup"):
        GraphLifecycle(CpuDevice(), warmup=-1)


def test_device_kv_cache_is_allocated_once_zeroed_and_rewinding_moves_an_integer():
    dev = CpuDevice()
    cache = DeviceKVCache(dev, layers=2, kv_heads=2, capacity=8, head_dim=4, dtype=np.float16)
    assert len(cache.keys) == 2 and cache.keys[0].shape == (1, 2, 8, 4) and cache.nbytes == 4 * 2 * 8 * 4 * 2
    assert all(not b.handle.any() for b in (*cache.keys, *cache.values))
    addresses = [b.address for b in cache.keys]
    cache.keys[0].handle[0, 0, 3] = 1
    cache.rewind_to(5)
    cache.rewind_to(2)
    assert cache.length == 2 and [b.address for b in cache.keys] == addresses and cache.keys[0].handle[0, 0, 3, 0] == 1


# --- the cudart device with a fake cudart ------------------------------------------------------

def test_cuda_capture_is_begin_enqueue_end_instantiate_then_one_launch():
    calls = []
    rt = fake_cudart(calls)
    dev = CudaDevice(rt)
    buf = dev.alloc((1,), np.int64)
    ran = []
    step = Step("decode", lambda _o: rt.enqueue(dev.stream, lambda: ran.append(1)), lambda: (buf.address,))
    lc = GraphLifecycle(dev, warmup=1)
    lc.add(step, capture=True)
    for _ in range(4):
        lc.run("decode")
    graph_calls = [c[0] for c in calls if c[0].startswith("cudaStream") and c[0] != "cudaStreamCreate"
                   or c[0].startswith("cudaGraph")]
    assert graph_calls == ["cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate",
                           "cudaGraphLaunch", "cudaGraphLaunch", "cudaGraphLaunch"]
    assert ("cudaStreamBeginCapture", "cudaStreamCaptureModeGlobal") in calls
    assert len(ran) == 4                      # warm-up, capture's launch, two replays
    host = dev.host((1,), np.int64)
    dev.write(buf, np.array([41], np.int64))
    dev.read(buf, host)
    assert host.array[0] == 41


@pytest.mark.parametrize("fail", ["begin", "end", "instantiate"])
def test_a_cuda_capture_failure_is_a_capture_error_and_the_step_runs_eagerly(fail):
    calls = []
    rt = fake_cudart(calls, fail=(fail,))
    dev = CudaDevice(rt)
    ran = []
    lc = GraphLifecycle(dev, warmup=1)
    lc.add(Step("verify", lambda _o: rt.enqueue(dev.stream, lambda: ran.append(1)), lambda: ()), capture=True)
    for _ in range(3):
        lc.run("verify")
    assert len(ran) == 3 and rt.capturing is None and lc.stats()["verify"].phase == FALLBACK
    assert fail in lc.fallbacks["verify"] or "cuda" in lc.fallbacks["verify"].lower()
    assert not any(c[0] == "cudaGraphLaunch" for c in calls)
