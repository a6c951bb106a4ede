from __future__ import annotations

import pytest

from specrt.runtime import SpeculativeGenerator

from .serve_helpers import LiveServer


@pytest.fixture(scope="session")
def reference(tiny_self_engines):
    """The bare runtime on the same engines: what the server must reproduce."""
    return SpeculativeGenerator(tiny_self_engines, methods=("speculative",))


@pytest.fixture(scope="module")
def live(tiny_self_engines):
    server = LiveServer(tiny_self_engines, workers=2, queue_size=8)
    yield server
    server.close()
