"""The seam between the engine and a backend: what the engine needs, typed, and a registry
that picks the backend a manifest was built for.

    manifest.device {"backend": "onnxruntime", "kind": "cpu", ...}
        └─ backend_for(manifest) ─► Backend("ort-cpu")
              ├─ check_device(manifest)        refuses engines built elsewhere, says what to rebuild
              ├─ open_model(root, entry, shapes, cache=..., graphs=..., ...) ─► ModelRunner
              │     .step(graph, tokens, start) -> logits [n, V] (host, reused buffer)
              │     .argmax_step(graph, tokens, start, out)  greedy: n integers (tools; the engine
              │                                              reads logits: choices, grammars, logprobs)
              │     .cache: Cache (.length, .capacity, .rewind_to(n))
              │     the engine runs it as a BatchModel of one row (runtime/batch/one_row.py)
              └─ open_batch(root, entry, shapes, rows=..., ...) ─► BatchModel (runtime/batch/model.py)
                    the batched engine's model over a cache of many rows; None: the backend
                    has no batched runner (open_batch refuses such a folder, naming the fix)

The engine sees only BatchModel (a ModelRunner through OneRowModel). A device backend (ONNX
Runtime CUDA, TensorRT) keeps its KV on the device and implements the same two protocols; a
draft that reads its target's cache says so with `shares_cache`, never by identity.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from specrt.errors import ManifestError


@runtime_checkable
class Cache(Protocol):
    """A preallocated KV cache: rows [0, length) are valid; rewinding moves an integer."""
    length: int
    capacity: int

    def rewind_to(self, length: int) -> None: ...


@runtime_checkable
class ModelRunner(Protocol):
    """One model's static-shape graphs over one KV cache.

    step: run `graph` on `tokens` (n <= the graph's T) at positions start..start+n-1,
    write their K/V into the cache, return logits [n, V] float32 on the host. The
    returned array is a reused buffer: read it before the next step."""
    cache: Cache
    shares_cache: bool

    def step(self, graph: str, tokens: Sequence[int], start: int) -> np.ndarray: ...

    def argmax_step(self, graph: str, tokens: Sequence[int], start: int, out: np.ndarray) -> None:
        """Like step, but write only each row's argmax into out [n] int64 (greedy decoding):
        a device backend computes it on the device and reads back n integers."""
        ...


@dataclass(frozen=True)
class Backend:
    name: str                                   # what a user types: "ort-cpu"
    device_backend: str                         # manifest device.backend it serves
    device_kind: str                            # manifest device.kind it serves
    memory_modes: tuple[str, ...]
    open_model: Callable[..., ModelRunner]
    check_device: Callable[[object], None]
    # open_batch(root, entry, shapes, *, rows, threads, graphs=None, cache=None, serves="step",
    # min_rows=None, buckets=None, execution="cpu") -> BatchModel: the batched engine's model
    # (the target's "step" graph, the int8 self-draft's "draft" graph over its cache, or a draft
    # model with its own); buckets: static row buckets with captured graphs (device_batch.py)
    open_batch: Callable[..., object] | None = None


_REGISTRY: dict[tuple[str, str], Backend] = {}


def register(backend: Backend) -> Backend:
    _REGISTRY[(backend.device_backend, backend.device_kind)] = backend
    return backend


def registered() -> list[Backend]:
    return list(_REGISTRY.values())


def backend_for(manifest) -> Backend:
    """The backend that runs engines built for manifest.device, or a ManifestError that says
    which backends this installation has."""
    dev = manifest.device
    key = (dev.get("backend"), dev.get("kind"))
    if key not in _REGISTRY:
        have = ", ".join(f"{b.name} ({b.device_backend} on {b.device_kind})" for b in _REGISTRY.values())
        raise ManifestError(f"engines were built for backend {key[0]!r} on {key[1]!r}; this runtime has {have}: "
                            "rebuild with `specrt build` on this machine, or install the backend they need")
    return _REGISTRY[key]


def check_built_for(device: dict, name: str, backend: str, kind: str) -> None:
    """Refuse engines built for another backend, processor or OS than the `name` backend runs
    here ({"backend": backend, "kind": kind}); the device check the GPU backends share (ort-cpu's
    is manifest_device.check_device, which also compares the kind with this machine's)."""
    if (device.get("backend"), device.get("kind")) != (backend, kind):
        raise ManifestError(f"engines were built for backend {device.get('backend')!r} on {device.get('kind')!r}; "
                            f"the {name} backend runs {backend!r} on {kind!r}: rebuild with `specrt build` on this "
                            "machine")
    for key, here in (("machine", platform.machine()), ("os", platform.system())):
        if device.get(key) is not None and device.get(key) != here:
            raise ManifestError(f"engines were built for {key}={device.get(key)!r}; this machine has {key}={here!r}: "
                                "rebuild the engines on this machine")
