"""Prompts of several requests in one call (issue 28: many requests at once): requests admitted
together share each prompt call, shortest prompt first, where the build showed a row's prompt
gives the same bits among others as alone (parity.prompt_rows, builder/gates/chunks.py).

The scheduling (who joins, what each call carries, rows leaving the group's front, cancelling
a row in the middle) on the toy model of fake_batch.py, whose rows never influence each other:
any difference from a request alone is the engine's. The gate and the runtime's reading of it
on the tiny folders: the rows graphs give the same bits, the "standard" fp32 graph does not
(a real non-invariant pair: one row a call), GroupQueryAttention prompt graphs are not checked.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from fake_batch import FakeLM, hold_until_added

from specrt import manifest as mf
from specrt.builder.gates import chunks
from specrt.errors import ConfigError, ManifestError
from specrt.runtime.backends.batch_calls import prompt_call, prompt_rows
from specrt.runtime.batch.engine import BatchEngine
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.policy import BatchPolicy
from specrt.runtime.batch.request import Delta, Done, Request
from specrt.runtime.choice import choose
from specrt.runtime.sampling import SamplingParams

V, EOS, C = 16, 15, 8
GREEDY = SamplingParams()


def _engine(prompt_rows=8, *, rows=6, lone=32, budget=None, static=False, min_rows=1, row_multiple=1):
    spare = int(row_multiple > 1)
    lm = FakeLM(V, rows + spare, 96, graph_tokens={"prefill": C if static else 0, "decode": 0, "verify": 0},
                min_rows=min_rows, row_multiple=row_multiple)
    eng = BatchEngine(lm, max_num_seqs=rows, max_context=80, prefill_tokens=C, k_max=3, vocab=V,
                      policy=BatchPolicy(None, 3), eos={EOS}, lone_prefill_tokens=lone, prefill_budget=budget,
                      prompt_rows=prompt_rows)
    return eng, lm


def _reference(lm, prompt, n):
    """The request alone with EOS an ordinary token (the requests here ignore it)."""
    seq, scratch = list(prompt), np.zeros(V, np.float32)
    for _ in range(n):
        seq.append(choose(lm.logits(seq), GREEDY, 0, len(seq), scratch))
    return seq[len(prompt):]


class Got:
    def __init__(self):
        self.tokens, self.done = [], None

    def __call__(self, ev):
        if isinstance(ev, Delta):
            self.tokens += ev.tokens
        elif isinstance(ev, Done):
            self.done = ev


def _submit(eng, prompt, n=6):
    g = Got()
    eng.add(Request(list(prompt), n, GREEDY, 0, sink=g, ignore_eos=True))
    return g


def _drain(eng, limit=3000):
    for _ in range(limit):
        if not eng.step() and eng.idle():
            return
    raise AssertionError("the engine did not finish")


def _prompt(n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(0, EOS, n)]


def _prefills(lm):
    return [(n, T, r) for g, n, T, r in lm.calls if g == "prefill"]


def _check(lm, prompts, got, n=6):
    for p, g in zip(prompts, got):
        assert g.done is not None and g.tokens == _reference(lm, p, n)


def test_prompts_admitted_together_share_calls_shortest_first_and_answer_as_alone():
    eng, lm = _engine()
    prompts = [_prompt(8, 1), _prompt(3, 2), _prompt(6, 3)]
    got = [_submit(eng, p) for p in prompts]
    while eng.admitting or eng.waiting:
        eng.step()
    assert not lm.cache.moves, "rows leaving the group's front need no K/V moves"
    _drain(eng)
    _check(lm, prompts, got)
    # one group of 3 (3 rows x 3 tokens <= the 32 a call may carry alone), shortest first: 3, 6, 8
    # tokens, each call as many tokens of every row as the shortest has left (no padding): the
    # 3-token prompt ends in the first call and joins the rows where it is (row 0), the 6-token one
    # in the second (row 1), the 8-token one finishes alone (row 2)
    assert _prefills(lm) == [(3, 3, 0), (2, 3, 1), (1, 2, 2)]


def test_one_row_a_call_without_the_gate():
    eng, lm = _engine(prompt_rows=1)
    prompts = [_prompt(8, 1), _prompt(3, 2), _prompt(6, 3)]
    got = [_submit(eng, p) for p in prompts]
    _drain(eng)
    _check(lm, prompts, got)
    assert all(n == 1 for n, _, _ in _prefills(lm))


def test_a_prompt_longer_than_a_chunk_is_admitted_alone():
    """Its chunks fill a call already; in a group it would advance beside the others instead of
    taking the step's budget, and its first token would come later."""
    eng, lm = _engine(budget=64)
    prompts = [_prompt(12, i) for i in range(3)] + [_prompt(5, 7)]
    got = [_submit(eng, p) for p in prompts]
    _drain(eng)
    _check(lm, prompts, got)
    assert all(n == 1 for n, _, _ in _prefills(lm))


def test_what_one_call_may_carry_bounds_the_group():
    # no budget, nothing running: a request alone's larger chunk (16 tokens): 3 rows of 5
    eng, lm = _engine(lone=16)
    got = [_submit(eng, _prompt(5, i)) for i in range(6)]
    eng.step()
    assert _prefills(lm) == [(3, 5, 0)]
    _drain(eng)
    _check(lm, [_prompt(5, i) for i in range(6)], got)
    # a prefill budget: rows x the shortest prompt within it, every call of the group too
    eng, lm = _engine(budget=6)
    prompts = [_prompt(2, 1), _prompt(8, 2), _prompt(8, 3)]
    got = [_submit(eng, p) for p in prompts]
    eng.step()
    assert _prefills(lm) == [(3, 2, 0)], "6 tokens a step: three rows of 2"
    eng.step()
    assert _prefills(lm)[1] == (2, 3, 1), "then 3 tokens of the two left: 6, not 2 x 6"
    _drain(eng)
    _check(lm, prompts, got)
    # beside running rows, no budget: one chunk's worth (8 tokens)
    eng, lm = _engine(lone=8)
    _submit(eng, _prompt(5, 9), n=40)
    while not eng.rows:
        eng.step()
    prompts = [_prompt(7, 1), _prompt(7, 2), _prompt(3, 3), _prompt(3, 4)]
    got = [_submit(eng, p) for p in prompts]
    _drain(eng)
    _check(lm, prompts, got)
    calls = [c for c in _prefills(lm) if c[2] >= 1]
    assert all(n * T <= 8 for n, T, _ in calls) and any(n == 2 for n, _, _ in calls), calls


def test_a_request_with_samples_is_admitted_alone():
    eng, lm = _engine()
    a = _submit(eng, _prompt(6, 1))
    eng.add(Request(_prompt(5, 2), 4, SamplingParams(temperature=1.0), 3, sink=Got(),
                    siblings=[Request(_prompt(5, 2), 4, SamplingParams(temperature=1.0), 4, sink=Got())]))
    _submit(eng, _prompt(7, 3))
    _drain(eng)
    assert a.tokens == _reference(lm, _prompt(6, 1), 6)
    assert _prefills(lm)[0][0] == 1, "the request before one with samples does not wait for it, nor join it"


def test_a_cancelled_row_in_the_middle_of_the_group_leaves_and_the_others_close_up():
    eng, lm = _engine()
    prompts = [_prompt(8, 1), _prompt(5, 2), _prompt(7, 3), _prompt(6, 4)]
    got = [_submit(eng, p) for p in prompts]
    eng.step()          # one call of 4 rows x 5 tokens: the 5-token prompt joins the rows (row 0)
    assert _prefills(lm) == [(4, 5, 0)] and [len(r.req.prompt) for r in eng.admitting] == [6, 7, 8]
    middle = eng.admitting[1]
    assert middle.req.prompt == prompts[2]
    middle.req.cancel()
    _drain(eng)
    assert got[2].done.finish_reason == "cancelled" and not got[2].tokens
    _check(lm, [prompts[i] for i in (0, 1, 3)], [got[i] for i in (0, 1, 3)])
    assert lm.cache.moves[0] == (3, 2, 5), "the last row closed up the gap (its 5 prompt tokens so far)"


def test_a_running_row_leaving_moves_the_whole_group_down_in_order():
    eng, lm = _engine(budget=6)
    first = _submit(eng, _prompt(3, 7), n=2)
    prompts = [_prompt(2, 1), _prompt(8, 2), _prompt(8, 3)]
    eng.step()                                  # alone: prefilled, its first token
    got = [_submit(eng, p) for p in prompts]
    eng.step()      # its last token; the group's first call (the 2-token prompt joins, row 1); it leaves
    assert first.done is not None and [r.req.prompt for r in eng.admitting] == prompts[1:]
    assert lm.cache.moves == [(1, 0, 2), (2, 1, 2), (3, 2, 2)], "the last running row, then the group, in order"
    _drain(eng)
    _check(lm, prompts, got)


def test_a_model_that_pads_odd_calls_and_needs_two_rows_keeps_every_answer():
    eng, lm = _engine(min_rows=2, row_multiple=2)
    prompts = [_prompt(n, i) for i, n in enumerate((7, 3, 5))]
    got = [_submit(eng, p) for p in prompts]
    _drain(eng)
    _check(lm, prompts, got)
    # 3 rows x 3 tokens: an odd call, padded with row 3 (a free row)
    assert _prefills(lm)[0] == (3, 3, 0) and lm.pads and lm.pads[0][0] == 3


def _fail_on_raise(eng, limit=20):
    """Step as the generator's thread does: a step that raises fails every request."""
    for _ in range(limit):
        try:
            eng.step()
        except Exception as e:
            eng.fail_all(e)
        if eng.idle():
            return
    raise AssertionError("the engine did not finish")


def test_a_first_token_that_raises_leaves_no_request_untold():
    """The group's rows whose prompt ended are rows before any of them gets its first token: when
    one raises (NaN logits under sampling), fail_all tells every request."""
    eng, lm = _engine()
    bad, real = [1, 2, 3, 4], lm.logits
    lm.logits = lambda p: np.full(V, np.nan, np.float32) if list(p) == bad else real(p)
    seen = {}
    for i, p in enumerate([bad, [5, 6, 7, 8], [9, 10, 11, 12]]):
        seen[i] = []
        eng.add(Request(p, 4, SamplingParams(temperature=1.0), i, sink=seen[i].append))
    _fail_on_raise(eng)
    assert _prefills(lm)[0] == (3, 4, 0)
    assert all(len(evs) == 1 and type(evs[0]).__name__ == "Failed" for evs in seen.values()), seen


def test_a_row_that_cannot_be_made_leaves_its_group_waiting(monkeypatch):
    """Admission makes a group's rows while its requests still wait: one that raises loses none."""
    from specrt.runtime.batch import admission
    eng, _ = _engine()
    real = admission.Row

    def row(req, *a, **kw):
        if len(req.prompt) == 6:
            raise RuntimeError("no row")
        return real(req, *a, **kw)
    monkeypatch.setattr(admission, "Row", row)
    seen = {}
    for i, n in enumerate((3, 6, 5)):
        seen[i] = []
        eng.add(Request(_prompt(n, i), 4, GREEDY, 0, sink=seen[i].append))
    _fail_on_raise(eng)
    assert all(len(evs) == 1 and type(evs[0]).__name__ == "Failed" for evs in seen.values()), seen


def test_no_group_beside_a_draft_model_of_its_own():
    """(It would prefill the group's prompts too, through a graph that may take one row a call.)"""
    lm = FakeLM(V, 6, 96, graph_tokens={"prefill": 0, "decode": 0, "verify": 0})
    draft = FakeLM(V, 6, 96, salt=b"draft", graph_tokens={"prefill": 0, "decode": 0, "verify": 0})
    eng = BatchEngine(lm, max_num_seqs=6, max_context=80, prefill_tokens=C, k_max=3, vocab=V,
                      policy=BatchPolicy(None, 3, draft=True), eos={EOS}, draft=draft, lone_prefill_tokens=32,
                      prompt_rows=8)
    prompts = [_prompt(n, i) for i, n in enumerate((8, 3, 6))]
    got = [_submit(eng, p) for p in prompts]
    _drain(eng)
    _check(lm, prompts, got)
    assert all(n == 1 for n, _, _ in _prefills(lm))


def test_a_static_prompt_graph_runs_one_row_a_call_and_bad_values_are_refused():
    eng, _ = _engine(static=True)
    assert eng.prompt_rows == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="prompt_rows"):
            _engine(prompt_rows=bad)


def test_the_call_shape_rule():
    assert prompt_call([4, 2, 1], 1, 1, 1) == (4, [3, 1, 0])
    assert prompt_call([1, 1], 2, 1, 2) == (2, [0, 0])         # every row's P positions fit
    assert prompt_call([3], 1, 2, 8) == (8, [2])               # min_rows activation rows in all
    assert prompt_call([3, 3], 1, 5, 1) == (5, [2, 2])         # min_tokens


# --- the gate and the runtime's reading of it, on the tiny folders --------------------------------

def test_the_gate_on_real_graphs(tiny_batch_rows_engines, tiny_batch_standard_engines, tiny_batch_int4_engines):
    rows = mf.load(tiny_batch_rows_engines).models["batch"]
    rec = rows.parity["prompt_rows"]
    assert rec["equal"] is True and rec["rows"] == chunks.GROUP and rec["max_abs_kv_delta"] == 0.0
    assert prompt_rows(rows) > 1
    # fp32 "standard" attention (a mask over the whole cache): a padded chunk among others rounds apart
    std = mf.load(tiny_batch_standard_engines).models["batch"]
    assert std.parity["prompt_rows"]["equal"] is False and std.parity["prompt_rows"]["max_abs_logit_delta"] > 0
    assert prompt_rows(std) == 1
    gqa = mf.load(tiny_batch_int4_engines).models["batch"]
    assert gqa.parity["prompt_rows"]["equal"] is None and "GroupQueryAttention" in gqa.parity["prompt_rows"]["why"]
    assert prompt_rows(gqa) == 1


def test_the_gate_compares_every_row_bit_for_bit(monkeypatch, tiny_batch_rows_engines):
    """A model whose prompt calls of several rows move one K/V entry of one row by 1e-7 is
    recorded unequal: the gate reads each row's K/V, not only the logits."""
    man = mf.load(tiny_batch_rows_engines)
    entry = man.models["batch"]
    real = chunks._feed_group

    def nudged(model, first_row, prompts, chunk, min_tokens):
        out = real(model, first_row, prompts, chunk, min_tokens)
        out[2][1][0][0, 0, 0] += 1e-7
        return out

    monkeypatch.setattr(chunks, "_feed_group", nudged)
    from specrt.builder.steps import prompt_ids
    from specrt.runtime.tokenizer import Tokenizer
    prompts = prompt_ids(Tokenizer(tiny_batch_rows_engines, man.tokenizer), int(entry.dims["vocab"]))
    got = chunks.prompt_rows(tiny_batch_rows_engines, entry, man.shapes, prompts)
    assert got["equal"] is False and got["max_abs_kv_delta"] > 0 and got["max_abs_logit_delta"] == 0.0


def test_the_runtime_reads_the_record(monkeypatch, tiny_batch_rows_engines):
    entry = mf.load(tiny_batch_rows_engines).models["batch"]

    def with_record(rec):
        parity = {k: v for k, v in entry.parity.items() if k != "prompt_rows"}
        return entry.__class__(**{**entry.__dict__, "parity": parity if rec is None else {**parity, "prompt_rows": rec}})
    assert prompt_rows(with_record(None)) == 1                      # folders built before the gate
    assert prompt_rows(with_record({"equal": False})) == 1
    for bad in ("yes", {"equal": "true"}, {"rows": 5}):
        with pytest.raises(ManifestError, match="rebuild"):
            prompt_rows(with_record(bad))
    monkeypatch.setenv("SPECRT_PROMPT_ROWS", "3")
    assert prompt_rows(entry) == 3
    monkeypatch.setenv("SPECRT_PROMPT_ROWS", "0")
    with pytest.raises(ConfigError, match="SPECRT_PROMPT_ROWS"):
        prompt_rows(entry)


def _burst(folder, prompts, monkeypatch, n=8):
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    calls, real = [], OrtBatchModel.step

    def counted(self, graph, tokens, *a, **kw):
        calls.append((graph, tokens.shape[0]))
        return real(self, graph, tokens, *a, **kw)

    OrtBatchModel.step = counted
    try:
        with open_batch(folder, max_num_seqs=len(prompts), threads=2, speculate=False) as gen:
            hold_until_added(gen.engine, len(prompts), monkeypatch)     # all wait before the first is admitted
            handles = [gen.submit(list(p), max_new_tokens=n, ignore_eos=True) for p in prompts]
            out = [h.result().tokens for h in handles]
    finally:
        OrtBatchModel.step = real
    return out, max(r for g, r in calls if g == "prefill")


def test_a_burst_on_the_rows_graph_answers_as_one_row_a_call(tmp_path, monkeypatch, tiny_batch_rows_engines):
    """The real graph: requests submitted together, their prompts in calls of several rows, give
    the tokens of the same requests with one prompt row a call (the record edited off in a copy)."""
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(3, 120, n)] for n in (5, 12, 9, 16, 3)]     # within a chunk (16)
    grouped, widest = _burst(tiny_batch_rows_engines, prompts, monkeypatch)
    assert widest > 1, "the requests' prompts never shared a call"
    one = tmp_path / "one"
    shutil.copytree(tiny_batch_rows_engines, one)
    m = json.loads((one / "manifest.json").read_text())
    m["models"]["batch"]["parity"]["prompt_rows"]["equal"] = False
    (one / "manifest.json").write_text(json.dumps(m))
    alone, widest1 = _burst(one, prompts, monkeypatch)
    assert widest1 == 1
    assert grouped == alone and all(len(t) == 8 for t in grouped)
