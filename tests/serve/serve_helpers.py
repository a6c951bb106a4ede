"""A live server on 127.0.0.1 (uvicorn in a thread, real sockets) and a gate that holds
an engine's generation still, so tests of cancellation and queueing do not race."""
from __future__ import annotations

import threading
import time

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.request import Delta
from specrt.serve.server import ServeConfig, bind, build_app, uvicorn_config

WAIT_S = 60.0   # a hang guard, never a performance bound


def wait_for(cond, what: str, timeout: float = WAIT_S):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.01)
    raise AssertionError(f"gave up waiting for {what}")


def _asgi(app):
    """`app` as a plain ASGI function. uvicorn probes for an app factory by calling its app with
    no arguments and expects a TypeError; under `make mutation` the guard's __call__ is mutmut's
    (*args, **kwargs) trampoline, which raises none, and uvicorn would serve the coroutine made."""
    async def asgi(scope, receive, send):
        return await app(scope, receive, send)
    return asgi


class LiveServer:
    def __init__(self, engines, factory=None, **cfg):
        self.cfg = ServeConfig(str(engines), port=0, **cfg)
        self.app, self.pool = build_app(self.cfg, factory)
        self.pool.start()
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn_config(_asgi(self.app), self.cfg)     # the limits `specrt serve` runs with
        config.timeout_graceful_shutdown = 5
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "the server to start")

    @property
    def model(self) -> str:
        return self.cfg.served_name

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=WAIT_S).json()

    def metrics(self) -> dict:
        """{(sample name, frozenset(labels minus model)): value}"""
        text = httpx.get(self.url + "/metrics", timeout=WAIT_S).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = frozenset((k, v) for k, v in s.labels.items() if k != "model")
                out[(s.name, labels)] = s.value
        return out

    def count(self, endpoint: str, outcome: str) -> float:
        return self.metrics().get(("specrt_requests_total", frozenset({("endpoint", endpoint),
                                                                      ("outcome", outcome)})), 0.0)

    def close(self):
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.sock.close()


def wrap_sinks(gen, wrap):
    """`gen` (a BatchGenerator) with every sink the server submits passed through
    `wrap(sink) -> sink` first: the wrapped sink runs on the engine thread, where a test can
    hold or slow a generation (the server submits every request as n samples)."""
    submit_n = gen.submit_n

    def wrapped(*a, sinks, **kw):
        return submit_n(*a, sinks=[wrap(s) for s in sinks], **kw)
    gen.submit_n = wrapped
    return gen


class Gate:
    """Wraps each engine copy the server opens: every request emits its first tokens, then
    its engine thread waits until the test opens the gate. `blocked` is set while it waits."""

    def __init__(self):
        self.open, self.blocked = threading.Event(), threading.Event()

    def factory(self, engines, **kw):
        return wrap_sinks(open_batch(engines, **kw), self._gated)

    def _gated(self, sink):
        def gated(ev):
            sink(ev)
            if isinstance(ev, Delta) and ev.tokens and not self.open.is_set():
                self.blocked.set()
                self.open.wait(WAIT_S)
                self.blocked.clear()
        return gated
