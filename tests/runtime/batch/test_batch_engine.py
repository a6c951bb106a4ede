"""The batched engine on a toy model (fake_batch.py): every request's tokens equal the
same request run alone, whatever joins, leaves, stops or is cancelled around it, under
every per-step speculation choice; a seeded sample does not depend on its batch; the
scheduler admits, chunks and evicts as documented (fake clock, counted calls)."""
from __future__ import annotations

import numpy as np
import pytest
from fake_batch import FakeLM, FakeTokenizer

from specrt.runtime.choice import choose
from specrt.runtime.batch.engine import BatchEngine
from specrt.runtime.batch.policy import BatchCosts, BatchPolicy
from specrt.runtime.batch.request import Delta, Done, Request
from specrt.runtime.proposers import Chain, OneGram, PromptLookup
from specrt.runtime.sampling import SamplingParams

V, EOS, K = 16, 15, 3
GREEDY = SamplingParams()
# costs that make speculation pay: plain steps cost as much as 2-token steps, verify a bit more
COSTS = BatchCosts({1: {1: 10.0, 8: 16.0}, 2: {1: 10.0, 8: 16.0}, 4: {1: 12.0, 8: 20.0}}, draft={1: 2.0, 8: 3.0})


def reference(lm: FakeLM, prompt, n, params=GREEDY, seed=0, eos=EOS):
    """The request alone: one target choice per position, no batch, no speculation."""
    seq, out, scratch = list(prompt), [], np.zeros(lm.vocab, np.float32)
    for _ in range(n):
        y = choose(lm.logits(seq), params, seed, len(seq), scratch)
        seq.append(y)
        if y == eos:
            return out, "eos"
        out.append(y)
    return out, "length"


class Collect:
    def __init__(self):
        self.tokens, self.text, self.done = [], "", None

    def __call__(self, ev):
        if isinstance(ev, Delta):
            assert self.done is None, "a Delta after Done"
            self.tokens += ev.tokens
            self.text += ev.text
        elif isinstance(ev, Done):
            assert self.done is None, "two Done events"
            self.done = ev
        else:
            raise AssertionError(ev)


def make_engine(rows=3, *, costs=COSTS, draft=True, lookup=True, tokenizer=None, capacity=96, min_rows=1,
                graph_tokens=None, clock=None, prefill=8, row_multiple=1, own_draft=False):
    """own_draft: the draft is a separate model with its own cache (else it writes the target's)."""
    graph_tokens = graph_tokens or {"prefill": prefill, "decode": 0, "verify": 0}
    spare = int(row_multiple > 1)          # as OrtBatchModel: one cache row past max_num_seqs for padding
    target = FakeLM(V, rows + spare, capacity, graph_tokens=graph_tokens, min_rows=min_rows, row_multiple=row_multiple)
    d = FakeLM(V, rows + spare, capacity, salt=b"draft", sharpness=1.0, cache=None if own_draft else target.cache,
               graph_tokens={"prefill": 0, "decode": 0, "verify": 0} if own_draft else {"decode": 0},
               row_multiple=row_multiple) if draft else None
    if d is not None:                      # the draft agrees with the target often: mix their logits
        base = d.logits
        d.logits = lambda prefix: 0.8 * target.logits(prefix) + 0.2 * base(prefix)
    policy = BatchPolicy(costs, K, lookup=PromptLookup(2, K) if lookup else None,
                         pair_guess=Chain([OneGram()]) if lookup else None, draft=draft)
    kw = {"clock": clock} if clock else {}
    eng = BatchEngine(target, max_num_seqs=rows, max_context=capacity - max(prefill, K + 1), prefill_tokens=prefill,
                      k_max=K, vocab=V, policy=policy, tokenizer=tokenizer, eos={EOS}, draft=d, **kw)
    return eng, target


def submit(eng, prompt, n, params=GREEDY, seed=0, **kw):
    c = Collect()
    eng.add(Request(list(prompt), n, params, seed, sink=c, **kw))
    return c


def drain(eng, limit=5000):
    for _ in range(limit):
        if not eng.step() and eng.idle():
            return
    raise AssertionError("the engine did not finish")


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 4, 5, 6], [2] * 5 + [3, 2, 2, 2], list(range(14)),
           [7, 7, 7, 1, 7, 7, 7], [9, 1, 9, 1, 9, 1, 9, 1, 9, 1, 9, 1, 9, 1, 9, 1, 9, 1, 9, 1]]


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("speculate", ["none", "lookup", "draft"])
def test_greedy_tokens_equal_each_request_alone(rows, speculate):
    eng, lm = make_engine(rows, costs=None if speculate == "none" else COSTS, draft=speculate == "draft",
                          lookup=speculate != "none")
    got = [submit(eng, p, 10 + 3 * i) for i, p in enumerate(PROMPTS)]   # rows join and leave at different steps
    drain(eng)
    for i, (p, c) in enumerate(zip(PROMPTS, got)):
        want, reason = reference(lm, p, 10 + 3 * i)
        assert (c.tokens, c.done.finish_reason) == (want, reason), i
    kinds = eng.stats.choices
    if speculate != "none":
        assert set(kinds) - {"plain"}, kinds          # the policy did speculate
        assert sum(c.done.metrics.accepted for c in got) > 0
    if rows > 1:
        assert eng.stats.occupancy > 1.2, eng.stats


@pytest.mark.parametrize("speculate", ["none", "draft"])     # (lookup rounds run 2 or k+1 tokens a row: even)
def test_padding_rows_of_odd_calls_write_where_no_request_reads(speculate):
    """A model that pads odd calls to an even number of rows (--batch-block-size: manifest
    io row_multiple 2) writes one padding row after the running rows. The engine points it at
    the length of the row being prefilled there (its next chunk overwrites it) or at a free row:
    every request still equals itself alone, and some padding did land on a half-prefilled row."""
    eng, lm = make_engine(4, costs=None if speculate == "none" else COSTS, draft=speculate == "draft",
                          lookup=speculate != "none", row_multiple=2)      # 3 running + 1 being prefilled
    got = [submit(eng, p, 10 + 3 * i) for i, p in enumerate(PROMPTS)]
    drain(eng)
    for i, (p, c) in enumerate(zip(PROMPTS, got)):
        assert (c.tokens, c.done.finish_reason) == reference(lm, p, 10 + 3 * i), i
    pads = lm.pads + (eng.draft.pads if eng.draft is not None else [])
    assert pads, "no odd call was padded"
    assert any(start > 0 for _, start, _ in pads), "no padding row landed on a row being prefilled"


def test_requests_added_while_others_run_join_mid_generation():
    eng, lm = make_engine(3)
    first = [submit(eng, p, 20) for p in PROMPTS[:2]]
    for _ in range(6):
        eng.step()
    later = [submit(eng, p, 12) for p in PROMPTS[2:5]]
    drain(eng)
    for p, n, c in zip(PROMPTS[:5], (20, 20, 12, 12, 12), first + later):
        assert (c.tokens, c.done.finish_reason) == reference(lm, p, n)


@pytest.mark.parametrize("rows", [1, 3])
def test_a_seeded_sample_is_the_same_whatever_the_batch(rows):
    params = SamplingParams(temperature=0.9, top_p=0.95)
    alone = {}
    for seed in range(4):
        eng, lm = make_engine(1, costs=None)
        c = submit(eng, PROMPTS[1], 16, params, seed)
        drain(eng)
        alone[seed] = c.tokens
        assert (c.tokens, c.done.finish_reason)[0] == reference(lm, PROMPTS[1], 16, params, seed)[0]
    eng, lm = make_engine(rows)
    mixed = {}
    for seed in range(4):        # interleaved with greedy and other sampled requests
        submit(eng, PROMPTS[seed % 3], 9, SamplingParams(temperature=1.3), seed + 100)
        mixed[seed] = submit(eng, PROMPTS[1], 16, params, seed)
        submit(eng, PROMPTS[4], 7)
    drain(eng)
    assert {s: c.tokens for s, c in mixed.items()} == alone
    assert len({tuple(v) for v in alone.values()}) > 1         # seeds do change the sample


def test_stop_strings_cancellation_and_timeouts_free_their_rows():
    now = [0.0]
    eng, lm = make_engine(2, tokenizer=FakeTokenizer(EOS), clock=lambda: now[0])
    full, _ = reference(lm, PROMPTS[3], 30)
    text = "".join(chr(ord("a") + t % 26) for t in full)
    stop = text[5:7]
    a = submit(eng, PROMPTS[3], 30, stop=(stop,))
    b = submit(eng, PROMPTS[1], 30)
    c = submit(eng, PROMPTS[2], 30, deadline=5.0)
    d = submit(eng, PROMPTS[0], 12)
    for _ in range(4):
        eng.step()
    b_req = next(r.req for r in eng.rows if r.req.sink is b)
    b_req.cancel()
    now[0] = 10.0                                     # c's deadline passes (waiting or running)
    drain(eng)
    assert a.done.finish_reason == "stop" and a.text == text[:text.find(stop)]
    assert b.done.finish_reason == "cancelled" and len(b.tokens) < 30
    assert c.done.finish_reason == "timeout"
    assert (d.tokens, d.done.finish_reason) == reference(lm, PROMPTS[0], 12)
    assert eng.idle() and not eng.rows and eng.pending is None


@pytest.mark.parametrize("text", [False, True], ids=["tokens", "text"])
def test_stop_token_ids_and_ignore_eos_are_per_request(text):
    """A stop token ends its request with "stop" and is left out (vLLM's stop_token_ids);
    ignore_eos runs through EOS to the budget; the requests beside them are unchanged."""
    eng, lm = make_engine(3, tokenizer=FakeTokenizer(EOS) if text else None)
    n = 40
    p = next((q for q in PROMPTS if reference(lm, q, n)[1] == "eos"), None)
    assert p is not None, "no prompt reaches EOS: the ignore_eos check would mean nothing"
    through, _ = reference(lm, p, n, eos=None)       # the tokens when EOS is ignored
    at = through.index(EOS)
    assert at + 1 < n
    full, _ = reference(lm, PROMPTS[3], 30)
    stop_id = full[6]
    cut = full.index(stop_id)
    a = submit(eng, p, n, ignore_eos=True)
    b = submit(eng, PROMPTS[3], 30, stop_token_ids=frozenset({stop_id}))
    c = submit(eng, p, n)
    drain(eng)
    assert a.done.finish_reason == "length" and a.done.completion_tokens == n
    assert a.tokens == through and EOS in a.tokens
    assert b.done.finish_reason == "stop" and b.tokens == full[:cut]
    assert (c.tokens, c.done.finish_reason) == reference(lm, p, n)
    if text:     # EOS is an ordinary token whose text is empty
        assert a.text == "".join(chr(ord("a") + t % 26) for t in through if t != EOS)
        assert b.text == "".join(chr(ord("a") + t % 26) for t in full[:cut])


def test_a_long_prompt_is_prefilled_one_chunk_per_step_while_the_others_decode():
    eng, lm = make_engine(2, costs=None, prefill=4)
    short = submit(eng, [1, 2, 3], 40)
    eng.step()                                       # its single prefill chunk: it runs from now on
    long_prompt = list(range(1, 15)) * 2             # 28 tokens: 7 chunks of 4
    long = submit(eng, long_prompt, 5)
    lm.calls.clear()
    before = len(short.tokens)
    for step in range(7):
        eng.step()
        graphs = [g for g, *_ in lm.calls]
        assert graphs.count("prefill") == 1 and graphs.count("decode") == 1, lm.calls   # one chunk, one step
        assert len(short.tokens) == before + step + 1                                  # never stalled
        lm.calls.clear()
    assert eng.pending is None and len(eng.rows) == 2
    drain(eng)
    assert (long.tokens, long.done.finish_reason) == reference(lm, long_prompt, 5)


@pytest.mark.parametrize("speculate", ["none", "draft"])
def test_a_prefill_budget_admits_several_prompts_a_step_and_changes_no_answer(speculate):
    """prefill_budget=12 with chunks of 4: one step prefills up to 12 prompt tokens, chunk after
    chunk and request after request (each chunk its own one-row call); four requests arriving
    together all run after the first step (one with None), a long prompt takes its 7
    chunks in 3 steps, and every answer is the request alone (None: one chunk a step)."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2, 2, 3]]
    for budget, joined in ((None, 1), (12, 4)):
        eng, lm = make_engine(4, costs=COSTS if speculate == "draft" else None, prefill=4,
                              draft=speculate == "draft", lookup=False)
        eng.prefill_budget = budget
        outs = [submit(eng, p, 10) for p in prompts]
        eng.step()
        assert len(eng.rows) == joined, (budget, len(eng.rows))     # after the first step
        assert all(n == 1 for g, n, T, _ in lm.calls if g == "prefill")          # one row a prefill call
        drain(eng)
        for p, c in zip(prompts, outs):
            assert (c.tokens, c.done.finish_reason) == reference(lm, p, 10), (budget, p)
    eng, lm = make_engine(2, costs=None, prefill=4)
    eng.prefill_budget = 12
    long_prompt = list(range(1, 15)) * 2             # 28 tokens: 7 chunks of 4, 3 a step
    long = submit(eng, long_prompt, 5)
    steps = 0
    while eng.pending is not None or not eng.rows:
        eng.step()
        steps += 1
    assert steps == 3 and lm.calls.count(("prefill", 1, 4, 0)) == 7
    drain(eng)
    assert (long.tokens, long.done.finish_reason) == reference(lm, long_prompt, 5)
    with pytest.raises(ValueError, match="prefill_budget"):
        BatchEngine(lm, max_num_seqs=2, max_context=80, prefill_tokens=4, k_max=K, vocab=V,
                    policy=BatchPolicy(None, K), prefill_budget=0)


def test_a_row_that_leaves_is_replaced_by_the_last_one_and_both_stay_correct():
    eng, lm = make_engine(3, costs=None)
    cs = [submit(eng, p, n) for p, n in zip(PROMPTS[:3], (4, 25, 25))]   # the first leaves early
    drain(eng)
    assert any(dst == 0 for _, dst, _ in eng.target.cache.moves), eng.target.cache.moves
    for p, n, c in zip(PROMPTS[:3], (4, 25, 25), cs):
        assert (c.tokens, c.done.finish_reason) == reference(lm, p, n)


def test_a_model_whose_single_row_path_differs_never_runs_one_row():
    eng, lm = make_engine(2, costs=None, min_rows=2)
    c = submit(eng, PROMPTS[0], 8)
    drain(eng)
    assert all(n * T >= 2 for _, n, T, _ in lm.calls) and (c.tokens, c.done.finish_reason) == reference(
        lm, PROMPTS[0], 8)


def test_the_maximum_context_ends_a_request_with_its_reason():
    eng, lm = make_engine(1, costs=None, capacity=32)     # max_context = 32 - 8 = 24
    prompt = list(range(1, 15))
    want, reason = reference(lm, prompt, 10)
    assert reason == "length", "pick a prompt whose first 10 tokens hold no EOS"
    c = submit(eng, prompt, 50)
    drain(eng)
    assert c.done.finish_reason == "max_context" and c.tokens == want


def test_cost_interpolation_between_measured_row_counts():
    c = BatchCosts({1: {1: 10.0, 4: 16.0, 8: 24.0}})
    assert c.target(1, 1) == 10.0 and c.target(2, 1) == pytest.approx(12.0) and c.target(6, 1) == pytest.approx(20.0)
    assert c.target(16, 1) == pytest.approx(40.0)       # beyond: the last segment extended
    assert BatchCosts.from_manifest({}) is None     # damaged tables: test_manifest_costs_validation.py


def _exact_triples(lm, prompt, params):
    """The exact joint distribution of the first three sampled tokens: [V**3]."""
    from specrt.runtime.sampling import probs_from_logits
    buf = np.zeros(V, np.float32)

    def p(prefix):
        return probs_from_logits(lm.logits(prefix), params, buf).astype(np.float64).copy()

    out = np.zeros(V ** 3)
    p1 = p(prompt)
    for a in np.flatnonzero(p1):
        if a == EOS:                              # the request ends: padded with EOS
            out[(EOS * V + EOS) * V + EOS] += p1[a]
            continue
        p2 = p(prompt + [a])
        for b in np.flatnonzero(p2):
            if b == EOS:
                out[(a * V + EOS) * V + EOS] += p1[a] * p2[b]
                continue
            out[(a * V + b) * V:(a * V + b + 1) * V] += p1[a] * p2[b] * p(prompt + [a, b])
    return out / out.sum()


@pytest.mark.parametrize("draft", ["shared cache", "own cache"])
def test_sampled_rows_in_a_batch_follow_the_targets_distribution_exactly(monkeypatch, draft):
    """Unseeded requests (a fresh seed each), sharing steps with other rows under lookup, pair and
    draft rounds (the draft writing the target's cache, or a draft model with its own): the first
    three tokens' joint frequencies (the 2nd and 3rd can come from a proposal) against the exact
    distribution. The same check fails for a rule that keeps every proposed token."""
    from goodness_of_fit import P_VALUE_CEILING, goodness_of_fit
    params = SamplingParams(temperature=1.0, top_k=4)
    prompt = [3, 4, 3, 4, 3, 4, 3]          # repeats: lookup and pair rounds have guesses
    lm = FakeLM(V, 1, 96)
    exact = _exact_triples(lm, prompt, params)

    def counts(n=3000):
        eng, _ = make_engine(4, own_draft=draft == "own cache")
        cs = [submit(eng, prompt, 3, params, seed=s) for s in range(n)]
        for s in range(n // 50):
            submit(eng, PROMPTS[s % 6], 6, SamplingParams(temperature=0.7), seed=10_000 + s)
        drain(eng, limit=100_000)
        c = np.zeros(V ** 3)
        for x in cs:
            toks = x.tokens + [EOS] * (3 - len(x.tokens))
            c[(toks[0] * V + toks[1]) * V + toks[2]] += 1
        return c, eng.stats.choices, sum(x.done.metrics.accepted for x in cs)

    c, kinds, accepted = counts()
    fit = goodness_of_fit(c, exact)
    assert fit.passes, fit
    assert set(kinds) - {"plain"} and accepted > 300, (kinds, accepted)
    assert kinds["draft"] > 0, kinds

    import specrt.runtime.batch.engine as engine_mod
    real = engine_mod.first_mismatch

    def keep_all(logits, proposal, params, seed, position, scratch):   # wrong: keeps every proposed token
        k = len(proposal)
        return k, real(logits[k:], (), params, seed, position + k, scratch)[1]

    monkeypatch.setattr(engine_mod, "first_mismatch", keep_all)
    bad = goodness_of_fit(counts()[0], exact)
    assert not bad.passes and bad.p_value < P_VALUE_CEILING, bad


def test_poll_cancel_ends_a_waiting_request_unprefilled_and_a_failing_poll_is_dropped(caplog):
    """poll_cancel (Triton's is_cancelled) is asked at every step: True ends the request where
    it is, even before it has a row; a poll that raises is logged, dropped, and its request runs on."""
    eng, lm = make_engine(1)
    asked = []
    running = submit(eng, PROMPTS[1], 12)
    waiting = submit(eng, PROMPTS[0], 12, poll_cancel=lambda: asked.append(1) or len(asked) >= 2)

    def broken():
        raise RuntimeError("the server's handle is gone")
    flaky = submit(eng, PROMPTS[2], 5, poll_cancel=broken)
    drain(eng)
    assert waiting.done.finish_reason == "cancelled" and waiting.tokens == [] and len(asked) == 2
    assert eng.stats.prefill_chunks == 2 + 2                 # 13 + 9 prompt tokens in chunks of 8: never the cancelled one
    assert (running.tokens, running.done.finish_reason) == reference(lm, PROMPTS[1], 12)
    assert (flaky.tokens, flaky.done.finish_reason) == reference(lm, PROMPTS[2], 5)
    assert "poll_cancel failed" in caplog.text
