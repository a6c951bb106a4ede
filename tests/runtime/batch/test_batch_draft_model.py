"""A separate draft model inside a batch, on real graphs: the tiny fp32 target built with a
draft of its first 2 layers (`--draft truncate:2 --batch --batch-attention rows`). The build exports the draft with a batch
dimension (models.batch_draft: its own cache, one "step" graph with a symbolic T), measures its
agreement with the batched target and its step cost; `open_batch` and the batch of one run it
inside the batch (it prefills each prompt beside the target and catches each row up before a
draft round, runtime/batch/engine.py), and every request still gets exactly the tokens it gets
alone without speculation, greedy and seeded, while rows join and leave.
"""
from __future__ import annotations

import json

import pytest
from bad_input_helpers import copy_engines, edit_manifest
from fake_batch import hold_until_added

from specrt.errors import ManifestError
from specrt.manifest import load
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.policy import BatchCosts
from specrt.runtime.one import draft_left_out
from specrt.runtime.batch.policy import RoundKind
from specrt.runtime.sampling import SamplingParams

PROMPTS = ["a b a b a b a b a b", "the cat the cat the cat", "hello there", "x y z x y z x y z",
           "one two three one two three", "to be or not to be", "abcabcabcabc"]
NEW = 24
# every target pass costs the same and a draft step almost nothing: the policy drafts wherever a
# row has room, not where the build's timings (on a machine that may have been busy) favoured it
DRAFT_PAYS = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)}, draft={1: 0.01, 8: 0.01})


@pytest.fixture(scope="module")
def plain_alone(tiny_batch_rows_model_engines):
    with open_batch(tiny_batch_rows_model_engines, max_num_seqs=1, speculate=False) as g:
        assert g.engine.draft is None and not g.engine.policy.has_draft
        return [g.generate(p, max_new_tokens=NEW).tokens for p in PROMPTS]


def test_the_build_gives_the_draft_model_a_batch_dimension_and_its_own_cache(tiny_batch_rows_model_engines):
    man = json.loads((tiny_batch_rows_model_engines / "manifest.json").read_text())
    bd = man["models"]["batch_draft"]
    assert set(bd["graphs"]) == {"step"} and bd["graphs"]["step"]["batch"] == "dynamic"
    assert bd["kv"]["shares_cache_with"] is None
    assert bd["dims"]["layers"] == man["models"]["draft"]["dims"]["layers"] == 2
    agree = bd["parity"]["draft_agreement"]
    assert agree["positions"] > 0 and 0.0 <= agree["top1_agreement"] <= 1.0
    assert set(man["models"]["batch"]["graphs"]) == {"step"}          # no int8 self-draft graph
    draft = man["build"]["speculation"]["batch_costs_ms"]["draft"]
    assert set(draft) == {"1", "2", "4", "8"} and all(ms > 0 for ms in draft.values())
    assert not draft_left_out(load(tiny_batch_rows_model_engines))
    with open_batch(tiny_batch_rows_model_engines, max_num_seqs=2) as g:
        assert g.engine.policy.has_draft and g.engine.draft is not None
        assert g.engine.draft.cache is not g.engine.target.cache and not g.engine.draft.shares_cache
        assert g.engine.policy.priors["draft"] == agree["top1_agreement"]


def test_the_draft_model_inside_a_batch_gives_every_request_its_tokens_alone(tiny_batch_rows_model_engines,
                                                                            plain_alone, monkeypatch):
    # 3 rows for 7 requests: rows join and leave while the draft proposes for the others
    with open_batch(tiny_batch_rows_model_engines, max_num_seqs=3) as g:
        g.engine.policy.costs = DRAFT_PAYS
        hold_until_added(g.engine, len(PROMPTS), monkeypatch)
        got = [c.tokens for c in g.generate_batch(PROMPTS, max_new_tokens=NEW)]
        st = g.engine.stats
    assert got == plain_alone
    assert st.choices[RoundKind.DRAFT.value] > 0, st.choices
    assert st.tokens > st.row_steps + len(PROMPTS)       # drafted tokens were accepted
    assert st.row_steps / st.steps > 2.0                 # rows shared the steps


def test_a_seeded_sample_is_the_same_alone_and_among_rows_the_draft_model_proposes_for(tiny_batch_rows_model_engines):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=99)
    with open_batch(tiny_batch_rows_model_engines, max_num_seqs=1, speculate=False) as g:
        alone = g.generate(PROMPTS[1], max_new_tokens=NEW, sampling=sp).tokens
    with open_batch(tiny_batch_rows_model_engines, max_num_seqs=4) as g:
        g.engine.policy.costs = DRAFT_PAYS
        others = [g.submit(p, max_new_tokens=NEW, sampling=SamplingParams(temperature=1.0, seed=i))
                  for i, p in enumerate(PROMPTS[2:5])]
        mid = g.submit(PROMPTS[1], max_new_tokens=NEW, sampling=sp)
        assert mid.result().tokens == alone
        for h in others:
            h.result()
        assert g.engine.stats.choices[RoundKind.DRAFT.value] > 0


def test_the_batch_of_one_runs_the_draft_model_and_answers_as_the_batch(tiny_batch_rows_model_engines, plain_alone):
    gen = SpeculativeGenerator(tiny_batch_rows_model_engines)
    assert gen.one is not None and gen.one.has_draft
    gen.one.full.costs = DRAFT_PAYS
    for prompt, want in zip(PROMPTS[:3], plain_alone):
        got = gen.generate(prompt, max_new_tokens=NEW, method="speculative")
        assert got.tokens == want
        assert got.metrics.drafted > 0


def test_a_batched_draft_model_without_a_batched_target_is_refused(tiny_batch_rows_model_engines, tmp_path):
    dst = copy_engines(tiny_batch_rows_model_engines, tmp_path)
    edit_manifest(dst, lambda m: m["models"].pop("batch"))
    with pytest.raises(ManifestError, match="batch_draft"):
        load(dst)


def test_retime_measures_the_batched_draft_models_step_again(tiny_batch_rows_model_engines, tmp_path, capsys):
    from specrt.cli import main
    dst = copy_engines(tiny_batch_rows_model_engines, tmp_path)

    def poison(m):
        d = m["build"]["speculation"]["batch_costs_ms"]["draft"]
        for n in d:
            d[n] = 12345.0
    edit_manifest(dst, poison)
    assert main(["retime", str(dst)]) == 0
    draft = load(dst).build["speculation"]["batch_costs_ms"]["draft"]
    assert set(draft) == {"1", "2", "4", "8"} and all(0 < ms < 12345.0 for ms in draft.values())


def test_inspect_says_the_draft_model_runs_inside_the_batch(tiny_batch_rows_model_engines):
    from specrt.tools.describe import describe
    text = describe(load(tiny_batch_rows_model_engines))
    assert "[batch_draft]" in text and "its own cache per row" in text
    assert "speculating per step by measured cost (the draft model inside the batch" in text
    assert "not used" not in text


def test_each_draft_round_proposes_the_draft_models_own_greedy_continuation_of_the_row(
        tiny_batch_rows_model_engines, monkeypatch):
    """The tokens are right whatever the draft proposes (the target decides), so only the
    proposals show a draft cache gone wrong: K/V of rejected guesses kept (its length not
    rewound), or another row's K/V read. Each round's proposal for each row must be the draft
    model's greedy continuation of that row's tokens, computed here from a fresh cache of its own
    (the sequence in prompt-chunk calls, then one token a call), while rows join and leave."""
    import numpy as np

    from specrt.runtime.backends import backend_for
    root = tiny_batch_rows_model_engines
    man = load(root)
    ref = backend_for(man).open_batch(root, man.batch_draft, man.shapes, rows=1, threads=2, min_rows=1)

    def continuation(seq: list[int], k: int) -> tuple[list[int], float]:
        """The draft's greedy k tokens after seq, and the smallest top-2 margin among them."""
        toks, margin, C = [], np.inf, man.shapes.prefill_chunk
        for start in range(0, len(seq), C):         # the sequence in prompt-chunk calls
            chunk = seq[start:start + C]
            logits = ref.step("verify", np.asarray([chunk], np.int64), np.asarray([start], np.int64), 0,
                              np.asarray([[len(chunk) - 1]], np.int64))[0, 0]
        for j in range(k):
            top2 = np.sort(logits)[-2:]
            margin = min(margin, float(top2[1] - top2[0]))
            toks.append(int(np.argmax(logits)))
            if j + 1 < k:
                logits = ref.step("decode", np.asarray([[toks[-1]]], np.int64),
                                  np.asarray([len(seq) + j], np.int64), 0)[0, 0]
        return toks, margin

    rounds = []
    with open_batch(root, max_num_seqs=3) as g:
        g.engine.policy.costs = DRAFT_PAYS
        eng, draft_own = g.engine, g.engine._draft_own

        def recorded(choice):
            seqs = [list(r.seq) for r in eng.rows]
            out = draft_own(choice)
            rounds.extend((s, [int(t) for t in p]) for s, p in zip(seqs, out) if len(p))
            return out
        monkeypatch.setattr(eng, "_draft_own", recorded)
        hold_until_added(eng, len(PROMPTS), monkeypatch)
        g.generate_batch(PROMPTS, max_new_tokens=NEW)
    checked = 0
    for seq, proposed in rounds:
        want, margin = continuation(seq, len(proposed))
        if margin > 1e-3:          # a near tie may fall either way between two call shapes
            assert proposed == want, (seq, proposed, want)
            checked += 1
    assert checked >= len(rounds) // 2 and any(len(p) > 1 for _, p in rounds), (checked, len(rounds))
