"""Cancellation, queueing and timeouts, made deterministic: a gate holds each worker's
generation still after its first token until the test opens it."""
from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import time

import httpx
import openai
import pytest

from specrt.serve import app

from .serve_helpers import WAIT_S, Gate, LiveServer, wait_for

CHAT = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 40, "temperature": 0}
COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 20, "temperature": 0}


@pytest.fixture
def gated(tiny_self_engines, request):
    gate = Gate()
    server = LiveServer(tiny_self_engines, factory=gate.factory, workers=1, **getattr(request, "param", {}))
    yield server, gate
    gate.open.set()
    server.close()


def test_a_client_that_disconnects_mid_stream_frees_the_worker(gated, reference):
    server, gate = gated
    with httpx.Client(timeout=WAIT_S) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", json=CHAT | {"stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()    # held: a dropped httpx line iterator closes the connection
            first = next(line for line in lines if line.startswith("data: "))
            assert '"role":"assistant"' in first
            assert gate.blocked.wait(WAIT_S)          # the worker holds the job, one token emitted
        # leaving the block closed the connection mid-stream
    wait_for(lambda: server.count("/v1/chat/completions", "cancelled") == 1, "the server to see the disconnect")
    gate.open.set()                                   # the worker gets its next token, sees the cancel
    wait_for(lambda: server.health()["busy"] == 0, "the worker to be freed")
    # only the one token before the disconnect was generated: the stream was closed, not finished
    assert server.metrics()[("specrt_generation_tokens_total", frozenset())] == 1
    # the same worker serves the next request, from a rewound cache
    got = httpx.post(server.url + "/v1/completions", json=COMPLETION, timeout=WAIT_S).json()
    assert got["choices"][0]["text"] == reference.generate(COMPLETION["prompt"], max_new_tokens=20).text


def test_a_non_streaming_client_that_gives_up_frees_the_worker(gated, reference):
    server, gate = gated
    body = json.dumps(COMPLETION).encode()
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as s:    # a client that hangs up
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert gate.blocked.wait(WAIT_S)      # its job is running, one token generated
    wait_for(lambda: server.count("/v1/completions", "cancelled") == 1, "the server to see the client leave")
    gate.open.set()
    wait_for(lambda: server.health()["busy"] == 0, "the worker to be freed")
    assert server.metrics()[("specrt_generation_tokens_total", frozenset())] == 1
    got = httpx.post(server.url + "/v1/completions", json=COMPLETION, timeout=WAIT_S).json()
    assert got["choices"][0]["text"] == reference.generate(COMPLETION["prompt"], max_new_tokens=20).text


@pytest.mark.parametrize("gated", [{"queue_size": 1}], indirect=True)
def test_a_full_queue_answers_429_and_the_queued_requests_still_complete(gated, reference):
    server, gate = gated
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    with cf.ThreadPoolExecutor(2) as ex:
        running = ex.submit(lambda: oai.completions.create(model=server.model, **COMPLETION).choices[0].text)
        assert gate.blocked.wait(WAIT_S)
        queued = ex.submit(lambda: oai.chat.completions.create(model=server.model, **CHAT).choices[0].message.content)
        wait_for(lambda: server.health()["queued"] == 1, "the second request to queue")
        assert server.metrics()[("specrt_queue_depth", frozenset())] == 1
        r = httpx.post(server.url + "/v1/completions", json=COMPLETION, timeout=WAIT_S)
        assert r.status_code == 429
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "queue_full" and "--queue-size" in err["message"]
        with pytest.raises(openai.RateLimitError):
            oai.completions.create(model=server.model, **COMPLETION)
        gate.open.set()
        assert running.result(WAIT_S) == reference.generate(COMPLETION["prompt"], max_new_tokens=20).text
        assert queued.result(WAIT_S) == reference.generate("Tell me a story.", chat=True, max_new_tokens=40).text
    assert server.count("/v1/completions", "rejected") == 2


def test_a_client_that_leaves_the_queue_is_dropped_from_it(gated):
    server, gate = gated
    with httpx.Client(timeout=WAIT_S) as c:
        with c.stream("POST", server.url + "/v1/completions", json=COMPLETION | {"stream": True}):
            assert gate.blocked.wait(WAIT_S)
            with httpx.Client(timeout=WAIT_S) as c2:
                with c2.stream("POST", server.url + "/v1/completions", json=COMPLETION | {"stream": True}) as r2:
                    assert r2.status_code == 200
                    wait_for(lambda: server.health()["queued"] == 1, "the second request to queue")
            wait_for(lambda: server.health()["queued"] == 0, "the queue to drop the departed client")
    gate.open.set()
    wait_for(lambda: server.health()["busy"] == 0, "the worker to be freed")
    assert server.health()["workers"][0]["requests"] == 1     # the departed one never ran


class _StoppedClock:
    """specrt.serve.app's `time` with perf_counter stopped: no request deadline passes."""

    def __init__(self):
        self.time, self.t = time.time, time.perf_counter()

    def perf_counter(self) -> float:
        return self.t


@pytest.mark.parametrize("gated", [{"timeout": 1.0}], indirect=True)
def test_a_request_past_its_timeout_gets_504_and_frees_the_worker(gated, reference, monkeypatch):
    server, gate = gated
    r = httpx.post(server.url + "/v1/completions", json=COMPLETION, timeout=WAIT_S)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert "--timeout" in r.json()["error"]["message"]
    gate.open.set()
    wait_for(lambda: server.health()["busy"] == 0, "the worker to be freed")
    # the next request checks the freed worker, not the timeout: the server's 1 s must not run out
    # on it while a busy machine serves it
    monkeypatch.setattr(app, "time", _StoppedClock())
    got = httpx.post(server.url + "/v1/completions", json=COMPLETION, timeout=WAIT_S).json()
    assert got["choices"][0]["text"] == reference.generate(COMPLETION["prompt"], max_new_tokens=20).text
    assert server.count("/v1/completions", "timeout") == 1


@pytest.mark.parametrize("gated", [{"timeout": 1.0}], indirect=True)
def test_a_stream_past_its_timeout_ends_with_an_error_event(gated):
    server, gate = gated
    r = httpx.post(server.url + "/v1/completions", json=COMPLETION | {"stream": True}, timeout=WAIT_S)
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and '"code":"timeout"' in events[-2]


def _fails_once(gen):
    """An engine copy whose first step after a request's first token raises, as a bug in the
    model would (BatchGenerator fails that step's requests and serves on)."""
    eng, step, failed = gen.engine, gen.engine.step, []

    def failing():
        if not failed and any(r.emitted for r in eng.rows):
            failed.append(True)
            raise RuntimeError("a bug")
        return step()
    eng.step = failing
    return gen


def test_an_unexpected_failure_is_a_500_body_and_the_worker_lives_on(tiny_self_engines, reference):
    from specrt.runtime.batch.generator import open_batch
    server = LiveServer(tiny_self_engines, factory=lambda e, **kw: _fails_once(open_batch(e, **kw)), workers=1)
    try:
        r = httpx.post(server.url + "/v1/completions", json=COMPLETION, timeout=WAIT_S)
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "server log" in err["message"] and "a bug" not in err["message"]
        got = httpx.post(server.url + "/v1/completions", json=COMPLETION, timeout=WAIT_S).json()
        assert got["choices"][0]["text"] == reference.generate(COMPLETION["prompt"], max_new_tokens=20).text
        assert server.count("/v1/completions", "error") == 1
    finally:
        server.close()
