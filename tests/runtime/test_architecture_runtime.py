"""Each declared architecture built and run end to end, on tiny random models made from
transformers configs (tests/tiny_models.py ARCHITECTURE_CASES; no download).

Per case and attention variant ("gqa": ONNX Runtime's GroupQueryAttention, in place;
"portable": standard ops, K/V returned), `specrt build --draft PATH` with a separate draft
of another depth (the target's first layer saved as its own model, same tokenizer):
- the build's own parity check (recorded in the manifest) holds for target and draft;
- 64 greedy tokens of plain decoding are transformers' own greedy tokens;
- greedy speculative output is plain decoding's, with drafts both accepted and rejected.
And per new family, the default build (`--draft int8`, the target's INT8 copy reading its
cache): speculative == plain.

Each build takes ~10-20 s on 2 idle cores (export, parity, identity and agreement checks).
"""
from __future__ import annotations

import json

import pytest
from conftest import _once, build_tiny
from tiny_models import ARCHITECTURE_CASES, make_tiny_model_dir, make_truncated_draft

from specrt.runtime import SpeculativeGenerator

# the runtime cases: every new family, and Llama 3.x rope scaling on the llama family
RUN_CASES = ("qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "smollm3", "llama3_rope")
NEW_FAMILIES = ("qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "smollm3")
PROMPTS = ([40, 50, 60, 70, 80, 90, 100], list(range(10, 30)))   # the second spans two prefill chunks
NEW_TOKENS = 64
MAX_CONTEXT = 96


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """case -> (target dir: 3 layers, draft dir: the target's first layer), made once."""
    made = {}

    def get(case: str):
        if case not in made:
            family, extra = ARCHITECTURE_CASES[case]

            def make(d):
                target = make_tiny_model_dir(d / "target", family, layers=3, extra=extra)
                make_truncated_draft(target, d / "draft", layers=1)
                return d
            root = _once(tmp_path_factory, f"arch-{case}", make)
            made[case] = (root / "target", root / "draft")
        return made[case]

    return get


@pytest.fixture(scope="module")
def engines(tmp_path_factory, models):
    """(case, attention, draft kind "path" | "int8") -> built engines, built on first use."""
    built = {}

    def get(case: str, attention: str, draft: str = "path"):
        key = (case, attention, draft)
        if key not in built:
            target, draft_dir = models(case)
            how = str(draft_dir) if draft == "path" else draft
            built[key] = _once(tmp_path_factory, f"arch-eng-{case}-{attention}-{draft}",
                               lambda d: build_tiny(d / "eng", target, how, attention=attention,
                                                    max_context=MAX_CONTEXT))
        return built[key]

    return get


@pytest.fixture(scope="module")
def reference(models):
    """Greedy tokens by transformers itself: argmax of the model's full forward, one token at a
    time (no generation config: no EOS suppression or stopping)."""
    import torch
    from transformers import AutoModelForCausalLM
    memo = {}

    def greedy(case: str, prompt: list[int], n: int) -> list[int]:
        if (case, tuple(prompt)) not in memo:
            model = AutoModelForCausalLM.from_pretrained(models(case)[0], dtype=torch.float32).eval()
            ids = list(prompt)
            with torch.no_grad():
                for _ in range(n):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            memo[case, tuple(prompt)] = ids[len(prompt):]
        return memo[case, tuple(prompt)]

    return greedy


def _tokens(g, prompt, method, n=NEW_TOKENS):
    return [e.token for e in g.tokens(prompt, max_new_tokens=n, method=method)]


def _assert_parity(part: dict):
    """The build's own torch-vs-ONNX check, as the manifest records it."""
    report = part["parity"]
    for name in ("prefill", "decode"):
        graph = report["graphs"][name]
        assert graph["max_abs_logit_delta"] < report["tolerance"], (name, graph)
        assert graph["argmax_agreement"] == 1.0, (name, graph)


@pytest.mark.parametrize("attention", ["gqa", "portable"])
@pytest.mark.parametrize("case", RUN_CASES)
def test_greedy_tokens_are_transformers_and_speculative_equals_plain_with_a_separate_draft(
        engines, reference, case, attention):
    path = engines(case, attention)
    man = json.loads((path / "manifest.json").read_text())
    target, draft = man["models"]["target"], man["models"]["draft"]
    family = ARCHITECTURE_CASES[case][0]
    assert target["source"]["model_type"] == draft["source"]["model_type"] == family
    assert (target["dims"]["layers"], draft["dims"]["layers"]) == (3, 1)    # a draft of another depth
    assert draft["kv"]["shares_cache_with"] is None                         # with its own cache
    _assert_parity(target)
    _assert_parity(draft)
    assert target["parity"]["graphs"]["verify"]["argmax_agreement"] == 1.0
    assert target["parity"]["identity"]["argmax_flips"] == 0

    g = SpeculativeGenerator(path)
    accepted = rejected = 0
    for prompt in PROMPTS:
        want = reference(case, prompt, NEW_TOKENS)
        assert len(set(want)) >= 4, want                   # a non-degenerate reference
        plain = _tokens(g, prompt, "plain")
        assert plain == want, (prompt, plain, want)
        assert _tokens(g, prompt, "speculative") == plain, prompt
        m = g.last_metrics
        accepted += m.accepted
        rejected += m.drafted - m.accepted
    assert accepted > 0 and rejected > 0, (accepted, rejected)   # the accept and the rewind paths both ran


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_the_default_int8_self_draft_gives_plain_decodings_tokens(engines, family):
    g = SpeculativeGenerator(engines(family, "gqa", "int8"))
    assert g.draft.cache is g.target.cache                   # the INT8 copy reads the target's cache
    accepted = 0
    for prompt in PROMPTS:
        plain = _tokens(g, prompt, "plain")
        assert _tokens(g, prompt, "speculative") == plain, prompt
        accepted += g.last_metrics.accepted
    assert accepted > 0
