"""When each static-shape graph runs eagerly, is captured as a CUDA graph, or is replayed.

Per shape (draft decode, target decode, target verify):

    warmup ──(warmup eager runs)──► capture ──► captured: replay every step
      ▲                                │  CaptureError           │ CaptureError on replay
      └── invalidate() (re-bound       ▼                         ▼
          buffer): graph released    fallback: eager every step, logged once, flagged
    eager-only: prefill, never captured (its chunk count varies; onnxruntime-genai does the same)

Warm-up runs let kernels allocate, build plans and sync before capture (GPU.md A3: ONNX
Runtime wants >= 2 regular runs per graph id, and kernels that sync or build plans must
see a non-captured run; B6: TensorRT wants one plain enqueue). A failed capture never
costs correctness: the step runs eagerly at once and the shape stays eager (`fallbacks`
says which and why). The device decides what capture means (device.Device).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from specrt.errors import BackendError
from specrt.runtime.backends.device import Device, Step
from specrt.runtime.backends.gpu_errors import CaptureError

EAGER_ONLY, WARMUP, CAPTURED, FALLBACK = "eager-only", "warmup", "captured", "fallback"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShapeStats:
    phase: str
    eager_runs: int        # warm-up, eager-only and fallback runs
    captures: int
    replays: int
    invalidations: int
    fallback: str | None   # why this shape runs eagerly after a failed capture


class _Shape:
    def __init__(self, step: Step, capture: bool):
        self.step = step
        self.phase = WARMUP if capture else EAGER_ONLY
        self.warm = self.eager_runs = self.captures = self.replays = self.invalidations = 0
        self.graph = None
        self.fallback: str | None = None


class GraphLifecycle:
    """The capture state of every graph of one runner. `warmup`: eager runs before capture;
    `enabled=False` runs everything eagerly (e.g. to compare with and without graphs)."""

    def __init__(self, device: Device, *, warmup: int, enabled: bool = True):
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"warmup={warmup!r} must be an integer >= 0")
        self.device, self.warmup, self.enabled = device, warmup, enabled
        self._shapes: dict[str, _Shape] = {}

    def add(self, step: Step, *, capture: bool) -> None:
        self._shapes[step.name] = _Shape(step, capture and self.enabled)

    def run(self, name: str) -> None:
        """Run the named graph once: eagerly, by capturing it, or by replaying it."""
        s = self._shapes[name]
        if s.phase == WARMUP and s.warm >= self.warmup:
            try:
                s.graph = self.device.capture(s.step)
            except CaptureError as e:
                return self._fall_back(s, e)
            s.phase, s.captures = CAPTURED, s.captures + 1
            return
        if s.phase == CAPTURED:
            try:
                self.device.replay(s.graph)
            except CaptureError as e:
                return self._fall_back(s, e)
            s.replays += 1
            return
        if s.phase == WARMUP:
            s.warm += 1
        self.device.eager(s.step)
        s.eager_runs += 1

    def invalidate(self, name: str | None = None) -> None:
        """A buffer of `name` (None: of every graph) was re-bound: release its graph and warm
        it up again with the new addresses."""
        for n, s in self._shapes.items():
            if name is not None and n != name:
                continue
            if s.graph is not None:
                self.device.release(s.graph)
                s.graph = None
            if s.phase == CAPTURED:
                s.phase, s.warm = WARMUP, 0
                s.invalidations += 1
            elif s.phase == WARMUP:
                s.warm = 0

    def release(self) -> None:
        """Release every graph (deactivate); the shapes would warm up again if run."""
        self.invalidate(None)

    def stats(self) -> dict[str, ShapeStats]:
        return {n: ShapeStats(s.phase, s.eager_runs, s.captures, s.replays, s.invalidations, s.fallback)
                for n, s in self._shapes.items()}

    @property
    def fallbacks(self) -> dict[str, str]:
        """Shapes that run eagerly because their capture failed, and why."""
        return {n: s.fallback for n, s in self._shapes.items() if s.fallback}

    def _fall_back(self, s: _Shape, error: CaptureError) -> None:
        if s.graph is not None:
            self.device.release(s.graph)
            s.graph = None
        s.phase, s.fallback = FALLBACK, str(error)
        log.warning("CUDA graph capture of the %s graph failed (%s); it runs without a CUDA graph from now on "
                    "(correct, slower)", s.step.name, error)
        self.device.eager(s.step)   # the step's outputs must exist: run it eagerly now
        s.eager_runs += 1


class DeviceRunner:
    """What the device runners (ort-cuda, tensorrt) share: the context-manager lifecycle over
    their activate()/deactivate(), greedy choice from step(), and what they report about their
    CUDA graphs (`self.lifecycle`, None before activate())."""
    lifecycle: "GraphLifecycle | None"

    def __enter__(self):
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def _shape(self, graph: str):
        """The per-graph buffers: .tokens, .ids/.ids_host, .past_len/.past_len_host, .logits/.logits_host."""
        raise NotImplementedError

    def step(self, graph: str, tokens, start: int):
        """ModelRunner.step: stage the tokens and start in place (a captured graph reads those
        addresses), run or replay the graph, read the logits rows back into the host buffer."""
        if not self.active:
            raise BackendError(f"the {self.entry.role} model is deactivated: call activate() (or use it in a `with`)")
        r = self._shape(graph)
        n = len(tokens)
        assert 0 < n <= r.tokens and start + r.tokens <= self.cache.capacity, (graph, n, start)
        ids = r.ids_host.array
        ids[0, :n] = tokens
        ids[0, n:] = 0   # padding rows: computed, written past the length, never read
        r.past_len_host.array[0] = start
        self.device.write(r.ids, r.ids_host)            # in place: the captured graph reads this address
        self.device.write(r.past_len, r.past_len_host)
        self.lifecycle.run(graph)
        self.device.read(r.logits, r.logits_host)
        return r.logits_host.array[0, :n]

    def argmax_step(self, graph: str, tokens, start: int, out) -> None:
        import numpy as np
        np.argmax(self.step(graph, tokens, start), axis=-1, out=out)

    def graph_stats(self) -> dict:
        """graph -> ShapeStats (phase, eager runs, captures, replays, fallback reason)."""
        return self.lifecycle.stats() if self.lifecycle else {}

    @property
    def eager_fallbacks(self) -> dict[str, str]:
        """Graphs running without a CUDA graph because their capture failed, and why."""
        return self.lifecycle.fallbacks if self.lifecycle else {}
