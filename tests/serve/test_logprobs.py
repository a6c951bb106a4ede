"""logprobs / top_logprobs on real graphs: the tiny target with a draft model speculating inside
the batch (`--draft truncate:2 --batch --batch-attention rows`). The values are the same with
speculation on and off, alone and three to a batch, through `SpeculativeGenerator` (the batch
of one) and through the server in both OpenAI formats, streamed and not (the official client)."""
from __future__ import annotations

import httpx
import openai
import pytest

from runtime.batch.fake_batch import hold_until_added

from specrt.runtime import SpeculativeGenerator
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.policy import BatchCosts
from specrt.runtime.sampling import SamplingParams

from .serve_helpers import WAIT_S, LiveServer

PROMPTS = ["hello there", "the quick brown fox", "one two three one two three", "to be or not to be"]
NEW, TOP = 24, 3
# every target pass costs the same and a draft step almost nothing: the batch drafts wherever a row
# has room, not where the build's timings (on a machine that may have been busy) favoured it
DRAFT_PAYS = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)}, draft={1: 0.01, 8: 0.01})


@pytest.fixture(scope="module")
def alone(tiny_batch_rows_model_engines):
    """Each prompt alone with speculation off: the reference."""
    with open_batch(tiny_batch_rows_model_engines, max_num_seqs=1, speculate=False) as g:
        return {(p, s): g.generate(p, max_new_tokens=NEW, logprobs=TOP, sampling=SamplingParams(temperature=s, seed=5))
                for p in PROMPTS for s in (0.0, 0.8)}


def _values(c):
    return [(lp.token, lp.logprob, lp.top) for lp in c.logprobs]


def test_logprobs_are_identical_with_speculation_in_a_batch_and_as_a_batch_of_one(tiny_batch_rows_model_engines,
                                                                                   alone, monkeypatch):
    with open_batch(tiny_batch_rows_model_engines, max_num_seqs=3) as g:
        g.engine.policy.costs = DRAFT_PAYS
        for temp in (0.0, 0.8):
            hold_until_added(g.engine, len(PROMPTS), monkeypatch)    # all wait before the first step
            outs = g.generate_batch(PROMPTS, max_new_tokens=NEW, logprobs=TOP,
                                    sampling=SamplingParams(temperature=temp, seed=5))
            for p, c in zip(PROMPTS, outs):
                assert c.tokens == alone[(p, temp)].tokens and len(c.logprobs) == len(c.tokens)
                assert _values(c) == _values(alone[(p, temp)]), p      # bit for bit
        assert sum(v for k, v in g.engine.stats.choices.items() if k != "plain") > 0     # it speculated
    gen = SpeculativeGenerator(tiny_batch_rows_model_engines)
    for p in PROMPTS:
        c = gen.generate(p, max_new_tokens=NEW, logprobs=TOP)
        assert _values(c) == _values(alone[(p, 0.0)])


@pytest.fixture(scope="module")
def live(tiny_batch_rows_model_engines):
    server = LiveServer(tiny_batch_rows_model_engines, max_num_seqs=3, queue_size=8)
    yield server
    server.close()


def test_the_server_reports_the_same_logprobs_in_both_formats_streamed_and_not(live, alone):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for p in PROMPTS:
        want = alone[(p, 0.0)]
        values = [lp.logprob for lp in want.logprobs]
        r = client.completions.create(model=live.model, prompt=p, max_tokens=NEW, temperature=0, logprobs=TOP)
        lp = r.choices[0].logprobs
        assert lp.token_logprobs == values and len(lp.top_logprobs) == len(values)
        assert all(len(t) <= TOP for t in lp.top_logprobs) and lp.text_offset[0] == 0
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        streamed = [c.choices[0].logprobs for c in client.completions.create(
            model=live.model, prompt=p, max_tokens=NEW, temperature=0, logprobs=TOP, stream=True)
            if c.choices and c.choices[0].logprobs]
        assert [v for s in streamed for v in s.token_logprobs] == values
        assert [o for s in streamed for o in s.text_offset] == lp.text_offset
        r = client.chat.completions.create(model=live.model, messages=[{"role": "user", "content": p}],
                                           max_tokens=NEW, temperature=0, logprobs=True, top_logprobs=TOP)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == TOP for c in content)
        assert all(c.top_logprobs[0].logprob >= c.logprob for c in content)
        streamed = [e for c in client.chat.completions.create(
            model=live.model, messages=[{"role": "user", "content": p}], max_tokens=NEW, temperature=0,
            logprobs=True, top_logprobs=TOP, stream=True) if c.choices and c.choices[0].logprobs
            for e in c.choices[0].logprobs.content]
        assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"), ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "top_logprobs": 2}, "top_logprobs")])
def test_bad_logprobs_fields_are_a_400_naming_them(live, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(live.url + path, timeout=WAIT_S, json={"model": live.model, "max_tokens": 2} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_one_row_graphs_report_logprobs_on_the_same_engine(tiny_batch_rows_model_engines):
    """engine="one-row" runs the one-row graphs on the one engine: each token's raw log-probability
    with its 2 most likely alternatives, the same with and without speculation."""
    gen = SpeculativeGenerator(tiny_batch_rows_model_engines, engine="one-row")
    got = {m: gen.generate("hi", max_new_tokens=10, logprobs=2, method=m) for m in ("plain", "speculative")}
    plain, spec = got["plain"], got["speculative"]
    assert spec.tokens == plain.tokens and len(plain.logprobs) == len(plain.tokens)
    for a, b, t in zip(plain.logprobs, spec.logprobs, plain.tokens):
        assert a.token == t and len(a.top) == 2 and a.logprob <= 0 and a.top[0][1] >= a.logprob
        assert abs(a.logprob - b.logprob) < 1e-4


def test_a_tokens_bytes_are_the_bytes_it_stands_for():
    """A character split over several byte-level tokens (a byte-level BPE of the 256 bytes, as
    GPT-2's and SmolLM2's): each token's `bytes` is its own piece, and the pieces join into the
    character (each token's decoded text alone is U+FFFD)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from specrt.runtime.batch.request import TokenLogprob
    from specrt.runtime.grammar import Grammars
    from specrt.serve.protocol import LogprobFormat
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    raw = Tokenizer(models.BPE(vocab=vocab | {"</s>": len(vocab)}, merges=[]))
    raw.pre_tokenizer, raw.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    raw.add_special_tokens([AddedToken("</s>", special=True)])
    text = raw.to_str()
    tok, grammars = Tokenizer.from_str(text), Grammars(text, [len(vocab)], len(vocab) + 1)
    ids = tok.encode("é😀", add_special_tokens=False).ids
    assert len(ids) == 6 and tok.decode([ids[0]]) == "\ufffd"
    body = LogprobFormat(lambda t: tok.decode([t]), True, grammars.token_bytes)([TokenLogprob(i, -1.0) for i in ids])
    assert bytes(b for e in body["content"] for b in e["bytes"]) == "é😀".encode()
