"""`BatchEngine.drive`: a request run from the caller's thread on an engine no thread steps
(the batch of one). Its tokens are the request's tokens alone, under every speculation
choice; closing the stream early cancels the request and frees its row; a model failure
reaches the caller."""
from __future__ import annotations

import pytest
from test_batch_engine import COSTS, EOS, PROMPTS, make_engine, reference

from specrt.runtime.batch.request import Delta, Done, Request
from specrt.runtime.sampling import SamplingParams


@pytest.mark.parametrize("speculate", ["none", "lookup", "draft"])
def test_a_driven_request_gets_its_tokens_alone(speculate):
    eng, lm = make_engine(1, costs=None if speculate == "none" else COSTS, draft=speculate == "draft",
                          lookup=speculate == "lookup")
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(temperature=0.9, seed=i) if i % 2 else SamplingParams()
        events = list(eng.drive(Request(list(prompt), 20, params, i)))
        assert isinstance(events[-1], Done) and all(isinstance(e, Delta) for e in events[:-1])
        toks = [t for e in events[:-1] for t in e.tokens]
        want, reason = reference(lm, prompt, 20, params, i, eos=EOS)
        assert (toks, events[-1].finish_reason) == (want, reason)
        assert eng.idle()
    if speculate != "none":
        assert sum(v for k, v in eng.stats.choices.items() if k != "plain") > 0


def test_closing_a_driven_stream_early_cancels_it_and_frees_the_row():
    eng, lm = make_engine(1)
    stream = eng.drive(Request(list(PROMPTS[1]), 40, SamplingParams(), 0))
    first = next(stream)
    assert isinstance(first, Delta) and eng.active == 1
    stream.close()
    assert eng.idle() and eng.stats.finished == 1
    # the freed row serves the next request exactly
    events = list(eng.drive(Request(list(PROMPTS[0]), 12, SamplingParams(), 0)))
    assert [t for e in events[:-1] for t in e.tokens] == reference(lm, PROMPTS[0], 12)[0]


def test_a_model_failure_reaches_the_driving_caller():
    eng, lm = make_engine(1, costs=None, draft=False)

    def broken(*a, **k):
        raise RuntimeError("the model broke")
    lm.step = broken
    with pytest.raises(RuntimeError, match="the model broke"):
        list(eng.drive(Request(list(PROMPTS[0]), 8, SamplingParams(), 0)))
