"""Speculation inside a batch on real graphs: the tiny fp32 target built with `--attention
standard --batch` and with `--batch --batch-attention rows`, whose builds show that a
position's logits do not depend on the window they are computed in (standard: two-token
steps vs 3- and 4-token windows; rows: from one-token steps; all rows in one call) and
measure every (T, rows) step. The engine then picks plain, pair or lookup rounds per step
by cost, and every request still gets exactly the tokens it gets alone without speculation.
"""
from __future__ import annotations

import json

import pytest

from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.policy import BatchCosts
from specrt.runtime.rounds import RoundKind
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


def test_rows_records_one_token_steps_and_reads_kv_pos(tiny_batch_rows_engines):
    man = json.loads((tiny_batch_rows_engines / "manifest.json").read_text())
    batch = man["models"]["batch"]
    assert batch["source"]["attention"] == "rows"
    win = batch["parity"]["window_invariance"]
    assert win["equal"] is True and win["min_tokens"] == 1 and win["max_abs_logit_delta"] == 0.0
    inv = batch["parity"]["batch_invariance"]
    assert inv["equal"] is True and inv["kv_len"]["equal"] is True          # reading more of the cache: the same
    from specrt.manifest import load
    assert inv["kv_len"]["lengths"][0] < inv["kv_len"]["lengths"][1] == load(tiny_batch_rows_engines).shapes.kv_capacity
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


def test_a_speculating_batch_gives_every_request_its_tokens_alone(speculating, plain_alone):
    with open_batch(speculating[1], max_num_seqs=3) as g:
        assert g.engine.policy.costs is not None             # the build measured them
        # which steps pay depends on those timings (noisy on a shared machine, and on the tiny model
        # the rows graph's several-token steps cost more than one-token ones): here every step
        # costs the same, so the policy speculates wherever it has a guess
        g.engine.policy.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)})
        got = [c.tokens for c in g.generate_batch(PROMPTS, max_new_tokens=NEW)]
        st = g.engine.stats
        assert got == plain_alone
        spec = st.choices[RoundKind.LOOKUP.value] + st.choices[RoundKind.PAIR.value]
        assert spec > 0, st.choices                          # the policy did speculate
        assert st.tokens > st.row_steps + len(PROMPTS)       # and some steps emitted several tokens a row
        assert st.row_steps / st.steps > 2.0                 # rows shared the steps


def test_a_seeded_sample_is_the_same_alone_and_in_a_speculating_batch(speculating):
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    with open_batch(speculating[1], max_num_seqs=4) as g:
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


def test_a_rows_call_reads_the_cache_up_to_its_longest_row_in_blocks(tiny_batch_rows_engines):
    """kv_pos is bound to 0..L-1 with L = the longest row's length after the call, rounded up to
    KV_BLOCK and capped at the capacity; the row's logits do not depend on L (export tests)."""
    import numpy as np

    from specrt.manifest import load
    from specrt.runtime.backends.ort_batch import KV_BLOCK, OrtBatchModel
    man = load(tiny_batch_rows_engines)
    m = OrtBatchModel(tiny_batch_rows_engines, man.models["batch"], man.shapes, rows=3, threads=2)
    cap = man.shapes.kv_capacity
    for starts, T, want in (([3, 9], 1, KV_BLOCK), ([3, KV_BLOCK - 1], 2, min(2 * KV_BLOCK, cap)),
                            ([cap - 2, 0], 2, cap), ([0, 5], 1, KV_BLOCK)):
        m.step("step", np.ones((2, T), np.int64), np.array(starts, np.int64), 0)
        assert m.kv_len == want, (starts, T)
    assert len(m._bindings) == 2          # one per (rows, T): L is rebound, not a binding of its own
    # a call that would run past the cache, or read less than its longest row, is refused
    from specrt.errors import BackendError
    with pytest.raises(BackendError, match="maximum context"):
        m.step("step", np.ones((2, 2), np.int64), np.array([cap - 1, 0], np.int64), 0)
    with pytest.raises(BackendError, match="kv_len=8"):
        m.step("step", np.ones((2, 1), np.int64), np.array([9, 0], np.int64), 0, kv_len=8)


def test_rows_longer_than_a_cache_block_beside_short_ones_get_their_tokens_alone(tiny_batch_rows_engines):
    """A long row makes every call read more than one KV_BLOCK of cache; the short rows beside
    it (and the long row itself) still get exactly their tokens alone, while speculating."""
    from specrt.runtime.backends.ort_batch import KV_BLOCK
    prompts = [" ".join(f"w{i % 7} x{i % 5}" for i in range(10)), "hello there", "to be or not to be"]
    with open_batch(tiny_batch_rows_engines, max_num_seqs=1, speculate=False) as g:
        alone = [g.generate(p, max_new_tokens=NEW).tokens for p in prompts]
    with open_batch(tiny_batch_rows_engines, max_num_seqs=3) as g:
        g.engine.policy.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)})
        got = [c.tokens for c in g.generate_batch(prompts, max_new_tokens=NEW)]
        assert got == alone
        assert g.engine.target.max_kv_len > KV_BLOCK      # the long row crossed a block
        assert g.engine.stats.choices[RoundKind.PAIR.value] + g.engine.stats.choices[RoundKind.LOOKUP.value] > 0
