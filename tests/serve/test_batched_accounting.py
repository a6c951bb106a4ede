"""The batched server's token accounting: with `ignore_eos` and a fixed `max_tokens`, a request
makes exactly max_tokens tokens, and `usage.completion_tokens`, the Prometheus generation
counter and the pieces the engine streamed (its Delta events, recorded by an EngineProbe) all
say so, streamed or not, chat or completion. The batch speculates (the tiny rows build, its
step costs made equal so the policy speculates wherever it has a guess), so some pieces carry
several tokens: counting pieces instead of tokens, or losing one, is caught."""
from __future__ import annotations

import json

import httpx
import pytest

from specrt.runtime.batch.policy import BatchCosts
from specrt.runtime.batch.request import Delta, Done

from .serve_helpers import WAIT_S, LiveServer
from .test_batched_server import EngineProbe

MAX_TOKENS = 20
# prompts whose greedy answers have rounds that accept guesses (found by trying; the test checks it)
PROMPT = {"completion": "a b a b a b a b a b", "chat": "a"}


def _speculate_everywhere(gen) -> None:
    # which steps pay depends on the build's timings (noisy): equal costs make it deterministic
    gen.engine.policy.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)})


@pytest.fixture(scope="module")
def served(tiny_batch_rows_engines):
    probe = EngineProbe(tune=_speculate_everywhere)
    server = LiveServer(tiny_batch_rows_engines, factory=probe.factory, max_num_seqs=2, queue_size=4)
    yield server, probe
    server.close()


def _body(server, chat: bool, stream: bool) -> dict:
    body = {"model": server.model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    body |= {"messages": [{"role": "user", "content": PROMPT["chat"]}]} if chat else {"prompt": PROMPT["completion"]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


def _post(server, path: str, body: dict) -> tuple[str, dict, str]:
    """(text, usage, finish_reason) of the answer, read from its SSE chunks when streamed."""
    if not body.get("stream"):
        r = httpx.post(server.url + path, json=body, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if "message" in choice else choice["text"], r.json()["usage"], \
            choice["finish_reason"]
    text, usage, finish = [], None, None
    with httpx.stream("POST", server.url + path, json=body, timeout=WAIT_S) as r:
        assert r.status_code == 200
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    for chunk in map(json.loads, lines[:-1]):
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            text.append(c.get("delta", {}).get("content") or c.get("text") or "")
            finish = c.get("finish_reason") or finish
    return "".join(text), usage, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_usage_and_the_generation_counter_count_every_token_of_every_piece(served, chat, stream):
    server, probe = served
    path = "/v1/chat/completions" if chat else "/v1/completions"
    before = server.metrics()
    text, usage, finish = _post(server, path, _body(server, chat, stream))
    after = server.metrics()
    events = probe.events[-1]
    pieces = [e for e in events if isinstance(e, Delta)]
    done = events[-1]
    assert isinstance(done, Done) and done.finish_reason == "length" and finish == "length"
    assert any(len(p.tokens) > 1 for p in pieces), "no several-token piece: the check would not tell pieces from tokens"
    assert sum(len(p.tokens) for p in pieces) == done.completion_tokens == MAX_TOKENS
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["total_tokens"] == usage["prompt_tokens"] + MAX_TOKENS
    assert text == "".join(p.text for p in pieces)

    def grew(name: str) -> float:
        key = (name, frozenset())
        return after[key] - before.get(key, 0.0)
    assert grew("specrt_generation_tokens_total") == MAX_TOKENS
    assert grew("specrt_prompt_tokens_total") == usage["prompt_tokens"] == done.prompt_tokens
