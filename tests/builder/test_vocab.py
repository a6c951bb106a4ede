"""The vocabulary-trimmed draft LM head (builder/gates/vocab.py, `--draft-vocab N`): the
draft scores only the kept ids, and speculation stays lossless: greedy output equals plain
decoding, and sampled tokens follow the target's distribution, tokens the draft cannot
propose included (they come from the target's residual)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
import numpy as np
import onnx
import pytest
from conftest import _once, build_tiny
from runtime.test_sampling_exact import N, PROMPT, exact_of, fit_of, sample_prefixes, tree_of
from tiny_models import BOS_ID, EOS_ID, IM_START_ID

from specrt.builder.gates import vocab
from specrt.builder.config import BuildConfig
from specrt.errors import ConfigError
from specrt.driver import GraphSet
from specrt.manifest import Shapes
from specrt.runtime import SamplingParams, SpeculativeGenerator
from specrt.runtime.sampling import probs_from_logits

KEEP = 24              # of the tiny models' 128 tokens: the special ids and the most frequent characters
SPECIAL = (BOS_ID, IM_START_ID, EOS_ID)   # the tokenizer's special ids (</s> is not one of them)
PROMPTS = [PROMPT, [10, 20, 30], [7, 8, 9, 10, 11], [60, 61, 62, 63]]


@pytest.fixture(scope="module")
def trimmed(tmp_path_factory, tiny_pair):
    return _once(tmp_path_factory, f"vocab-{KEEP}",
                 lambda d: build_tiny(d / "eng", tiny_pair[0], "int8", draft_vocab=KEEP))


@pytest.fixture(scope="module")
def manifest(trimmed) -> dict:
    return json.loads((trimmed / "manifest.json").read_text())


@pytest.fixture(scope="module")
def kept(trimmed, manifest) -> np.ndarray:
    graph = onnx.load(str(trimmed / manifest["models"]["draft"]["graphs"]["decode"]["file"]))
    ids = vocab.kept_ids(graph)
    assert ids is not None
    return ids


def draft_logits(engines, tokens) -> np.ndarray:
    """[n, V]: the draft's decode graph fed `tokens` one by one on its own cache."""
    man = json.loads((engines / "manifest.json").read_text())
    d = man["models"]["draft"]
    entry = {**d["graphs"]["decode"], "file": Path(d["graphs"]["decode"]["file"]).name}
    gs = GraphSet(engines / "draft", {"decode": entry}, d["dims"], Shapes(**man["shapes"]).kv_capacity)
    return np.stack([gs.step("decode", [t], i)[0] for i, t in enumerate(tokens)])


def test_kept_ids_are_specials_then_most_frequent_then_lowest():
    counts = np.zeros(12, np.int64)
    counts[[9, 7, 11]] = [5, 9, 5]
    assert vocab.choose_ids(counts, 4, always=[3]).tolist() == [3, 7, 9, 11]
    assert vocab.choose_ids(counts, 3, always=[3]).tolist() == [3, 7, 9]     # a tie goes to the lower id
    assert vocab.choose_ids(counts, 6, always=[3]).tolist() == [0, 1, 3, 7, 9, 11]
    with pytest.raises(ValueError):
        vocab.choose_ids(counts, 13, always=[])


def test_minus_inf_fill_gets_probability_zero_on_every_sampling_path():
    logits = np.full(10, -np.inf, np.float32)
    logits[[2, 5, 7]] = [1.0, 3.0, 2.5]
    out = np.empty(10, np.float32)
    with np.errstate(all="raise"):          # no overflow or invalid value on the way
        for params in (SamplingParams(), SamplingParams(temperature=0.3), SamplingParams(temperature=1.7, top_k=5),
                       SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(temperature=1.0, top_k=2)):
            p = probs_from_logits(logits, params, out)
            assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-6, params
            assert (p[np.isinf(logits)] == 0).all() and p[5] > 0, params


def test_the_draft_scores_the_kept_ids_as_the_full_draft_and_nothing_else(trimmed, tiny_self_engines, kept):
    assert kept.size == KEEP and set(SPECIAL) <= set(kept.tolist())
    tokens = [3, *PROMPT, 10, 20, 99, 120]
    got, full = draft_logits(trimmed, tokens), draft_logits(tiny_self_engines, tokens)
    out = np.setdiff1d(np.arange(got.shape[1]), kept)
    assert np.isneginf(got[:, out]).all()
    np.testing.assert_allclose(got[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    assert np.isin(got.argmax(-1), kept).all()


def test_greedy_speculative_equals_plain_and_emits_tokens_the_draft_cannot(trimmed, kept):
    gen = SpeculativeGenerator(trimmed)
    outside = accepted = 0
    for prompt in PROMPTS:
        plain = [e.token for e in gen.tokens(prompt, max_new_tokens=40, method="plain")]
        spec = [e.token for e in gen.tokens(prompt, max_new_tokens=40)]
        assert spec == plain, prompt
        accepted += gen.last_metrics.accepted
        outside += int((~np.isin(plain, kept)).sum())
    assert outside > 0 and accepted > 0, (outside, accepted)   # both paths exercised


@pytest.fixture(scope="module")
def exact(tiny_pair) -> dict:
    return exact_of(tree_of(tiny_pair[0], PROMPT))


def test_sampling_follows_the_target_with_tokens_outside_the_kept_set(trimmed, kept, exact):
    outside = {c: p for c, p in exact.items() if not np.isin(c, kept).all()}
    assert sum(outside.values()) > 0.2, outside       # the residual must carry real mass for this to mean much
    counts = sample_prefixes(SpeculativeGenerator(trimmed), N // 2)
    fit = fit_of(exact, counts)
    assert fit.passes and fit.outside_support == 0, fit
    assert sum(n for c, n in counts.items() if c in outside) > 0.1 * (N // 2)


def test_the_manifest_records_the_kept_count_coverage_and_choice(manifest, kept):
    d = manifest["models"]["draft"]
    rec = d["source"]["quantization"]["draft_vocab"]
    assert rec["kept"] == KEEP and rec["of"] == d["dims"]["vocab"] == 128 and rec["fill"] == "-inf"
    assert 0 < rec["held_out_coverage"] < 1 and rec["held_out"]["generated_tokens"] > 0
    assert rec["calibration"]["generated_tokens"] > 0 and "most frequent" in rec["chosen_by"]
    assert rec["ids_sha256"] == hashlib.sha256(kept.tobytes()).hexdigest()
    assert f"{KEEP} of 128" in d["source"]["derived"]
    assert manifest["build"]["config"]["draft_vocab"] == KEEP
    agreement = d["parity"]["agreement_with_target"]
    assert np.isfinite(agreement["max_abs_logit_delta"]) and agreement["draftable"]["positions"] > 0


def test_the_full_draft_has_no_trimmed_head(tiny_self_engines):
    man = json.loads((tiny_self_engines / "manifest.json").read_text())
    d = man["models"]["draft"]
    assert vocab.kept_ids(onnx.load(str(tiny_self_engines / d["graphs"]["decode"]["file"]))) is None
    assert "draft_vocab" not in d["source"]["quantization"]


@pytest.mark.parametrize("draft", ["none", "truncate:2", "model"])
def test_other_drafts_refuse_a_draft_vocab(draft, tmp_path):
    with pytest.raises(ConfigError, match="--draft int8"):
        BuildConfig(target="t", out="o", draft=str(tmp_path) if draft == "model" else draft, draft_vocab=100)


def test_gpu_backends_default_draft_refuses_a_draft_vocab():
    with pytest.raises(ConfigError, match="--draft-vocab"):
        BuildConfig(target="t", out="o", backend="ort-cuda", draft_vocab=100)


@pytest.mark.parametrize("n", [0, -3, True, 2.5])
def test_draft_vocab_must_be_a_positive_integer(n):
    with pytest.raises(ConfigError, match="positive integer"):
        BuildConfig(target="t", out="o", draft="int8", draft_vocab=n)


def test_a_draft_vocab_that_keeps_every_token_is_refused(tmp_path, tiny_pair):
    with pytest.raises(ConfigError, match="keeps all 128 tokens"):
        build_tiny(tmp_path / "eng", tiny_pair[0], "int8", draft_vocab=128)
    assert not (tmp_path / "eng").exists()


def test_coverage_is_the_share_of_tokens_in_the_kept_set():
    assert vocab.coverage(np.array([1, 2]), [[1, 1, 3], [2]]) == 0.75
    assert vocab.coverage(np.array([1, 2]), [[]]) is None
