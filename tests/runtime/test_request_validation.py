"""One validation for the Python APIs and the server (issue 26): a bad request is refused by
`SpeculativeGenerator`, the batched API (`open_batch`) and both server modes the same way:
the same typed error in Python, and a 400 naming the field with that error's message over
HTTP. Token ids at the vocabulary's edge: vocab - 1 is generated from, vocab is refused.

The servers run in-process (their app over httpx's ASGI transport, their pools started by
hand): the same app, validator and pool as `specrt serve`, without sockets."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from specrt import manifest as mf
from specrt.errors import PromptError, SamplingParamsError, TokenizerMismatchError
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.batch.generator import open_batch
from specrt.serve.server import ServeConfig, build_app

WAIT_S = 600.0      # a hang guard, never a performance bound


@pytest.fixture(scope="module")
def vocab(tiny_self_engines, tiny_batch_engines) -> int:
    v = int(mf.load(tiny_self_engines).target.dims["vocab"])
    assert v == int(mf.load(tiny_batch_engines).target.dims["vocab"])
    return v


@pytest.fixture(scope="module")
def python_apis(tiny_self_engines, tiny_batch_engines):
    one = SpeculativeGenerator(tiny_self_engines, methods=("plain",))
    batch = open_batch(tiny_batch_engines, max_num_seqs=2)
    yield {"SpeculativeGenerator": lambda prompt, **kw: one.generate(prompt, method="plain", **kw),
           "open_batch": batch.generate}
    batch.close()


@pytest.fixture(scope="module")
def servers(tiny_self_engines, tiny_batch_engines):
    out, pools = {}, []
    for mode, engines, kw in (("one-request", tiny_self_engines, {}),
                              ("batched", tiny_batch_engines, {"max_num_seqs": 2})):
        app, pool = build_app(ServeConfig(str(engines), **kw))
        pool.start()
        pools.append(pool)
        out[mode] = app
    yield out
    for pool in pools:
        pool.close()


def post(app, path: str, body: dict) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                     timeout=WAIT_S) as client:
            return await client.post(path, json=body)
    return asyncio.run(go())


def refusal(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]

# (python prompt, python keywords, [(endpoint, body)], typed error, the field the 400 names); V: the vocabulary
CASES = {
    "role-robot": ([{"role": "robot", "content": "x"}], {"chat": True},
                   [(CHAT, {"messages": [{"role": "robot", "content": "x"}]})], PromptError, "messages"),
    "role-tool": (USER + [{"role": "tool", "content": "x"}], {},
                  [(CHAT, {"messages": USER + [{"role": "tool", "content": "x"}]})], PromptError, "messages"),
    "role-empty": ([{"role": "", "content": "x"}], {},
                   [(CHAT, {"messages": [{"role": "", "content": "x"}]})], PromptError, "messages"),
    "stop-id-vocab": ("hi", {"stop_token_ids": ["V"]},
                      [(COMPLETIONS, {"prompt": "hi", "stop_token_ids": ["V"]}),
                       (CHAT, {"messages": USER, "stop_token_ids": ["V"]})], SamplingParamsError, "stop_token_ids"),
    "stop-id-huge": ("hi", {"stop_token_ids": [10**6]},
                     [(COMPLETIONS, {"prompt": "hi", "stop_token_ids": [10**6]}),
                      (CHAT, {"messages": USER, "stop_token_ids": [10**6]})], SamplingParamsError, "stop_token_ids"),
    "stop-id-negative": ("hi", {"stop_token_ids": [3, -1]},
                         [(COMPLETIONS, {"prompt": "hi", "stop_token_ids": [3, -1]}),
                          (CHAT, {"messages": USER, "stop_token_ids": [3, -1]})], SamplingParamsError,
                         "stop_token_ids"),
    "prompt-id-vocab": ([5, "V"], {}, [(COMPLETIONS, {"prompt": [5, "V"]})], TokenizerMismatchError, "prompt"),
    "prompt-id-negative": ([5, -1, 6], {}, [(COMPLETIONS, {"prompt": [5, -1, 6]})], TokenizerMismatchError, "prompt"),
}


def _v(value, vocab: int):
    """`value` with each "V" replaced by the vocabulary size."""
    if isinstance(value, dict):
        return {k: _v(x, vocab) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_v(x, vocab) for x in value)
    return vocab if value == "V" else value


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_request_is_refused_the_same_way_by_every_api(case, vocab, python_apis, servers):
    prompt, kw, bodies, error, param = _v(CASES[case], vocab)
    messages = set()
    for name, generate in python_apis.items():
        with pytest.raises(error) as e:
            generate(prompt, max_new_tokens=2, **kw)
        messages.add(str(e.value))
    assert len(messages) == 1, f"the Python APIs say different things: {messages}"
    for mode, app in servers.items():
        for path, body in bodies:
            err = refusal(post(app, path, {"max_tokens": 2, **body}))
            assert err["param"] == param, (mode, path, err)
            assert {err["message"]} == messages, (mode, path)


@pytest.mark.parametrize("mode", ["one-request", "batched"])
def test_a_prompt_token_id_equal_to_the_vocabulary_is_a_400_naming_the_prompt_and_one_less_is_served(
        mode, vocab, servers):
    app = servers[mode]
    ok = post(app, COMPLETIONS, {"prompt": [5, vocab - 1, 6], "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 3, ok.text
    err = refusal(post(app, COMPLETIONS, {"prompt": [5, vocab, 6], "max_tokens": 2}))
    assert err["param"] == "prompt" and f"[0, {vocab})" in err["message"]


@pytest.mark.parametrize("path,body", [(COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": USER})],
                         ids=["completions", "chat"])
@pytest.mark.parametrize("mode", ["one-request", "batched"])
def test_a_stop_token_id_equal_to_the_vocabulary_is_a_400_naming_it_and_one_less_is_served(
        mode, path, body, vocab, servers):
    app = servers[mode]
    ok = post(app, path, {**body, "max_tokens": 2, "temperature": 0, "stop_token_ids": [vocab - 1]})
    assert ok.status_code == 200, ok.text
    err = refusal(post(app, path, {**body, "max_tokens": 2, "stop_token_ids": [vocab - 1, vocab]}))
    assert err["param"] == "stop_token_ids" and f"[0, {vocab})" in err["message"]


@pytest.mark.parametrize("api", ["SpeculativeGenerator", "open_batch"])
def test_the_python_apis_take_ids_up_to_the_vocabulary_edge(api, vocab, python_apis):
    out = python_apis[api]([5, vocab - 1, 6], max_new_tokens=2, stop_token_ids=[vocab - 1])
    assert out.prompt_tokens == 3 and len(out.tokens) <= 2


def test_developer_is_the_system_role_in_python_and_the_server(tiny_self_engines, servers):
    """OpenAI's newer name for "system": chat templates know only "system"."""
    gen = SpeculativeGenerator(tiny_self_engines, methods=("plain",))
    turns = [{"role": "developer", "content": "Be kind."}, *USER]
    ids = gen.encode_prompt(turns)
    assert ids == gen.tokenizer.encode_chat([{"role": "system", "content": "Be kind."}, *USER])
    for mode, app in servers.items():
        r = post(app, CHAT, {"messages": turns, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(ids), (mode, r.text)
