"""`specrt serve --max-num-seqs N`: one batched engine behind the same HTTP API."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from specrt.runtime.batch.generator import open_batch
from specrt.serve.errors import ServeConfigError
from specrt.serve.server import ServeConfig, build_app

from .serve_helpers import WAIT_S, LiveServer, wait_for

PROMPTS = ["hello there", "the quick brown fox", "x", "one two three four five six", "to be or not", "a b c"]


@pytest.fixture(scope="module")
def live(tiny_batch_engines):
    server = LiveServer(tiny_batch_engines, max_num_seqs=3, queue_size=8)
    yield server
    server.close()


def _complete(url, model, prompt, **kw):
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                  "temperature": 0, **kw}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_concurrent_requests_get_the_answers_they_get_alone(live, tiny_batch_engines):
    ref = open_batch(tiny_batch_engines, max_num_seqs=1)
    try:
        alone = [ref.generate(p, max_new_tokens=16).text for p in PROMPTS]
    finally:
        ref.close()
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        got = list(ex.map(lambda p: _complete(live.url, live.model, p), PROMPTS))
    assert got == alone
    m = live.metrics()
    assert m[("specrt_batch_steps", frozenset())] > 0
    assert m[("specrt_batch_occupancy", frozenset())] >= 1.0      # (overlap depends on timing: see the engine tests)
    assert m[("specrt_batch_step_choice", frozenset({("kind", "plain")}))] == m[("specrt_batch_steps", frozenset())]
    h = live.health()
    assert h["method"] == "batched" and h["workers"][0]["max_num_seqs"] == 3


def test_a_stream_cut_by_the_client_frees_its_row(live):
    with httpx.Client(timeout=WAIT_S) as c:
        with c.stream("POST", live.url + "/v1/completions", json={"model": live.model, "prompt": "hello",
                                                                  "max_tokens": 60, "stream": True}) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
    wait_for(lambda: live.health()["busy"] == 0, "the row to be freed")


def test_the_config_refuses_what_it_cannot_serve(tiny_int4_engines):
    with pytest.raises(ServeConfigError, match="--workers"):
        ServeConfig("x", max_num_seqs=4, workers=2)
    with pytest.raises(ServeConfigError, match="256"):
        ServeConfig("x", max_num_seqs=0)
    with pytest.raises(ServeConfigError, match="--batch"):
        build_app(ServeConfig(str(tiny_int4_engines), max_num_seqs=4))


def test_top_k_min_p_stop_token_ids_and_ignore_eos_reach_the_batched_engine(live, tiny_batch_engines):
    from specrt.runtime.sampling import SamplingParams
    ref = open_batch(tiny_batch_engines, max_num_seqs=1)
    try:
        full = ref.generate(PROMPTS[1], max_new_tokens=16)
        stop_id = full.tokens[4]
        stopped = ref.generate(PROMPTS[1], max_new_tokens=16, stop_token_ids=[stop_id])
        sampled = ref.generate(PROMPTS[0], max_new_tokens=16,
                               sampling=SamplingParams(temperature=1.0, top_k=3, min_p=0.2, seed=4))
        eos = next((p for p in PROMPTS + ["a", "b", "zz", "hello"]
                    if ref.generate(p, max_new_tokens=60).finish_reason == "eos"), None)
        assert eos is not None, "no prompt reaches EOS: the ignore_eos check would mean nothing"
        ended = ref.generate(eos, max_new_tokens=60)
        through = ref.generate(eos, max_new_tokens=len(ended.tokens) + 6, ignore_eos=True)
    finally:
        ref.close()
    assert stopped.finish_reason == "stop" and len(stopped.tokens) < 5
    assert through.finish_reason == "length" and len(through.tokens) == len(ended.tokens) + 6
    assert _complete(live.url, live.model, PROMPTS[1], stop_token_ids=[stop_id]) == stopped.text
    assert _complete(live.url, live.model, PROMPTS[0], temperature=1.0, top_k=3, min_p=0.2, seed=4) == sampled.text
    r = httpx.post(live.url + "/v1/completions", timeout=WAIT_S, json={
        "model": live.model, "prompt": eos, "temperature": 0, "ignore_eos": True, "max_tokens": len(through.tokens)})
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["choices"][0]["text"] == through.text
