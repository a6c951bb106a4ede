"""The server honours vLLM's sampling extras (top_k, min_p, seed, stop_token_ids, ignore_eos)
as vLLM does, and refuses every field it cannot honour with a 400 naming it (never dropped
silently). Reference: the bare runtime on the same engines (conftest `reference`)."""
from __future__ import annotations

import json

import httpx
import pytest

from specrt.runtime import SamplingParams

from .serve_helpers import WAIT_S

PROMPT = "Hello, world"


def _complete(live, **kw) -> dict:
    body = {"model": live.model, "prompt": PROMPT, "max_tokens": 20, **kw}
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _text(live, **kw) -> str:
    return _complete(live, **kw)["choices"][0]["text"]


def test_top_k_1_is_greedy_at_any_temperature(live, reference):
    greedy = reference.generate(PROMPT, max_new_tokens=20).text
    assert {_text(live, temperature=1.0, top_k=1, seed=s) for s in range(3)} == {greedy}
    assert any(_text(live, temperature=1.0, seed=s) != greedy for s in range(3))     # without it, samples vary


@pytest.mark.parametrize("field,value", [("top_k", 3), ("min_p", 0.3)])
def test_top_k_and_min_p_sample_as_the_runtime_does_and_change_the_output(live, reference, field, value):
    seeds = range(4)
    for s in seeds:
        want = reference.generate(PROMPT, max_new_tokens=20,
                                  sampling=SamplingParams(temperature=1.0, seed=s, **{field: value}))
        assert _text(live, temperature=1.0, seed=s, **{field: value}) == want.text, s
    assert any(_text(live, temperature=1.0, seed=s, **{field: value}) != _text(live, temperature=1.0, seed=s)
               for s in seeds)


def test_top_k_minus_one_and_zero_mean_all_tokens_as_in_vllm(live):
    plain = _text(live, temperature=1.0, seed=5)
    assert _text(live, temperature=1.0, seed=5, top_k=-1) == plain == _text(live, temperature=1.0, seed=5, top_k=0)


def test_the_same_seed_gives_the_same_text_and_different_seeds_differ(live):
    texts = [_text(live, temperature=1.0, seed=s) for s in (11, 11, 12, 13)]
    assert texts[0] == texts[1]
    assert len(set(texts)) >= 2


def test_stop_token_ids_end_at_that_token_and_leave_it_out(live, reference):
    full = reference.generate(PROMPT, max_new_tokens=20)
    stop_id = full.tokens[5]
    cut = full.tokens.index(stop_id)
    want = reference.generate(PROMPT, max_new_tokens=20, stop_token_ids=[stop_id])
    assert want.finish_reason == "stop" and want.tokens == full.tokens[:cut]
    for stream in (False, True):
        if stream:
            r = httpx.post(live.url + "/v1/completions", timeout=WAIT_S, json={
                "model": live.model, "prompt": PROMPT, "max_tokens": 20, "temperature": 0,
                "stop_token_ids": [stop_id], "stream": True})
            events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
            chunks = [json.loads(e) for e in events]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            body = _complete(live, temperature=0, stop_token_ids=[stop_id])
            text, finish = body["choices"][0]["text"], body["choices"][0]["finish_reason"]
            assert body["usage"]["completion_tokens"] == cut
        assert text == want.text and finish == "stop"
        assert len(text) < len(full.text) and full.text.startswith(text)


def _eos_prompt(reference) -> str:
    for p in ["Hello, world", "0123456789", "abc abc abc", "xyz", "{[()]}", "The quick brown fox", "a", "b", "c",
              "Once upon a time", "zz", "q", "1 2 3"]:
        if reference.generate(p, max_new_tokens=60).finish_reason == "eos":
            return p
    raise AssertionError("no prompt reaches EOS within 60 tokens: the ignore_eos check would mean nothing")


def test_ignore_eos_generates_through_eos_up_to_max_tokens(live, reference):
    prompt = _eos_prompt(reference)
    ended = reference.generate(prompt, max_new_tokens=60)
    n = len(ended.tokens) + 8
    want = reference.generate(prompt, max_new_tokens=n, ignore_eos=True)
    assert want.finish_reason == "length" and len(want.tokens) == n
    assert want.tokens[:len(ended.tokens)] == ended.tokens
    assert set(want.tokens[len(ended.tokens):]) & reference.tokenizer.eos_token_ids
    body = _complete(live, prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True)
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == n
    assert body["choices"][0]["text"] == want.text
    stopped = _complete(live, prompt=prompt, max_tokens=n, temperature=0)
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["choices"][0]["text"] == ended.text


REFUSED = [("best_of", 3), ("echo", True), ("suffix", "!"),
           ("presence_penalty", 0.5), ("frequency_penalty", -0.5), ("repetition_penalty", 1.2),
           ("logit_bias", {"5": 10}), ("min_tokens", 4), ("use_beam_search", True)]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f for f, _ in REFUSED])
def test_fields_specrt_cannot_honour_are_a_400_naming_them(live, field, value):
    r = httpx.post(live.url + "/v1/completions", timeout=WAIT_S,
                   json={"model": live.model, "prompt": PROMPT, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["code"] == "unsupported_parameter"
    assert err["message"].startswith(f"{field}=") and "not supported by specrt yet" in err["message"]


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("best_of", 3)])
def test_chat_refusals_say_what_to_do_and_no_stale_reason(live, field, value):
    r = httpx.post(live.url + "/v1/chat/completions", timeout=WAIT_S,
                   json={"model": live.model, "messages": [{"role": "user", "content": "hi"}], field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not supported by specrt yet" in err["message"]
    assert "batch size 1" not in err["message"] and "penalties" not in err["message"]


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.0), ("presence_penalty", 0), ("n", 1),
                                         ("logprobs", False), ("min_tokens", 0)])
def test_neutral_values_of_those_fields_are_accepted(live, field, value):
    _complete(live, temperature=0, max_tokens=4, **{field: value})


@pytest.mark.parametrize("body,param", [({"top_k": 1.5}, "top_k"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
                                        ({"min_p": -0.1}, "min_p"), ({"stop_token_ids": [99999]}, "stop_token_ids"),
                                        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
                                        ({"ignore_eos": "yes"}, "ignore_eos")])
def test_bad_values_of_the_honoured_fields_are_a_400(live, body, param):
    r = httpx.post(live.url + "/v1/completions", timeout=WAIT_S,
                   json={"model": live.model, "prompt": PROMPT, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_structured_outputs_and_logprobs_run_on_a_folder_without_a_batched_model(live):
    """One engine for every folder (runtime/batch/engine.py): these engines have no batched model,
    and their one-row graphs constrain and report logprobs on it as a batched model would."""
    r = httpx.post(live.url + "/v1/chat/completions", timeout=WAIT_S,
                   json={"model": live.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                         "logprobs": True, "top_logprobs": 2, "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] in ("yes", "no"), choice
    content = choice["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content), content


def test_n_above_one_on_the_one_request_server_is_a_400_naming_max_num_seqs(live):
    r = httpx.post(live.url + "/v1/completions", timeout=WAIT_S,
                   json={"model": live.model, "prompt": PROMPT, "max_tokens": 4, "n": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "--max-num-seqs" in err["message"], err
