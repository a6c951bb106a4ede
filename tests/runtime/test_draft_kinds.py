"""Every draft kind with both attention variants, against Hugging Face `generate`.

Kinds (conftest.DRAFT_KINDS): a separate draft model with its own cache (here the target
itself, so greedy acceptance is exactly 1 and any draft-side slip shows), `truncate:2`
(own cache, drafts both accepted and rejected), `int8` (shares the target's cache), and
`none` (plain decoding only). Attention: `gqa` (the graph writes K/V into the cache in
place) and `portable` (the graph returns the new K/V and `KVCache.write` copies them:
the path a TensorRT engine takes). Greedy output must be transformers' token for token,
for 128 tokens and up to the maximum context.
"""
from __future__ import annotations

import pytest
from conftest import ATTENTIONS, DRAFT_KINDS, MATRIX_CONTEXT

from specrt.runtime import SpeculativeGenerator

SHORT = [40, 50, 60, 70, 80, 90, 100]
LONG_NEW = 128
NEAR_END = [(7 * i) % 100 + 5 for i in range(141)]    # 9 prefill chunks of 16, the last one partial
MATRIX = [pytest.param(kind, att, id=f"{kind}-{att}") for kind in DRAFT_KINDS for att in ATTENTIONS]


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """Greedy continuation of the fp32 target by transformers, memoised per (prompt, n)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    memo: dict[tuple, list[int]] = {}

    def continuation(prompt: list[int], n: int) -> list[int]:
        if (tuple(prompt), n) not in memo:
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            memo[tuple(prompt), n] = out[0, len(prompt):].tolist()
        return memo[tuple(prompt), n]

    return continuation


@pytest.fixture(scope="module")
def generators(tiny_matrix):
    made: dict[tuple[str, str], SpeculativeGenerator] = {}

    def get(kind: str, attention: str) -> SpeculativeGenerator:
        if (kind, attention) not in made:
            made[kind, attention] = SpeculativeGenerator(tiny_matrix(kind, attention))
        return made[kind, attention]

    return get


def _tokens(g, prompt, n, method):
    return [e.token for e in g.tokens(prompt, max_new_tokens=n, method=method)]


@pytest.mark.parametrize(("kind", "attention"), MATRIX)
def test_the_engines_are_the_kind_and_attention_asked_for(generators, kind, attention):
    g = generators(kind, attention)
    man = g.manifest
    in_place = attention == "gqa"
    assert all(r.in_place == in_place for r in g.target.graphs.values())
    if kind == "none":
        assert man.draft is None and g.methods == ("plain", "lookup")   # prompt lookup needs no draft
        return
    assert (g.draft.cache is g.target.cache) == (kind == "int8")
    assert all(r.in_place == in_place for r in g.draft.graphs.values())


@pytest.mark.parametrize(("kind", "attention"), MATRIX)
def test_greedy_output_is_hugging_faces_for_128_tokens(generators, reference, kind, attention):
    g = generators(kind, attention)
    want = reference(SHORT, LONG_NEW)
    metrics = {}
    for method in g.methods:
        assert _tokens(g, SHORT, LONG_NEW, method) == want, method
        m = metrics[method] = g.last_metrics
        assert m.tokens == LONG_NEW and m.finish_reason == "length"
    if kind == "none":
        return
    # speculation really ran: k draft tokens per pass, and the kind's acceptance
    m = metrics["speculative"]
    # (a pass drafts fewer only within k tokens of the budget, and each pass emits at least one)
    assert m.drafted_at[g.k - 1] >= m.iterations - g.k, m.as_dict()
    if kind == "model":       # the target as its own draft: every greedy draft token is the target's
        assert m.acceptance_per_position == [1.0] * g.k, m.as_dict()
    elif kind == "int8":      # a quantized copy of the target, reading the target's cache
        assert m.acceptance_rate > 0.75, m.as_dict()   # measured 0.90 (gqa), 0.85 (portable)
    else:                     # two of three layers: a weaker draft (measured 0.20), both accepted and rejected
        assert 0.05 < m.acceptance_rate < 0.95, m.as_dict()


@pytest.mark.parametrize(("kind", "attention"), MATRIX)
def test_greedy_output_up_to_the_maximum_context_is_hugging_faces(generators, reference, kind, attention):
    g = generators(kind, attention)
    assert g.shapes.max_context == MATRIX_CONTEXT
    room = MATRIX_CONTEXT - len(NEAR_END)
    want = reference(NEAR_END, room)
    for method in g.methods:
        got = _tokens(g, NEAR_END, 50, method)
        assert got == want, method
        assert g.last_metrics.finish_reason == "max_context"
        # the caches were rewound: a short generation afterwards is unaffected
        assert _tokens(g, SHORT, 12, method) == reference(SHORT, LONG_NEW)[:12], method
