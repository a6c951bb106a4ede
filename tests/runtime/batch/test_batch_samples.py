"""n samples of one prompt (OpenAI's `n`) on the toy model (fake_batch.py): the prompt is
prefilled once and its cache row copied into a row per sample (BatchEngine._fork); each sample
is exactly the single request with its own seed, under every proposer (a draft with its own
cache copies its row too) and with a grammar per sample; samples not yet forked share the
first one's fate (cancelled or timed out while waiting or prefilling)."""
from __future__ import annotations

import pytest
from fake_batch import FakeTokenizer
from test_batch_engine import EOS, Collect, make_engine, reference
from test_batch_grammar import GRAMMARS, SPECS, constrained_reference

from specrt.runtime.batch.generator import BatchGenerator
from specrt.runtime.batch.request import Request
from specrt.runtime.sampling import SamplingParams

SAMPLED = SamplingParams(temperature=1.0, top_k=8)
GROUPS = [([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], 3, 50), ([4, 4, 5], 2, 60), (list(range(14)), 4, 70), ([9, 1] * 6, 1, 80)]


def submit_group(eng, prompt, n, seed, params=SAMPLED, spec=None, budget=14, **kw):
    outs = [Collect() for _ in range(n)]
    reqs = [Request(list(prompt), budget, params, seed + i, sink=outs[i], ignore_eos=spec is None,
                    grammar=GRAMMARS.matcher(spec) if spec is not None else None, **kw) for i in range(n)]
    reqs[0].siblings = tuple(reqs[1:])
    eng.add(reqs[0])
    return outs, reqs


def drain(eng):
    for _ in range(5000):
        if not eng.step() and eng.idle():
            break
    assert eng.idle()


@pytest.mark.parametrize("proposer", ["plain", "lookup", "draft", "own-draft"])
def test_each_forked_sample_is_the_single_request_with_its_seed(proposer):
    """Four groups of 3, 2, 4 and 1 samples on 4 rows, joining a few steps apart (a group waits
    until it has a row per sample), greedy and sampled, with and without a grammar: every sample
    equals the request alone with its seed, and each group's prompt was prefilled once. A fork
    that does not copy the prompt's K/V (or the draft's, with its own cache), or copies it at
    the wrong length, reads slots never written (the toy cache fails) or other tokens."""
    kw = {"plain": dict(draft=False, lookup=False), "lookup": dict(draft=False, lookup=True),
          "draft": dict(draft=True, lookup=False), "own-draft": dict(draft=True, lookup=False, own_draft=True)}
    eng, target = make_engine(rows=4, capacity=128, **kw[proposer])
    groups = []
    for g, (prompt, n, seed) in enumerate(GROUPS):
        params, spec = (SAMPLED, SPECS[g % 2]) if g % 2 else (SAMPLED if g else SamplingParams(), None)
        groups.append((prompt, n, seed, params, spec, submit_group(eng, prompt, n, seed, params, spec)[0]))
        for _ in range(2):
            eng.step()
    drain(eng)
    prompt_chunks = sum(-(-len(p) // 8) for p, *_ in GROUPS)
    assert eng.stats.prefill_chunks == prompt_chunks          # one prompt pass per group
    for prompt, n, seed, params, spec, outs in groups:
        for i, c in enumerate(outs):
            if spec is None:
                want = reference(target, prompt, 14, params, seed + i, eos=None)
            else:
                want = constrained_reference(target, prompt, 14, params, seed + i, spec)
            assert (c.tokens, c.done.finish_reason) == want, (prompt, i)
        if not params.greedy and n > 1 and spec is None:
            assert len({tuple(c.tokens) for c in outs}) > 1        # the samples differ
    if proposer != "plain":
        assert sum(c.done.metrics.accepted for *_, outs in groups for c in outs) > 0


def test_greedy_samples_are_all_the_same_answer():
    eng, target = make_engine(rows=3)
    outs, _ = submit_group(eng, [1, 2, 3], 3, 0, SamplingParams())
    drain(eng)
    want = reference(target, [1, 2, 3], 14, SamplingParams(), 0, eos=None)
    assert all((c.tokens, c.done.finish_reason) == want for c in outs)


def test_samples_not_yet_forked_share_the_first_ones_fate():
    """Cancelled while waiting, or while its prompt is prefilled: every sample ends "cancelled"
    (none is left waiting for ever). A sample cancelled on its own before the fork ends
    "cancelled" and the others run."""
    eng, _ = make_engine(rows=3)
    blocker, _ = submit_group(eng, [1, 2, 3], 3, 0)          # holds every row
    waiting, reqs = submit_group(eng, [4, 5, 6], 2, 10)
    eng.step()
    reqs[0].cancel()
    drain(eng)
    assert [c.done.finish_reason for c in waiting] == ["cancelled", "cancelled"]
    assert all(c.done.finish_reason == "length" for c in blocker)

    eng, _ = make_engine(rows=3)
    outs, reqs = submit_group(eng, list(range(14)) * 2, 3, 0)    # 4 prefill chunks
    eng.step()
    eng.step()
    reqs[0].cancel()
    drain(eng)
    assert [c.done.finish_reason for c in outs] == ["cancelled"] * 3

    eng, target = make_engine(rows=3)
    outs, reqs = submit_group(eng, [7, 7, 1], 3, 20)
    reqs[1].cancel()
    drain(eng)
    assert [c.done.finish_reason for c in outs] == ["length", "cancelled", "length"] and outs[1].tokens == []
    assert outs[2].tokens == reference(target, [7, 7, 1], 14, SAMPLED, 22, eos=None)[0]


def test_submit_n_checks_n_and_gives_one_handle_per_sample():
    eng, target = make_engine(rows=3, tokenizer=FakeTokenizer(EOS))
    with BatchGenerator(eng) as g:
        with pytest.raises(Exception, match="max_num_seqs=3"):
            g.submit_n([1, 2, 3], 4)
        for bad in (0, True, 1.5):
            with pytest.raises(Exception, match="n="):
                g.submit_n([1, 2, 3], bad)
        outs = g.generate_n([1, 2, 3], 3, max_new_tokens=10, sampling=SamplingParams(temperature=1.0, seed=5))
    for i, c in enumerate(outs):
        assert c.tokens == reference(target, [1, 2, 3], 10, SamplingParams(temperature=1.0), 5 + i)[0]


def test_a_step_that_fails_while_samples_are_forked_fails_every_sample():
    """The model's logits at the prompt's end are NaN (a broken model): the step raises while the
    first sample's token is chosen, before the others are rows. Every sample gets its Failed (none
    waits for ever), and the engine goes on serving."""
    eng, target = make_engine(rows=3, tokenizer=FakeTokenizer(EOS), draft=False)
    real = target.logits
    bad = [5, 5, 5]
    target.logits = lambda prefix: real(prefix) * (float("nan") if list(prefix) == bad else 1.0)
    with BatchGenerator(eng) as g:
        handles = g.submit_n(bad, 3, max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=1))
        for h in handles:
            with pytest.raises(Exception, match="internal error"):
                h.result(timeout=30)
        assert g.generate([1, 2, 3], max_new_tokens=4).tokens == reference(target, [1, 2, 3], 4)[0]
