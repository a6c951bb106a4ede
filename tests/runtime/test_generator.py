"""The speculative loop on tiny random models: greedy output is token-for-token the
target's, whatever the draft; the caches stay consistent when the caller stops early."""
from __future__ import annotations

import itertools

import pytest

from specrt.runtime import SamplingParams, SpeculativeGenerator

PROMPTS = [[5, 6, 7], [40, 50, 60, 70, 80, 90, 100], list(range(10, 40)), [1, 99]]


@pytest.fixture(scope="module")
def gen(tiny_engines):
    return SpeculativeGenerator(tiny_engines)


@pytest.fixture(scope="module")
def self_gen(tiny_self_engines):
    return SpeculativeGenerator(tiny_self_engines)


def _tokens(g, ids, n, method, **kw):
    return [e.token for e in g.tokens(ids, max_new_tokens=n, method=method, **kw)]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_plain_with_a_separate_draft(gen, prompt):
    plain = _tokens(gen, prompt, 40, "plain")
    spec = _tokens(gen, prompt, 40, "speculative")
    assert spec == plain
    m = gen.last_metrics
    assert m.tokens == 40 and m.iterations >= 40 / (gen.k + 1)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_plain_with_the_int8_shared_cache_draft(self_gen, prompt):
    assert _tokens(self_gen, prompt, 40, "speculative") == _tokens(self_gen, prompt, 40, "plain")


def test_greedy_output_matches_hugging_face_generate(gen, tiny_pair):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    for prompt in PROMPTS[:3]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert _tokens(gen, prompt, 24, "speculative") == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("k", [1, 2])
def test_a_smaller_k_than_built_gives_the_same_output(tiny_engines, gen, k):
    small = SpeculativeGenerator(tiny_engines, k=k)
    assert _tokens(small, PROMPTS[1], 30, "speculative") == _tokens(gen, PROMPTS[1], 30, "plain")
    assert all(d <= small.last_metrics.iterations for d in small.last_metrics.drafted_at)
    assert len(small.last_metrics.drafted_at) == k


def test_target_as_its_own_draft_accepts_every_greedy_token(tiny_matrix):
    g = SpeculativeGenerator(tiny_matrix("model", "gqa"))   # the target, exported again as a separate draft
    spec = _tokens(g, PROMPTS[1], 33, "speculative")
    m = g.last_metrics
    assert spec == _tokens(g, PROMPTS[1], 33, "plain")
    assert m.acceptance_rate == 1.0
    assert m.mean_acceptance_length == g.k + 1
    assert m.acceptance_per_position == [1.0] * g.k


def test_from_draft_marks_exactly_the_accepted_draft_tokens(self_gen):
    plain = list(self_gen.tokens(PROMPTS[1], max_new_tokens=30, method="plain"))
    assert [e.from_draft for e in plain] == [False] * 30
    spec = list(self_gen.tokens(PROMPTS[1], max_new_tokens=30, method="speculative"))
    m = self_gen.last_metrics
    assert all(type(e.from_draft) is bool for e in spec) and spec[0].from_draft is False
    assert sum(e.from_draft for e in spec) == m.accepted > 0
    # each pass emits its accepted draft tokens, then one token of the target's own
    assert sum(not e.from_draft for e in spec) == 1 + m.iterations


def test_metrics_are_consistent(gen):
    _tokens(gen, PROMPTS[0], 30, "speculative")
    m = gen.last_metrics
    assert 0.0 <= m.acceptance_rate <= 1.0
    assert m.tokens == 1 + m.accepted + m.iterations   # first token from the prompt, then 1 + accepted per iteration
    assert m.iterations - 1 <= m.drafted_at[0] <= m.iterations   # the last pass may draft nothing (budget)
    assert all(a <= d for a, d in zip(m.accepted_at, m.drafted_at))
    assert m.time_draft > 0 and m.time_verify > 0 and m.time_total >= m.time_prefill + m.time_draft
    d = m.as_dict()
    assert d["finish_reason"] == "length" and d["tokens"] == 30


@pytest.mark.parametrize("method", ["speculative", "plain"])
def test_stopping_early_leaves_the_cache_at_what_was_emitted(gen, method):
    prompt = PROMPTS[1]
    it = gen.tokens(prompt, max_new_tokens=40, method=method)
    got = [next(it).token for _ in range(7)]
    it.close()
    assert gen.one.engine.idle()              # the request left its row
    # and the next call is unaffected
    assert _tokens(gen, prompt, 12, method)[:7] == got


@pytest.mark.parametrize("method", ["speculative", "plain"])
def test_a_finished_generation_leaves_its_row(gen, method):
    toks = _tokens(gen, PROMPTS[1], 20, method)
    assert gen.one.engine.idle()
    if method == "plain":   # one decode step per token after the first, none after the last
        assert gen.last_metrics.iterations == len(toks) - 1


def test_each_phase_of_each_pass_is_timed_once(gen, monkeypatch):
    """A clock that advances one tick per reading: every timed phase of every pass then adds
    exactly one tick (no wall-clock thresholds)."""
    from specrt.runtime.batch import engine as engine_mod

    ticks = itertools.count()
    monkeypatch.setattr(engine_mod.time, "perf_counter", lambda: float(next(ticks)))
    _tokens(gen, PROMPTS[1], 20, "plain")
    m = gen.last_metrics
    assert m.time_verify == m.time_accept == m.iterations == 19 and m.time_draft == 0
    _tokens(gen, PROMPTS[1], 20, "speculative")
    m = gen.last_metrics
    assert m.time_verify == m.time_accept == m.iterations > 0
    assert m.time_draft == m.iterations - m.plain_steps - m.lookup_rounds - m.pair_rounds > 0


def test_sampling_with_a_seed_is_reproducible(gen):
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=123)
    a = _tokens(gen, PROMPTS[0], 30, "speculative", sampling=p)
    b = _tokens(gen, PROMPTS[0], 30, "speculative", sampling=p)
    c = _tokens(gen, PROMPTS[0], 30, "speculative", sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=7))
    assert a == b and a != c


def test_text_streaming_stops_at_a_stop_string_and_trims_it(gen):
    full = gen.generate("Hello", max_new_tokens=30, method="plain")
    text = full.text
    assert len(text) > 6
    stop = text[3:5]
    cut = gen.generate("Hello", max_new_tokens=30, stop=[stop], method="speculative")
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.find(stop)]
    assert stop not in cut.text


def test_chat_prompts_use_the_template(gen):
    ids = gen.encode_prompt("Hi", chat=True)
    text = gen.tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>user\nHi<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    c = gen.generate("Hi", chat=True, max_new_tokens=8)
    assert c.prompt_tokens == len(ids)


def test_eos_ends_the_stream(gen):
    eos = next(iter(gen.tokenizer.eos_token_ids))
    # find a continuation point where the tiny model emits EOS, or force it through a prompt ending in EOS context
    ids = PROMPTS[2]
    toks = _tokens(gen, ids, 60, "plain")
    if eos in toks:
        c = gen.generate(ids, max_new_tokens=60)
        assert c.finish_reason == "eos"
        assert len(c.tokens) == toks.index(eos)
    else:
        gen.tokenizer.eos_token_ids = frozenset({toks[5]})
        try:
            c = gen.generate(ids, max_new_tokens=60)
            assert c.finish_reason == "eos" and len(c.tokens) == toks.index(toks[5])
        finally:
            gen.tokenizer.eos_token_ids = frozenset({eos})


@pytest.mark.parametrize("family", ["gpt2", "qwen2", "mistral"])
def test_every_family_generates_losslessly_end_to_end(tmp_path, family):
    """Export, int8 draft, runtime: greedy speculative == plain == Hugging Face generate."""
    import torch
    from conftest import build_tiny
    from tiny_models import make_tiny_model_dir
    from transformers import AutoModelForCausalLM

    src = make_tiny_model_dir(tmp_path / "m", family, layers=2, seed=3)
    g = SpeculativeGenerator(build_tiny(tmp_path / "eng", src, "int8"))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    prompt = PROMPTS[1]
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert _tokens(g, prompt, 20, "speculative") == ref[0, len(prompt):].tolist()
    assert _tokens(g, prompt, 20, "plain") == ref[0, len(prompt):].tolist()


def test_a_speculative_only_generator_loads_no_one_token_target_graph(tiny_engines):
    g = SpeculativeGenerator(tiny_engines, methods=("speculative",))
    assert set(g.target.graphs) == {"prefill", "verify"}
    assert _tokens(g, PROMPTS[0], 10, "speculative") == _tokens(SpeculativeGenerator(tiny_engines), PROMPTS[0], 10,
                                                                 "plain")
    from specrt.errors import SamplingParamsError
    with pytest.raises(SamplingParamsError, match="was not loaded"):
        g.tokens(PROMPTS[0], method="plain")
    p = SpeculativeGenerator(tiny_engines, methods=("plain",))
    assert set(p.target.graphs) == {"prefill", "decode"} and p.draft is None


def test_shared_memory_mode_gives_the_same_tokens(tiny_self_engines, self_gen):
    shared = SpeculativeGenerator(tiny_self_engines, memory="shared")
    for method in ("plain", "speculative"):
        assert _tokens(shared, PROMPTS[1], 24, method) == _tokens(self_gen, PROMPTS[1], 24, method)


def test_eos_releases_text_held_back_for_a_possible_stop_string(gen):
    ids = PROMPTS[2]
    toks = _tokens(gen, ids, 20, "plain")
    eos = gen.tokenizer.eos_token_ids
    gen.tokenizer.eos_token_ids = frozenset({toks[6]})
    try:
        full = gen.generate(ids, max_new_tokens=20, method="plain")
        assert full.finish_reason == "eos" and full.text
        # a stop string that starts with the last character and never completes
        held = gen.generate(ids, max_new_tokens=20, method="plain", stop=[full.text[-1] + "\x01\x02"])
        assert held.finish_reason == "eos" and held.text == full.text
    finally:
        gen.tokenizer.eos_token_ids = eos


@pytest.mark.parametrize("method", ["plain", "speculative"])
def test_metrics_count_the_tokens_handed_out_in_both_methods(gen, method):
    ids = PROMPTS[2]
    toks = _tokens(gen, ids, 20, "plain")
    eos = gen.tokenizer.eos_token_ids
    gen.tokenizer.eos_token_ids = frozenset({toks[6]})
    try:
        c = gen.generate(ids, max_new_tokens=20, method=method)
        assert len(c.tokens) == toks.index(toks[6])
        assert c.metrics.tokens == len(c.tokens) + 1   # the EOS token was handed out too
    finally:
        gen.tokenizer.eos_token_ids = eos


def test_dynamic_int8_draft_is_lossless_too(tmp_path, tiny_pair):
    from conftest import build_tiny

    g = SpeculativeGenerator(build_tiny(tmp_path / "dyn", tiny_pair[0], "int8-dynamic"))
    assert g.manifest.draft.precision == "int8-dynamic" and g.draft.cache is g.target.cache
    assert _tokens(g, PROMPTS[1], 24, "speculative") == _tokens(g, PROMPTS[1], 24, "plain")
    assert g.manifest.draft.parity["agreement_with_target"]["top1_agreement"] > 0.5


def test_engines_without_a_draft_decode_plainly_and_refuse_to_speculate(tmp_path, tiny_pair):
    from conftest import build_tiny

    from specrt.errors import SamplingParamsError

    d = build_tiny(tmp_path / "none", tiny_pair[0], "none")
    g = SpeculativeGenerator(d)
    assert g.manifest.draft is None and g.methods == ("plain", "lookup")
    assert len(_tokens(g, PROMPTS[0], 8, "plain")) == 8
    # a call without a method runs what the folder has: plain decoding here, not a refusal
    assert g.default_method == "plain" and g.generate(PROMPTS[0], max_new_tokens=8).tokens == _tokens(g, PROMPTS[0], 8, "plain")
    assert g.last_metrics.method == "plain"
    with pytest.raises(SamplingParamsError, match="without a draft model"):
        SpeculativeGenerator(d, methods=("speculative",))
    with pytest.raises(SamplingParamsError, match="without a draft model"):
        g.generate(PROMPTS[0], max_new_tokens=8, method="speculative")
    from specrt.cli import main
    assert main(["generate", str(d), "hello", "--raw", "--max-new-tokens", "4"]) == 0     # no --plain needed


def test_a_call_without_a_method_speculates_when_a_draft_is_loaded(gen):
    assert gen.default_method == "speculative"
    gen.generate(PROMPTS[0], max_new_tokens=8)
    assert gen.last_metrics.method == "speculative"
