"""OpenAI's `n` on the batched server (`--max-num-seqs`), with the official client: n choices
from one prompt pass (BatchGenerator.submit_n), choice i exactly the single request with seed + i
(and the same logprobs), streamed and not; greedy choices all the same answer, as vLLM gives
them; n past max-num-seqs a 400."""
from __future__ import annotations

import httpx
import openai
import pytest

from specrt.runtime.batch.generator import open_batch
from specrt.runtime.sampling import SamplingParams

from .serve_helpers import WAIT_S, LiveServer

NEW = 16


@pytest.fixture(scope="module")
def live(tiny_batch_rows_model_engines):
    server = LiveServer(tiny_batch_rows_model_engines, max_num_seqs=3, queue_size=8)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def single(tiny_batch_rows_model_engines):
    with open_batch(tiny_batch_rows_model_engines, max_num_seqs=1) as g:
        yield lambda prompt, seed, **kw: g.generate(prompt, max_new_tokens=NEW, logprobs=1,
                                                    sampling=SamplingParams(temperature=0.9, seed=seed), **kw)


def test_n_choices_are_the_single_requests_with_seeds_seed_plus_i(client, live, single):
    r = client.completions.create(model=live.model, prompt="hello there", max_tokens=NEW, temperature=0.9, seed=11,
                                  n=3, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for i, c in enumerate(r.choices):
        want = single("hello there", 11 + i)
        assert c.text == want.text and c.logprobs.token_logprobs == [lp.logprob for lp in want.logprobs]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert len({c.text for c in r.choices}) > 1


def test_streamed_chat_choices_arrive_by_index(client, live, single):
    texts = {}
    finished = []
    for chunk in client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=NEW, temperature=0.9, seed=3, n=2, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finished.append(c.index)
        if chunk.usage is not None:
            usage = chunk.usage
    assert sorted(finished) == [0, 1] and usage.completion_tokens > 0
    for i in (0, 1):
        assert texts[i] == single("hi", 3 + i, chat=True).text


def test_greedy_choices_are_all_the_same_answer(client, live):
    r = client.completions.create(model=live.model, prompt="the quick brown fox", max_tokens=NEW, temperature=0, n=3)
    assert len({c.text for c in r.choices}) == 1 and len(r.choices) == 3


def test_n_past_max_num_seqs_is_a_400(live):
    r = httpx.post(live.url + "/v1/completions", timeout=WAIT_S,
                   json={"model": live.model, "prompt": "hi", "max_tokens": 2, "n": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "--max-num-seqs" in err["message"], err
