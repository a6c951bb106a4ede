"""A short, seeded pass of scripts/fuzz_server.py's request bodies against a live server on
127.0.0.1, the one-request-per-worker server and the batched one (`--max-num-seqs`): every
answer is a 2xx with a complete body or a 4xx with an OpenAI error body, never a 5xx (the
long run is the script's; its output is in the issue's closing note). Bounded: CASES bodies
of at most 24 tokens each per endpoint."""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from .serve_helpers import WAIT_S, LiveServer

spec = importlib.util.spec_from_file_location("fuzz_server", Path(__file__).parents[2] / "scripts" / "fuzz_server.py")
fuzz = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fuzz)

CASES = 25
SERVERS = {"workers": ("tiny_self_engines", {"workers": 2}), "batched": ("tiny_batch_engines", {"max_num_seqs": 2})}


@pytest.fixture(scope="module", params=list(SERVERS))
def live(request):
    """Each server kind in turn (overrides conftest's one-request server)."""
    fixture, cfg = SERVERS[request.param]
    server = LiveServer(request.getfixturevalue(fixture), queue_size=8, **cfg)
    server.kind = request.param
    yield server
    server.close()


@pytest.mark.parametrize("kind,strategy", [("completion", fuzz.completion_bodies()), ("chat", fuzz.chat_bodies()),
                                           ("raw", fuzz.raw_bodies)])
def test_fuzzed_request_bodies_never_get_a_server_error(live, kind, strategy):
    seen = Counter()
    with httpx.Client(base_url=live.url, timeout=WAIT_S) as client:
        @settings(max_examples=CASES, deadline=None, database=None, phases=(Phase.generate,),
                  suppress_health_check=list(HealthCheck))
        @seed(16)
        @given(body=strategy)
        def one(body):
            r = fuzz.send(client, fuzz.PATHS.get(kind, "/v1/completions"), body)
            seen[r.status_code] += 1
            assert fuzz.check(r) is None, (body, r.status_code, r.text[:300])
        one()
    assert sum(seen.values()) >= CASES and 400 in seen
    assert kind == "raw" or 200 in seen, "no valid request was generated"
    health = live.health()
    rows = [w["max_num_seqs"] for w in health["workers"]]
    assert health["status"] == "ok" and rows == ([1, 1] if live.kind == "workers" else [2])


def test_the_script_fuzzes_the_batched_server_it_starts(tiny_batch_engines):
    """scripts/fuzz_server.py --max-num-seqs 2: `specrt serve --max-num-seqs 2` in a subprocess on
    127.0.0.1, a few bodies of each kind, then SIGTERM: no finding, a clean exit."""
    assert fuzz.server_command(tiny_batch_engines, 2)[-2:] == ["--max-num-seqs", "2"]
    assert "--max-num-seqs" not in fuzz.server_command(tiny_batch_engines)
    report = fuzz.fuzz(tiny_batch_engines, cases=4, seed=2, max_num_seqs=2)
    assert report["server"]["rows"] == [2] and report["findings"] == [] and report["server_exit"] == 0, report
    assert report["cases"] >= 3 * 4


def test_the_checker_flags_a_server_error_and_a_stream_without_done():
    req = httpx.Request("POST", "http://127.0.0.1/v1/completions")
    assert fuzz.check(httpx.Response(500, json={"error": {}}, request=req))
    assert fuzz.check(httpx.Response(400, text="oops", request=req))
    assert fuzz.check(httpx.Response(200, text="data: {}\n\n", headers={"content-type": "text/event-stream"},
                                     request=req))
    assert fuzz.check(httpx.Response(400, json={"error": {"message": "m", "type": "t", "param": None, "code": None}},
                                     request=req)) is None
