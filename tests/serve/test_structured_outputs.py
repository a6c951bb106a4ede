"""Structured outputs through the server (runtime/grammar.py), with the official `openai`
client: `response_format` (json_object, json_schema), vLLM's guided_* / structured_outputs and
llama.cpp's grammar fields, streaming and not, on the tiny target with a draft model speculating
inside the batch (`--draft truncate:2 --batch --batch-attention rows`). The answers match their
schema or expression, and equal the same engine folder's answers with speculation off
(`open_batch(speculate=False)`) and through `SpeculativeGenerator` (the batch of one)."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from specrt.runtime import SpeculativeGenerator
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.grammar import GrammarError
from specrt.runtime.sampling import SamplingParams

from .serve_helpers import WAIT_S, LiveServer

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
REGEX = r"(yes|no), [0-9]{1,3}\."
MESSAGES = [[{"role": "user", "content": "Answer as JSON."}], [{"role": "user", "content": "Is it blue?"}],
            [{"role": "user", "content": "hello there"}]]
NEW = 40


@pytest.fixture(scope="module")
def live(tiny_batch_rows_model_engines):
    server = LiveServer(tiny_batch_rows_model_engines, max_num_seqs=3, queue_size=8)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def plain(tiny_batch_rows_model_engines):
    """The same folder's batched engine without speculation: what the answers must equal."""
    with open_batch(tiny_batch_rows_model_engines, max_num_seqs=1, speculate=False) as g:
        yield g


def _valid(obj) -> bool:
    return set(obj) == {"ok", "n", "tag"} and isinstance(obj["ok"], bool) and isinstance(obj["n"], int) \
        and 0 <= obj["n"] <= 99 and obj["tag"] in ("red", "green", "blue")


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_validates_and_equals_the_answer_without_speculation(client, live, plain, stream,
                                                                                   tiny_batch_rows_model_engines):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for messages in MESSAGES:
        kw = dict(model=live.model, messages=messages, max_tokens=NEW, temperature=0, response_format=fmt)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        else:
            r = client.chat.completions.create(**kw)
            text = r.choices[0].message.content
            assert r.choices[0].finish_reason == "stop", r
        assert _valid(json.loads(text)), text
        want = plain.generate(messages[0]["content"], chat=True, max_new_tokens=NEW,
                              structured={"json_schema": SCHEMA})
        assert text == want.text
    m = live.metrics()
    assert sum(v for (name, _), v in m.items() if name == "specrt_spec_decode_draft_tokens_total") > 0     # it speculated


def test_a_seeded_sampled_json_answer_is_the_same_with_and_without_speculation(client, live, plain):
    for seed in range(3):
        r = client.chat.completions.create(model=live.model, messages=MESSAGES[0], max_tokens=NEW, temperature=0.9,
                                           seed=seed, response_format={"type": "json_object"})
        text = r.choices[0].message.content
        assert isinstance(json.loads(text), dict)
        want = plain.generate(MESSAGES[0][0]["content"], chat=True, max_new_tokens=NEW,
                              sampling=SamplingParams(temperature=0.9, seed=seed), structured={"json_object": True})
        assert (text, r.choices[0].finish_reason) == (want.text, {"eos": "stop"}.get(want.finish_reason, "length"))


@pytest.mark.parametrize("field,value,check", [
    ("guided_regex", REGEX, lambda t: re.fullmatch(REGEX, t)),
    ("guided_choice", ["alpha", "beta", "gamma delta"], lambda t: t in ("alpha", "beta", "gamma delta")),
    ("structured_outputs", {"regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
    ("grammar", 'root ::= "x" [0-9]+ "!"', lambda t: re.fullmatch(r"x[0-9]+!", t)),     # llama.cpp's GBNF
    ("guided_json", SCHEMA, lambda t: _valid(json.loads(t)))])
def test_regex_choice_and_grammar_fields_constrain_completions(client, live, field, value, check):
    for stream in (False, True):
        kw = dict(model=live.model, prompt="The answer:", max_tokens=NEW, temperature=0, extra_body={field: value})
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        else:
            text = client.completions.create(**kw).choices[0].text
        assert check(text), (field, text)


@pytest.mark.parametrize("body,param,words", [
    ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema is missing"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "send one"),
    ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
    ({"grammar": "root ::= ("}, "grammar", "grammar"),
    ({"guided_json": False}, "guided_json", "matches nothing"),
    ({"guided_json": {"type": "text"}}, "guided_json", "cannot be used"),
    ({"guided_regex": "\ud800x"}, "guided_regex", "surrogate"),
    ({"guided_json": {"type": "string", "pattern": "\ud800"}}, "guided_json", "surrogate"),
    ({"guided_choice": ["a", "\udc00"]}, "guided_choice", "surrogate")])
def test_a_bad_structured_output_request_is_a_400_naming_the_problem(live, body, param, words):
    # (sent as raw JSON text: its \ud800 escapes are lone surrogates once parsed)
    r = httpx.post(live.url + "/v1/completions", timeout=WAIT_S, headers={"Content-Type": "application/json"},
                   content=json.dumps({"model": live.model, "prompt": "hi", "max_tokens": 4} | body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_the_batch_of_one_gives_the_same_constrained_answer(tiny_batch_rows_model_engines, plain):
    gen = SpeculativeGenerator(tiny_batch_rows_model_engines)
    for messages in MESSAGES:
        got = gen.generate(messages[0]["content"], chat=True, max_new_tokens=NEW, structured={"json_schema": SCHEMA})
        want = plain.generate(messages[0]["content"], chat=True, max_new_tokens=NEW,
                              structured={"json_schema": SCHEMA})
        assert (got.tokens, got.finish_reason) == (want.tokens, want.finish_reason)
    with pytest.raises(GrammarError, match="ignore_eos"):
        gen.generate("hi", structured={"regex": "a+"}, ignore_eos=True)


def test_the_one_row_graphs_constrain_on_the_same_engine(tiny_batch_rows_model_engines):
    """engine="one-row" (and a folder without a batched model) runs its one-row graphs on the one
    engine (runtime/batch/one_row.py), grammar and all."""
    import re
    gen = SpeculativeGenerator(tiny_batch_rows_model_engines, engine="one-row")
    for method in ("plain", "speculative"):
        text = gen.generate("hi", max_new_tokens=12, structured={"regex": "(ab|c)+x"}, method=method).text
        assert re.fullmatch("(ab|c)+x?", text), text


def test_a_grammar_that_cannot_end_within_max_tokens_ends_with_length(client, live):
    for stream in (False, True):
        kw = dict(model=live.model, prompt="hi", max_tokens=6, temperature=0, extra_body={"guided_regex": "(ab){50}"})
        if stream:
            finish = [c.choices[0].finish_reason for c in client.completions.create(stream=True, **kw)
                      if c.choices and c.choices[0].finish_reason]
            assert finish == ["length"]
        else:
            r = client.completions.create(**kw)
            assert r.choices[0].finish_reason == "length" and r.choices[0].text == "ab" * 3


def test_a_true_schema_is_any_json_value(client, live):
    text = client.completions.create(model=live.model, prompt="hi", max_tokens=NEW, temperature=0,
                                     extra_body={"guided_json": True}).choices[0].text
    json.loads(text)


def test_an_inline_schema_too_long_to_be_a_path_is_read_as_a_schema():
    import argparse

    from specrt.commands import _structured
    schema = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40)}})
    assert len(schema) > 300 and "/" not in schema
    a = argparse.Namespace(json_schema=schema, regex=None, choice=None, grammar=None)
    assert _structured(a) == {"json_schema": schema}
