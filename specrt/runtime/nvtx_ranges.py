"""NVTX ranges, so an Nsight Systems timeline shows the loop: one domain `specrt`, ranges
`prefill`, `draft`, `verify`, `accept` (and `decode` for plain decoding).

    nsys profile -t nvtx,cuda,osrt .venv/bin/specrt generate artifacts/smollm2 "Hi"

Uses the `nvtx` package (a runtime dependency; a no-op without an NVTX collector
attached, ~0.2 us per push/pop pair here). Without the package the functions do nothing.
Event attributes are built once, so a range costs one push and one pop.
"""
from __future__ import annotations

RANGES = ("prefill", "draft", "verify", "accept", "decode")

try:
    import nvtx as _nvtx
except ImportError:           # pragma: no cover - nvtx is a declared dependency
    _nvtx = None

if _nvtx is not None:
    _domain = _nvtx.get_domain("specrt")
    _attrs = {name: _domain.get_event_attributes(message=name) for name in RANGES}

    def push(name: str) -> None:
        _domain.push_range(_attrs[name])

    def pop() -> None:
        _domain.pop_range()

    ENABLED = True
else:
    def push(name: str) -> None:
        pass

    def pop() -> None:
        pass

    ENABLED = False
