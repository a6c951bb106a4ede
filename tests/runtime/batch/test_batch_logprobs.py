"""Log-probabilities of emitted tokens (runtime/logprobs.py) on the toy model (fake_batch.py):
each token's value is the target's raw log-probability at the position that chose it, with the
n most likely alternatives, under every proposer, in a batch, with stop strings holding text
back and with a grammar; and the values are the same with and without speculation."""
from __future__ import annotations

import numpy as np
import pytest
from fake_batch import FakeTokenizer
from test_batch_engine import EOS, Collect, make_engine
from test_batch_grammar import PROMPTS, SPECS
from test_batch_grammar import run as grammar_run

from specrt.errors import SamplingParamsError
from specrt.runtime.batch.request import Delta
from specrt.runtime.logprobs import check_logprobs, token_logprob
from specrt.runtime.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=0.9, top_k=6)


def raw_logprobs(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


class CollectLogprobs(Collect):
    def __init__(self):
        super().__init__()
        self.lps = []

    def __call__(self, ev):
        if isinstance(ev, Delta):
            assert ev.logprobs is not None and len(ev.logprobs) == len(ev.tokens)
            assert [lp.token for lp in ev.logprobs] == list(ev.tokens)
            self.lps += ev.logprobs
        super().__call__(ev)


def run(eng, requests):
    """(prompt, n, params, seed, spec, top logprobs, Request keywords) requests, as the grammar tests run them."""
    return grammar_run(eng, [(p, n, params, seed, spec, {"logprobs": top} | kw)
                             for p, n, params, seed, spec, top, kw in requests], CollectLogprobs)


@pytest.mark.parametrize("proposer", ["plain", "lookup", "draft", "own-draft"])
def test_each_tokens_logprob_is_the_targets_raw_logprob_at_its_position(proposer):
    """Ten requests on three rows, greedy and sampled, some with a grammar (raw: the values are the
    model's own, before the mask), top 0..5: every reported value equals log_softmax of the
    target's logits after the token's prefix, and the alternatives are the most likely tokens
    there, in order. A value read from the next position of the window, or from the round's
    first position for every token, fails; so does one skipped or repeated where a round
    emits several tokens."""
    kw = {"plain": dict(draft=False, lookup=False), "lookup": dict(draft=False, lookup=True),
          "draft": dict(draft=True, lookup=False), "own-draft": dict(draft=True, lookup=False, own_draft=True)}
    eng, target = make_engine(rows=3, **kw[proposer])
    requests = [(p, 12 + i, SAMPLED if i % 2 else SamplingParams(), 40 + i, SPECS[i % len(SPECS)] if i % 3 else None,
                 i % 6, {}) for i, p in enumerate(PROMPTS)]
    outs = run(eng, requests)
    checked = 0
    for (prompt, n, params, seed, spec, top, _), c in zip(requests, outs):
        seq = list(prompt)
        assert len(c.lps) == len(c.tokens)
        for lp in c.lps:
            want = raw_logprobs(target.logits(seq))
            assert lp.logprob == pytest.approx(want[lp.token], abs=1e-9)
            order = np.argsort(-want, kind="stable")[:top]
            assert [t for t, _ in lp.top] == order.tolist()
            assert [v for _, v in lp.top] == pytest.approx(want[order].tolist(), abs=1e-9)
            if params.greedy and spec is None:
                assert lp.top[:1] == () or lp.top[0][0] == lp.token      # greedy: the most likely token
            seq.append(lp.token)
            checked += 1
    assert checked > 50
    if proposer != "plain":
        assert sum(c.done.metrics.accepted for c in outs) > 0      # rounds emitted several tokens


def test_logprobs_are_the_same_with_and_without_speculation_and_in_a_batch():
    """The same requests alone on plain steps, and three at a time with a draft and lookup: the
    same tokens and the same values (the toy model's logits at a position do not depend on the
    window, as the real graphs' do not by the build's invariance gates)."""
    requests = [(p, 14, SAMPLED if i % 2 else SamplingParams(), 7 + i, None, 3, {}) for i, p in enumerate(PROMPTS)]
    eng, _ = make_engine(rows=1, draft=False, lookup=False)
    alone = run(eng, requests)
    eng, _ = make_engine(rows=3, draft=True, lookup=True)
    batched = run(eng, requests)
    assert [(c.tokens, c.lps) for c in alone] == [(c.tokens, c.lps) for c in batched]


def test_text_held_back_for_a_stop_string_keeps_tokens_and_logprobs_aligned():
    """With a tokenizer, tokens reach the caller in the chunks TextTail makes; every Delta's
    logprobs are its own tokens' (CollectLogprobs checks each), up to the stop string."""
    eng, target = make_engine(rows=2, tokenizer=FakeTokenizer(EOS), draft=True)
    requests = [(p, 20, SamplingParams(), 0, None, 1, {"stop": ("ab", "c")}) for p in PROMPTS[:6]]
    outs = run(eng, requests)
    assert any(c.done.finish_reason == "stop" for c in outs)
    for c in outs:
        assert [lp.token for lp in c.lps] == c.tokens


def test_logprobs_settings_are_checked():
    assert check_logprobs(None) is None and check_logprobs(0) == 0 and check_logprobs(20) == 20
    for bad in (-1, 21, True, 1.5, "3"):
        with pytest.raises(SamplingParamsError, match="logprobs"):
            check_logprobs(bad)
    lp, top = token_logprob(np.array([0.0, 1.0, 1.0, -np.inf], np.float32), 0, 4)
    assert lp == pytest.approx(-np.log(1 + 2 * np.e))
    assert [t for t, _ in top] == [1, 2, 0, 3] and top[-1][1] == -np.inf       # ties: the lower id first
