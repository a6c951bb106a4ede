"""Speculation inside a batch on real graphs: the tiny fp32 target built with `--attention
standard --batch`, whose build shows that a position's logits do not depend on the window
they are computed in (two-token steps vs 3- and 4-token windows, all rows in one call) and
measures every (T, rows) step. The engine then picks plain, pair or lookup rounds per step
by cost, and every request still gets exactly the tokens it gets alone without speculation.
"""
from __future__ import annotations

import json

import pytest

from specrt.runtime.batch.generator import open_batch
from specrt.runtime.rounds import RoundKind
from specrt.runtime.sampling import SamplingParams

PROMPTS = ["a b a b a b a b a b", "the cat the cat the cat", "hello there", "x y z x y z x y z",
           "one two three one two three", "to be or not to be", "abcabcabcabc"]
NEW = 24


@pytest.fixture(scope="module")
def plain_alone(tiny_batch_standard_engines):
    with open_batch(tiny_batch_standard_engines, max_num_seqs=1, speculate=False) as g:
        assert g.engine.min_tokens == 2
        return [g.generate(p, max_new_tokens=NEW).tokens for p in PROMPTS]


def test_the_build_records_window_invariance_and_the_step_costs(tiny_batch_standard_engines, tiny_batch_engines):
    man = json.loads((tiny_batch_standard_engines / "manifest.json").read_text())
    win = man["models"]["batch"]["parity"]["window_invariance"]
    assert win["equal"] is True and win["max_abs_logit_delta"] == 0.0 and win["min_tokens"] == 2
    costs = man["build"]["speculation"]["batch_costs_ms"]["target"]
    assert set(costs) == {"1", "2", "4"} and all(set(v) == {"1", "2", "4", "8"} for v in costs.values())
    assert all(ms > 0 for v in costs.values() for ms in v.values())
    gqa = json.loads((tiny_batch_engines / "manifest.json").read_text())["models"]["batch"]["parity"]
    assert gqa["window_invariance"]["equal"] is False and "GroupQueryAttention" in gqa["window_invariance"]["reason"]
    with open_batch(tiny_batch_engines, max_num_seqs=2) as g:        # gqa: plain one-token steps
        assert g.engine.policy.costs is None and g.engine.min_tokens == 1


def test_a_speculating_batch_gives_every_request_its_tokens_alone(tiny_batch_standard_engines, plain_alone):
    with open_batch(tiny_batch_standard_engines, max_num_seqs=3) as g:
        assert g.engine.policy.costs is not None
        got = [c.tokens for c in g.generate_batch(PROMPTS, max_new_tokens=NEW)]
        st = g.engine.stats
        assert got == plain_alone
        spec = st.choices[RoundKind.LOOKUP.value] + st.choices[RoundKind.PAIR.value]
        assert spec > 0, st.choices                          # the policy did speculate
        assert st.tokens > st.row_steps + len(PROMPTS)       # and some steps emitted several tokens a row
        assert st.row_steps / st.steps > 2.0                 # rows shared the steps


def test_a_seeded_sample_is_the_same_alone_and_in_a_speculating_batch(tiny_batch_standard_engines):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    with open_batch(tiny_batch_standard_engines, max_num_seqs=4) as g:
        alone = g.generate(PROMPTS[0], max_new_tokens=NEW, sampling=sp).tokens
        hs = [g.submit(p, max_new_tokens=NEW, sampling=SamplingParams(temperature=1.0, seed=i))
              for i, p in enumerate(PROMPTS[1:4])]
        mid = g.submit(PROMPTS[0], max_new_tokens=NEW, sampling=sp)
        assert mid.result().tokens == alone
        for h in hs:
            h.result()
        assert g.engine.stats.choices[RoundKind.PLAIN.value] < g.engine.stats.steps
