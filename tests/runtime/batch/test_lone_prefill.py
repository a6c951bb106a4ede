"""A request alone prefills in larger chunks (issue 28: long prompts): the engine feeds a prompt
in chunks of LONE_CHUNKS x the folder's chunk when no row decodes beside it, where the build
showed the prompt graph gives the same bits whatever the chunk (parity.chunk_invariance,
builder/gates/chunks.py). Beside running rows, with a draft model of its own, or without that
record, chunks stay the folder's. The tokens never change: checked on a toy model (scheduling)
and on the tiny rows folder (the real graph, bit for bit)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from fake_batch import FakeLM

from specrt import manifest as mf
from specrt.builder.gates import chunks
from specrt.errors import ConfigError, ManifestError
from specrt.runtime.backends.batch_calls import lone_prefill_tokens
from specrt.runtime.batch.engine import BatchEngine
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.policy import BatchPolicy
from specrt.runtime.batch.request import Request
from specrt.runtime.sampling import SamplingParams

V, EOS = 16, 15


def _engine(lone, *, prefill=4, static=False, rows=2):
    lm = FakeLM(V, rows, 96, graph_tokens={"prefill": prefill if static else 0, "decode": 0, "verify": 0})
    eng = BatchEngine(lm, max_num_seqs=rows, max_context=96 - max(prefill, 16), prefill_tokens=prefill, k_max=3,
                      vocab=V, policy=BatchPolicy(None, 3), eos={EOS}, lone_prefill_tokens=lone)
    return eng, lm


def _drain(eng, limit=2000):
    for _ in range(limit):
        if not eng.step() and eng.idle():
            return
    raise AssertionError("the engine did not finish")


def _prefills(lm, first_row):
    return [T for g, n, T, r in lm.calls if g == "prefill" and r == first_row]


def test_a_request_alone_prefills_in_the_larger_chunks_and_one_beside_a_running_row_in_the_folders():
    eng, lm = _engine(16)
    a = list(range(1, 15)) * 3                  # 42 tokens
    eng.add(Request(a, 30, SamplingParams(), 0, sink=lambda ev: None, ignore_eos=True))   # decodes past B's prompt
    while not eng.rows:                         # A is prefilled alone
        eng.step()
    assert _prefills(lm, 0) == [16, 16, 10]
    eng.add(Request(a[:38], 6, SamplingParams(), 0, sink=lambda ev: None))
    _drain(eng)
    assert _prefills(lm, 1) == [4] * 9 + [2], "a prompt beside a decoding row ran the larger chunks"


def test_the_tokens_do_not_depend_on_the_chunks():
    outs = []
    for lone in (None, 16):
        eng, _ = _engine(lone)
        got = []
        for p in ([3, 1, 4, 1, 5, 9, 2, 6] * 5, [2, 7, 1, 8] * 9):
            toks = []
            eng.add(Request(p, 12, SamplingParams(), 0, sink=lambda ev, t=toks: t.extend(getattr(ev, "tokens", [])),
                            ignore_eos=True))
            got.append(toks)
        _drain(eng)
        outs.append(got)
    assert outs[0] == outs[1] and all(outs[0])


def test_a_static_prompt_graph_or_a_smaller_lone_chunk_is_not_taken():
    eng, lm = _engine(16, static=True)
    assert eng.lone_prefill_tokens == 4                     # a static T graph: its own chunk always
    with pytest.raises(ValueError, match="below prefill_tokens"):
        _engine(2)


def test_the_gate_decides_and_the_runtime_follows(monkeypatch, tiny_batch_rows_engines):
    """chunk_invariance compares the prompt fed in the folder's chunks with a mixed schedule that
    holds one larger chunk; a graph whose numbers move with the chunk is recorded unequal, and the
    runtime then keeps the folder's chunk."""
    man = mf.load(tiny_batch_rows_engines)
    entry, shapes = man.models["batch"], man.shapes
    rec = entry.parity["chunk_invariance"]
    assert rec["equal"] is True and rec["chunks"] == [shapes.prefill_chunk, 4 * shapes.prefill_chunk]
    assert rec["max_abs_logit_delta"] == 0.0 and rec["max_abs_kv_delta"] == 0.0
    assert lone_prefill_tokens(entry, shapes) == 4 * shapes.prefill_chunk

    seen = []

    def fed(root, entry, shapes, ids, sizes, call_tokens):
        seen.append(sizes)
        kv = [np.zeros((2, len(ids), 4), np.float32)]
        last = np.zeros(V, np.float32)
        if len(seen) == 2:                      # the schedule with the larger chunk moves a logit
            last[3] = 1e-6
        return last, kv

    monkeypatch.setattr(chunks, "_fed", fed)
    got = chunks.measure(None, entry, shapes, [[5, 6, 7]])
    C = shapes.prefill_chunk
    # a one-token call then two (a kernel's one-token path); the large one off its own multiple, an odd tail
    assert seen[0] == [C] * 5 + [1, 2] and seen[1] == [C, 4 * C, 3]
    assert got["equal"] is False and got["max_abs_logit_delta"] == pytest.approx(1e-6)
    unequal = entry.__class__(**{**entry.__dict__, "parity": {**entry.parity, "chunk_invariance": got}})
    assert lone_prefill_tokens(unequal, shapes) == C
    absent = entry.__class__(**{**entry.__dict__, "parity": {k: v for k, v in entry.parity.items()
                                                             if k != "chunk_invariance"}})
    assert lone_prefill_tokens(absent, shapes) == C      # folders built before the gate
    bad = entry.__class__(**{**entry.__dict__, "parity": {**entry.parity, "chunk_invariance": {"chunks": "64"}}})
    with pytest.raises(ManifestError, match="rebuild"):
        lone_prefill_tokens(bad, shapes)
    monkeypatch.setenv("SPECRT_LONE_PREFILL", "0")          # the switch: the folder's chunk always
    assert lone_prefill_tokens(entry, shapes) == C
    monkeypatch.setenv("SPECRT_LONE_PREFILL", "maybe")
    with pytest.raises(ConfigError, match="SPECRT_LONE_PREFILL"):
        lone_prefill_tokens(entry, shapes)


def test_inspect_says_which_chunk_a_request_alone_runs(tiny_batch_rows_engines):
    from specrt.tools.describe import describe
    text = describe(mf.load(tiny_batch_rows_engines))
    assert "a request alone: prompt chunks of 64 tokens (the same bits as 16)" in text


def test_a_long_prompt_alone_gives_the_same_tokens_and_logprobs_in_either_chunk(tiny_batch_rows_engines):
    """The real rows graph: an 83-token prompt alone, in chunks of 64 (the default now) and of 16."""
    man = json.loads((tiny_batch_rows_engines / "manifest.json").read_text())
    C = man["shapes"]["prefill_chunk"]
    prompt = [int(t) for t in np.random.default_rng(3).integers(3, 100, 5 * C + 3)]
    runs = []
    for lone in (True, False):
        gen = open_batch(tiny_batch_rows_engines, max_num_seqs=2)
        try:
            eng = gen.engine
            assert eng.lone_prefill_tokens == 4 * C
            if not lone:
                eng.lone_prefill_tokens = eng.prefill_tokens
            done = gen.generate(prompt, max_new_tokens=8, logprobs=2)
            runs.append((done.tokens, [(lp.token, lp.logprob) for lp in done.logprobs], eng.stats.prefill_chunks))
        finally:
            gen.close()
    (ta, la, ca), (tb, lb, cb) = runs
    assert (ca, cb) == (2, 6)                   # 64 + 19 against 5 x 16 + 3: the larger chunks ran
    assert ta == tb and la == lb                # the same tokens, the same log-probabilities bit for bit
