"""The server through the official `openai` client over real HTTP on 127.0.0.1: its
greedy output is the bare runtime's, alone and under concurrent load."""
from __future__ import annotations

import concurrent.futures as cf

import httpx
import openai
import pytest

from specrt.runtime import SamplingParams

PROMPTS = ["The quick brown fox", "Hello, world", "0123456789", "abc abc abc", "Tell me a story.",
           "xyz", "Once upon a time", "{[()]}"]


def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_engines(live):
    models = client(live).models.list()
    assert [m.id for m in models.data] == [live.model]
    health = live.health()
    assert health["status"] == "ok" and len(health["workers"]) == 2
    assert all(w["memory"] == "fast" for w in health["workers"])


def test_greedy_completion_equals_the_runtime(live, reference):
    for prompt, n in (("The quick brown fox", 24), ("Hello, world", 7)):
        got = client(live).completions.create(model=live.model, prompt=prompt, max_tokens=n, temperature=0)
        want = reference.generate(prompt, max_new_tokens=n)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
        assert got.usage.completion_tokens == len(want.tokens)
        assert got.usage.prompt_tokens == want.prompt_tokens


def test_streamed_chat_equals_the_runtime_and_ends_with_done(live, reference):
    want = reference.generate("Name three colors.", chat=True, max_new_tokens=30)
    stream = client(live).chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": "Name three colors."}], max_tokens=30,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].usage.completion_tokens == len(want.tokens)
    # the raw wire format: server-sent events closed by the [DONE] sentinel
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "stream": True}
    raw = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [e for e in raw.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_streamed_completion_with_stop_strings_equals_the_runtime(live, reference):
    full = reference.generate("Once upon a time", max_new_tokens=40).text
    stop = [full[10:12], "never-there"]
    want = reference.generate("Once upon a time", max_new_tokens=40, stop=stop)
    stream = client(live).completions.create(model=live.model, prompt="Once upon a time", max_tokens=40,
                                             temperature=0, stop=stop, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert stop[0] not in want.text and chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_equals_the_runtime(live, reference):
    want = reference.generate("Hello, world", max_new_tokens=20,
                              sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7))
    for _ in range(2):
        got = client(live).completions.create(model=live.model, prompt="Hello, world", max_tokens=20,
                                              temperature=0.9, top_p=0.95, seed=7)
        assert got.choices[0].text == want.text


def test_concurrent_clients_each_get_their_solo_output(live, reference):
    """16 requests from 8 threads on 2 workers: no KV state is ever shared."""
    jobs = [(PROMPTS[i % 8], 10 + 9 * (i % 5), i % 2 == 0, i % 3 == 0) for i in range(16)]
    want = {(p, n, chat): reference.generate(p, max_new_tokens=n, chat=chat).text for p, n, chat, _ in jobs}
    c = client(live)

    def run(job):
        prompt, n, chat, stream = job
        if chat:
            kw = dict(model=live.model, messages=[{"role": "user", "content": prompt}], max_tokens=n, temperature=0)
            if stream:
                return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True))
            return c.chat.completions.create(**kw).choices[0].message.content
        kw = dict(model=live.model, prompt=prompt, max_tokens=n, temperature=0)
        if stream:
            return "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True))
        return c.completions.create(**kw).choices[0].text

    with cf.ThreadPoolExecutor(8) as ex:
        got = list(ex.map(run, jobs))
    for (p, n, chat, _), text in zip(jobs, got):
        assert text == want[(p, n, chat)], (p, n, chat)
    assert sum(w["requests"] for w in live.health()["workers"]) >= 16


BAD = [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "seed": -1}, "seed"),
    ({"prompt": "hi", "seed": 1.5}, "seed"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
    ({"prompt": "x" * 200}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 99999]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_completion_requests_get_400_with_an_openai_error_body(live, body, param):
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and len(err["message"]) > 10


def test_bad_chat_requests_and_bodies(live):
    url = live.url + "/v1/chat/completions"
    for body, param in (({"messages": []}, "messages"),
                        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
                         "max_completion_tokens")):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, json={"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client(live).completions.create(model=live.model, prompt="hi", temperature=3)
    assert e.value.body["param"] == "temperature"


def test_metrics_parse_and_count_what_happened(live):
    before = live.metrics()
    client(live).completions.create(model=live.model, prompt="abc", max_tokens=12, temperature=0)
    httpx.post(live.url + "/v1/completions", json={"prompt": "hi", "top_p": 2}, timeout=60)
    m = live.metrics()

    def delta(name, **labels):
        key = (name, frozenset(labels.items()))
        return m.get(key, 0.0) - before.get(key, 0.0)

    assert delta("specrt_requests_total", endpoint="/v1/completions", outcome="ok") == 1
    assert delta("specrt_requests_total", endpoint="/v1/completions", outcome="bad_request") == 1
    assert delta("specrt_generation_tokens_total") == 12
    assert delta("specrt_prompt_tokens_total") > 0
    assert delta("specrt_time_to_first_token_seconds_count") == 1
    assert delta("specrt_inter_token_latency_seconds_count") == 11
    assert delta("specrt_spec_decode_draft_tokens_total") > 0
    assert 0.0 < m[("specrt_spec_decode_acceptance_rate", frozenset())] <= 1.0
    assert m[("specrt_queue_depth", frozenset())] == 0
    assert m[("process_resident_memory_bytes", frozenset())] > 0
