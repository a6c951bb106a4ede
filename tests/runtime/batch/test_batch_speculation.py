"""Speculation inside a batch on real graphs: the tiny fp32 target built with `--attention
standard --batch` and with `--batch --batch-attention rows`, whose builds show that a
position's logits do not depend on the window they are computed in (standard: two-token
steps vs 3- and 4-token windows; rows: from one-token steps; all rows in one call) and
measure every (T, rows) step. The engine then picks plain, pair or lookup rounds per step
by cost, and every request still gets exactly the tokens it gets alone without speculation.
A draft equal to the target (on the toy model, fake_batch.py) has every proposal accepted.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from fake_batch import FakeLM, hold_until_added

from specrt.runtime.choice import choose
from specrt.runtime.batch.engine import BatchEngine
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.policy import BatchCosts, BatchPolicy, StepChoice
from specrt.runtime.batch.request import Delta, Done, Request
from specrt.runtime.batch.policy import RoundKind
from specrt.runtime.sampling import SamplingParams

PROMPTS = ["a b a b a b a b a b", "the cat the cat the cat", "hello there", "x y z x y z x y z",
           "one two three one two three", "to be or not to be", "abcabcabcabc"]
NEW = 24


MIN_TOKENS = {"standard": 2, "rows": 1}     # tokens a row of every target pass (plain steps padded to it)


@pytest.fixture(scope="module", params=["standard", "rows"])
def speculating(request):
    """(variant, engines folder) of a batched build whose batches speculate."""
    return request.param, request.getfixturevalue(f"tiny_batch_{request.param}_engines")


@pytest.fixture(scope="module")
def plain_alone(speculating):
    variant, engines = speculating
    with open_batch(engines, max_num_seqs=1, speculate=False) as g:
        assert g.engine.min_tokens == MIN_TOKENS[variant]
        return [g.generate(p, max_new_tokens=NEW).tokens for p in PROMPTS]


def test_rows_records_one_token_steps_and_that_a_row_does_not_depend_on_the_cache_length(tiny_batch_rows_engines):
    man = json.loads((tiny_batch_rows_engines / "manifest.json").read_text())
    batch = man["models"]["batch"]
    assert batch["source"]["attention"] == "rows"
    win = batch["parity"]["window_invariance"]
    assert win["equal"] is True and win["min_tokens"] == 1 and win["max_abs_logit_delta"] == 0.0
    inv = batch["parity"]["batch_invariance"]
    assert inv["equal"] is True and inv["kv_len"]["equal"] is True          # reading more of the cache: the same
    from specrt.manifest import load
    assert inv["kv_len"]["lengths"][0] < inv["kv_len"]["lengths"][1] == load(tiny_batch_rows_engines).shapes.kv_capacity
    assert inv["kv_len"]["window"] == load(tiny_batch_rows_engines).shapes.k + 1     # verify windows too
    costs = man["build"]["speculation"]["batch_costs_ms"]["target"]
    assert set(costs) == {"1", "2", "4"} and all(set(v) == {"1", "2", "4", "8"} for v in costs.values())
    with open_batch(tiny_batch_rows_engines, max_num_seqs=2) as g:
        assert g.engine.policy.costs is not None and g.engine.min_tokens == 1
        assert g.engine.target.multi_token_rows is None


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


def test_a_speculating_batch_gives_every_request_its_tokens_alone(speculating, plain_alone, monkeypatch):
    with open_batch(speculating[1], max_num_seqs=3) as g:
        assert g.engine.policy.costs is not None             # the build measured them
        # which steps pay depends on those timings (noisy on a shared machine, and on the tiny model
        # the rows graph's several-token steps cost more than one-token ones): here every step
        # costs the same, so the policy speculates wherever it has a guess
        g.engine.policy.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)})
        hold_until_added(g.engine, len(PROMPTS), monkeypatch)     # all wait before the first step: the
        got = [c.tokens for c in g.generate_batch(PROMPTS, max_new_tokens=NEW)]   # batches are not up to the threads
        st = g.engine.stats
        assert got == plain_alone
        spec = st.choices[RoundKind.LOOKUP.value] + st.choices[RoundKind.PAIR.value]
        assert spec > 0, st.choices                          # the policy did speculate
        assert st.tokens > st.row_steps + len(PROMPTS)       # and some steps emitted several tokens a row
        assert st.row_steps / st.steps > 2.0                 # rows shared the steps


def test_a_seeded_sample_is_the_same_alone_and_in_a_speculating_batch(speculating):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    with open_batch(speculating[1], max_num_seqs=4) as g:
        # equal costs: the policy speculates wherever it has a guess, not where the build's timings
        # (measured on a machine that may have been busy) happened to favour it
        g.engine.policy.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)})
        alone = g.generate(PROMPTS[0], max_new_tokens=NEW, sampling=sp).tokens
        hs = [g.submit(p, max_new_tokens=NEW, sampling=SamplingParams(temperature=1.0, seed=i))
              for i, p in enumerate(PROMPTS[1:4])]
        mid = g.submit(PROMPTS[0], max_new_tokens=NEW, sampling=sp)
        assert mid.result().tokens == alone
        for h in hs:
            h.result()
        assert g.engine.stats.choices[RoundKind.PLAIN.value] < g.engine.stats.steps


def test_batch_attention_needs_batch_and_a_known_kind(tiny_pair, tmp_path):
    from specrt.builder.config import BuildConfig
    from specrt.errors import ConfigError
    target, _ = tiny_pair
    with pytest.raises(ConfigError, match="add --batch"):
        BuildConfig(target=str(target), out=str(tmp_path / "x"), batch_attention="rows")
    with pytest.raises(ConfigError, match="gqa, rows"):
        BuildConfig(target=str(target), out=str(tmp_path / "x"), batch=True, batch_attention="standard")


def test_device_buckets_refuse_a_rows_graph_naming_the_fix(tiny_batch_rows_engines):
    from specrt.errors import ManifestError
    from specrt.manifest import load
    from specrt.runtime.backends.device_batch import DeviceBatchModel
    man = load(tiny_batch_rows_engines)
    with pytest.raises(ManifestError, match="without --batch-attention rows"):
        DeviceBatchModel(tiny_batch_rows_engines, man.models["batch"], man.shapes, rows=2, execution="cpu")


def test_a_rows_call_reads_a_cache_of_what_its_rows_hold_in_blocks(tiny_batch_rows_engines):
    """The rows graph takes a cache of L positions, L = every row's end after the call rounded
    up to KV_BLOCK, at most the capacity (BatchKV grows: tests/runtime/test_batch_kv_grows.py);
    a reallocation keeps each row's K/V and rebinds; the row's logits do not depend on L (export
    tests)."""
    from specrt.errors import BackendError
    from specrt.manifest import load
    from specrt.runtime.backends.batch_kv import KV_BLOCK
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    man = load(tiny_batch_rows_engines)
    m = OrtBatchModel(tiny_batch_rows_engines, man.models["batch"], man.shapes, rows=3, threads=2)
    cap = man.shapes.kv_capacity
    assert m.grows and m.cache.grows and not any(m.has_kv_pos.values()) and KV_BLOCK < cap < 2 * KV_BLOCK
    m.step("step", np.ones((2, 1), np.int64), np.array([3, 9], np.int64), 0)
    assert m.kv_len == m.cache.length == KV_BLOCK and m.cache.keys[0].shape[2] == KV_BLOCK
    held = [a[:2, :, :10].copy() for a in m.cache.keys + m.cache.values]
    gen, bound = m.cache.generation, len(m._bindings)
    m.step("step", np.ones((2, 2), np.int64), np.array([4, KV_BLOCK - 1], np.int64), 0)   # writes position 64
    assert m.kv_len == cap and m.cache.generation == gen + 1       # grown (capped), and bound again
    assert bound == 1 and len(m._bindings) == 1
    for a, want in zip(m.cache.keys + m.cache.values, held):
        np.testing.assert_array_equal(a[0, :, :4], want[0, :, :4])   # row 0 kept what it held
        np.testing.assert_array_equal(a[1, :, :10], want[1, :, :10])
    m.step("step", np.ones((1, 1), np.int64), np.array([0], np.int64), 2)
    assert m.kv_len == cap          # a new row's first call: the long row beside it keeps the cache long
    with pytest.raises(BackendError, match="maximum context"):
        m.step("step", np.ones((2, 2), np.int64), np.array([cap - 1, 0], np.int64), 0)
    with pytest.raises(BackendError, match="kv_len=8"):
        m.step("step", np.ones((2, 1), np.int64), np.array([9, 0], np.int64), 0, kv_len=8)


def test_a_prompt_chunk_beside_longer_rows_runs_over_a_cache_of_its_own_with_the_same_result(tiny_batch_rows_engines):
    """A one-row call whose row needs less than the cache the other rows hold (a new request's
    prompt chunk beside long rows) runs over a one-row cache of its own length: its prefix copied
    in, what it wrote copied back. Logits and the cache it leaves are the same bit for bit as the
    call over the whole shared cache (kv_len given: that path)."""
    from specrt.manifest import load
    from specrt.runtime.backends.batch_kv import KV_BLOCK
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    man = load(tiny_batch_rows_engines)
    m = OrtBatchModel(tiny_batch_rows_engines, man.models["batch"], man.shapes, rows=3, threads=2)
    cap = man.shapes.kv_capacity
    rng = np.random.default_rng(4)
    m.step("step", rng.integers(5, 100, (1, 16)), np.array([0]), 0)            # row 0: a prompt, then long
    m.step("step", rng.integers(5, 100, (1, 8)), np.array([cap - 30]), 0)
    m.step("step", rng.integers(5, 100, (1, 16)), np.array([0]), 1, kv_len=cap)  # row 1: the new request
    assert m.cache.length == cap
    chunk, start = rng.integers(5, 100, (1, 16)), np.array([16])
    before = [a.copy() for a in m.cache.keys + m.cache.values]
    last = np.array([[15]])
    own = m.step("prefill", chunk, start, 1, last).copy()
    assert m.kv_len == KV_BLOCK and len(m._alone) == 2 * man.models["batch"].layers   # its own cache: 64 positions
    after_own = [a.copy() for a in m.cache.keys + m.cache.values]
    for a, b in zip(m.cache.keys + m.cache.values, before):
        np.copyto(a, b)
    whole = m.step("prefill", chunk, start, 1, last, kv_len=cap).copy()
    assert m.kv_len == cap
    np.testing.assert_array_equal(own, whole)
    for a, b in zip(m.cache.keys + m.cache.values, after_own):
        np.testing.assert_array_equal(a[:2, :, :32], b[:2, :, :32])              # row 1's prompt, row 0 untouched
        np.testing.assert_array_equal(a[0], b[0])
    m.step("decode", chunk[:, :1], np.array([32]), 1)
    assert m.kv_len == cap          # only prompt chunks take the one-row cache


def test_a_reallocation_drops_the_bindings_of_every_model_sharing_the_cache(tiny_batch_rows_draft_engines):
    """The int8 self-draft runs over the target's cache (a second model, cache=...): when the
    target's call reallocates the cache, the draft's IO bindings go at once (they held the old
    arrays alive), and its next call reads the new arrays."""
    from specrt.manifest import load
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    man = load(tiny_batch_rows_draft_engines)
    entry = man.models["batch"]
    target = OrtBatchModel(tiny_batch_rows_draft_engines, entry, man.shapes, rows=2, threads=2,
                           graphs=tuple(g for g in entry.graphs if g != "draft"))
    draft = OrtBatchModel(tiny_batch_rows_draft_engines, entry, man.shapes, rows=2, cache=target.cache,
                          graphs=("draft",), serves="draft", threads=2)
    ids = np.ones((2, 1), np.int64)
    target.step("step", ids, np.array([3, 5]), 0)
    draft.step("decode", ids, np.array([4, 6]), 0)
    assert draft._bindings and target.cache.length == 64
    target.step("step", np.ones((2, 4), np.int64), np.array([62, 7]), 0)       # past one block: reallocated
    assert target.cache.length > 64 and not draft._bindings and draft._generation == target.cache.generation
    got = draft.step("decode", ids, np.array([66, 11]), 0).copy()
    again = draft.step("decode", ids, np.array([66, 11]), 0)      # the same call, now bound: the same answer
    np.testing.assert_array_equal(got, again)


def test_rows_longer_than_a_cache_block_beside_short_ones_get_their_tokens_alone(tiny_batch_rows_engines, monkeypatch):
    """A long row makes every call read more than one KV_BLOCK of cache; the short rows beside
    it (and the long row itself) still get exactly their tokens alone, while speculating."""
    from specrt.runtime.backends.batch_kv import KV_BLOCK
    prompts = [" ".join(f"w{i % 7} x{i % 5}" for i in range(10)), "hello there", "to be or not to be"]
    with open_batch(tiny_batch_rows_engines, max_num_seqs=1, speculate=False) as g:
        alone = [g.generate(p, max_new_tokens=NEW).tokens for p in prompts]
    with open_batch(tiny_batch_rows_engines, max_num_seqs=3) as g:
        g.engine.policy.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)})
        hold_until_added(g.engine, len(prompts), monkeypatch)
        got = [c.tokens for c in g.generate_batch(prompts, max_new_tokens=NEW)]
        assert got == alone
        assert g.engine.target.max_kv_len > KV_BLOCK      # the long row crossed a block
        assert g.engine.stats.choices[RoundKind.PAIR.value] + g.engine.stats.choices[RoundKind.LOOKUP.value] > 0


class SometimesPlain(BatchPolicy):
    """`plain` plain steps in every `period` rounds, the others as BatchPolicy chooses."""
    rounds, period, plain = 0, 8, 5

    def choose(self, rows, graph_t):
        self.rounds += 1
        if self.rounds % self.period < self.plain:
            return StepChoice(RoundKind.PLAIN, graph_t("decode", 1, len(rows)), [np.zeros(0, np.int64)] * len(rows))
        return super().choose(rows, graph_t)


@pytest.mark.parametrize("cache", ["shared", "own"])
def test_a_draft_equal_to_the_target_has_every_proposal_accepted_in_a_batch(cache):
    """The toy model (fake_batch.py) as its own draft, greedy and seeded sampled
    rows joining at different steps: the draft's j-th token is chosen at the row's position + j
    from the prefix the target will verify, so it IS the target's choice there (same logits,
    same u(seed, position): choice.py), and every proposed token is accepted: accepted ==
    drafted for every request, exactly. (A round that would pass the budget proposes fewer
    tokens, room = what is left: it is shortened, never rejected.) A draft that reads its
    prompt one slot off, chooses for the wrong position or drafts from the wrong token
    proposes what the target does not choose, and the share falls.

    cache "own": the draft as a separate model with its own cache (a draft model in the batch):
    it prefills each prompt beside the target and catches up on the tokens its rows lack before
    each draft round; a row whose draft cache is not rewound after a rejection, is rewound to the
    wrong length or does not move with its row drafts from a prefix the target never had (or
    reads a slot never written: the toy cache fails at once), and the share falls. Five rounds of
    every eight are plain steps, so rows fall behind their draft cache by up to 5 tokens and catch
    up in more than one call."""
    V, EOS, K, ROWS, CAP = 16, 15, 3, 3, 96
    target = FakeLM(V, ROWS, CAP)
    # a draft step far cheaper than a verify pass: every step with room drafts
    costs = BatchCosts({T: {1: 10.0, 8: 10.0} for T in (1, 2, 4)}, draft={1: 0.5, 8: 0.5})
    if cache == "shared":
        draft = FakeLM(V, ROWS, CAP, cache=target.cache, graph_tokens={"decode": 0})   # same salt: the same model
        policy = BatchPolicy(costs, K, draft=True)
    else:
        draft = FakeLM(V, ROWS, CAP, graph_tokens={"prefill": 8, "decode": 0, "verify": 0})
        policy = SometimesPlain(costs, K, draft=True)
    eng = BatchEngine(target, max_num_seqs=ROWS, max_context=CAP - 8, prefill_tokens=8, k_max=K, vocab=V,
                      policy=policy, eos={EOS}, draft=draft)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 4], [2] * 9, list(range(14)), [7, 7, 1, 7],
               [9, 1] * 6, [3, 4, 5], [11, 12]]
    sampled = SamplingParams(temperature=1.0, top_k=8)
    requests = []

    def submit(i):
        out = {"tokens": [], "done": None}

        def sink(ev):
            if isinstance(ev, Delta):
                out["tokens"] += ev.tokens
            elif isinstance(ev, Done):
                out["done"] = ev
            else:
                raise AssertionError(ev)
        params = SamplingParams() if i % 2 else sampled
        # ignore_eos: each runs to its budget, so the rounds a row shares are many
        eng.add(Request(list(prompts[i]), 16 + 3 * i, params, seed=100 + i, sink=sink, ignore_eos=True))
        requests.append((prompts[i], 16 + 3 * i, params, 100 + i, out))

    for i in range(2):
        submit(i)
    for i in range(2, len(prompts)):            # the rest join one by one, a few steps apart
        for _ in range(2):
            eng.step()
        submit(i)
    for _ in range(5000):
        if not eng.step() and eng.idle():
            break
    assert eng.idle()

    scratch = np.zeros(V, np.float32)
    for prompt, n, params, seed, out in requests:
        seq, want = list(prompt), []            # the request alone: one target choice per position
        for _ in range(n):
            want.append(choose(target.logits(seq), params, seed, len(seq), scratch))
            seq.append(want[-1])
        m = out["done"].metrics
        assert m.accepted == m.drafted, (prompt, params, m.accepted, m.drafted)
        assert out["tokens"] == want, (prompt, params)
    metrics = [out["done"].metrics for *_, out in requests]
    assert all(m.drafted > 0 for m in metrics)
    assert any(m.drafted < K * m.iterations for m in metrics)     # some rounds were shortened by the budget
    drafted = sum(out["done"].metrics.drafted for *_, out in requests)
    emitted = sum(len(out["tokens"]) for *_, out in requests)
    share = 0.5 if cache == "shared" else 0.3                  # ("own": 5 rounds of 8 are plain)
    assert eng.stats.choices[RoundKind.DRAFT.value] > share * eng.stats.steps, eng.stats.choices
    assert drafted > share * emitted, (drafted, emitted)      # many tokens came from the draft
    if cache == "own":
        catch_ups = sum(g == "verify" for g, *_ in draft.calls)
        assert catch_ups > eng.stats.choices[RoundKind.DRAFT.value]      # some rows caught up in two calls
        assert sum(g == "prefill" for g, *_ in draft.calls) == eng.stats.prefill_chunks
    assert eng.stats.occupancy > 1.5, eng.stats             # rows shared the draft rounds


@pytest.mark.parametrize("verify_t", [0, 4])     # the draft's verify graph: any T, or a static k + 1
def test_a_draft_model_with_its_own_cache_proposes_from_each_rows_own_tokens(verify_t):
    """A separate draft model (another toy model, agreeing with the target only sometimes) with
    its own cache in a batch of 3 rows, 8 requests joining and leaving, greedy and sampled, with
    plain rounds between the draft rounds. Every proposal is checked against the draft model
    run on the row's true tokens (the prefix the target verified, then the proposals before it):
    a draft cache that keeps a rejected proposal's K/V (not rewound, or rewound one too few), or
    that was fed from the wrong offset, or did not move with its row, proposes from another
    prefix. And every request gets exactly its tokens alone."""
    V, EOS, K, ROWS, CAP = 16, 15, 3, 3, 96
    target = FakeLM(V, ROWS, CAP, sharpness=3.0)
    draft = FakeLM(V, ROWS, CAP, salt=b"draft", sharpness=3.0,
                   graph_tokens={"prefill": 8, "decode": 0, "verify": verify_t})
    # the draft agrees with the target about half the time: mix their logits
    own = draft.logits
    draft.logits = lambda prefix: own(prefix) + target.logits(prefix)
    costs = BatchCosts({T: {1: 10.0, 8: 10.0} for T in (1, 2, 4)}, draft={1: 0.5, 8: 0.5})
    policy = SometimesPlain(costs, K, draft=True)
    policy.period, policy.plain = 16, 10      # rows fall 10+ tokens behind: catch-ups wider than a window
    eng = BatchEngine(target, max_num_seqs=ROWS, max_context=CAP - 8, prefill_tokens=8, k_max=K, vocab=V,
                      policy=policy, eos={EOS}, draft=draft)
    proposed = []           # (seq before the round, params, seed, the row's proposals)
    real_draft = eng._draft_own

    def record(choice):
        out = real_draft(choice)
        proposed.extend((list(r.seq), r.req.params, r.req.seed, list(p)) for r, p in zip(eng.rows, out))
        return out
    eng._draft_own = record
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 4], [2] * 9, list(range(14)), [7, 7, 1, 7],
               [9, 1] * 6, [3, 4, 5], [11, 12]]
    sampled = SamplingParams(temperature=1.0, top_k=8)
    outs = []
    for i, prompt in enumerate(prompts):
        out = {"tokens": [], "done": None}
        outs.append((prompt, 12 + 3 * i, SamplingParams() if i % 2 else sampled, 200 + i, out))

        def sink(ev, out=out):
            if isinstance(ev, Delta):
                out["tokens"] += ev.tokens
            elif isinstance(ev, Done):
                out["done"] = ev
        eng.add(Request(list(prompt), 12 + 3 * i, outs[-1][2], seed=200 + i, sink=sink, ignore_eos=True))
        for _ in range(3):
            eng.step()
    for _ in range(5000):
        if not eng.step() and eng.idle():
            break
    assert eng.idle()
    scratch = np.zeros(V, np.float32)
    for seq, params, seed, p in proposed:
        ctx = list(seq)
        for tok in p:
            assert tok == choose(draft.logits(ctx), params, seed, len(ctx), scratch), (seq, p)
            ctx.append(tok)
    for prompt, n, params, seed, out in outs:
        seq, want = list(prompt), []
        for _ in range(n):
            want.append(choose(target.logits(seq), params, seed, len(seq), scratch))
            seq.append(want[-1])
        assert out["tokens"] == want, (prompt, params)
    drafted = sum(out["done"].metrics.drafted for *_, out in outs)
    accepted = sum(out["done"].metrics.accepted for *_, out in outs)
    assert 0 < accepted < drafted, (accepted, drafted)      # proposals were rejected, and accepted
    assert len(proposed) > 20 and eng.stats.occupancy > 1.5
    widest = max(T for g, _, T, _ in draft.calls if g == "verify")
    # rows 10+ tokens behind caught up in calls wider than a window (any T), or in chunks of the graph's T
    assert (widest > K + 1) if not verify_t else widest == verify_t, widest


def test_forked_samples_on_a_growing_cache_are_each_the_request_alone(tiny_batch_rows_engines):
    """n samples of a prompt whose rows cross a cache block: the prompt's K/V is copied into a
    row per sample (move_row sets each row's end) and the cache is re-laid out as the rows grow;
    each sample equals the request alone with its own seed."""
    from specrt.runtime.backends.batch_kv import KV_BLOCK
    prompt = " ".join(f"w{i % 7} x{i % 5}" for i in range(10))
    with open_batch(tiny_batch_rows_engines, max_num_seqs=1) as g:
        alone = [g.generate(prompt, max_new_tokens=NEW, ignore_eos=True,
                            sampling=SamplingParams(temperature=1.0, seed=5 + i)).tokens for i in range(3)]
    with open_batch(tiny_batch_rows_engines, max_num_seqs=3) as g:
        handles = g.submit_n(prompt, 3, max_new_tokens=NEW, ignore_eos=True,
                             sampling=SamplingParams(temperature=1.0, seed=5))
        got = [h.result(timeout=60).tokens for h in handles]
        assert g.engine.target.max_kv_len > KV_BLOCK and g.engine.target.cache.generation > 1
    assert got == alone

