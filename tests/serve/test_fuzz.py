"""A short, seeded pass of scripts/fuzz_server.py's request bodies against a live server:
every answer is a 2xx with a complete body or a 4xx with an OpenAI error body, never a
5xx (the long run is the script's; its output is in the issue's closing note)."""
from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings

from .serve_helpers import WAIT_S

spec = importlib.util.spec_from_file_location("fuzz_server", Path(__file__).parents[2] / "scripts" / "fuzz_server.py")
fuzz = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fuzz)

CASES = 25


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
    assert live.health()["status"] == "ok"


def test_the_checker_flags_a_server_error_and_a_stream_without_done():
    req = httpx.Request("POST", "http://127.0.0.1/v1/completions")
    assert fuzz.check(httpx.Response(500, json={"error": {}}, request=req))
    assert fuzz.check(httpx.Response(400, text="oops", request=req))
    assert fuzz.check(httpx.Response(200, text="data: {}\n\n", headers={"content-type": "text/event-stream"},
                                     request=req))
    assert fuzz.check(httpx.Response(400, json={"error": {"message": "m", "type": "t", "param": None, "code": None}},
                                     request=req)) is None
