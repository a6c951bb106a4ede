"""How a batched request ends when something goes wrong around it: a step that raises fails
every request (running, being prefilled, waiting), so no caller waits for ever; a request
cancelled or timed out during its prompt's prefill, or between two of its rounds, ends there
(no further chunk or round, its reason kept) and frees its row at once; the queue
admits exactly max_num_seqs + max_queue requests. The engine thread only steps when a test
lets it (fake_batch.StepGate, hold_until_added), and deadlines run on a fake clock."""
from __future__ import annotations

import pytest
from fake_batch import StepGate, hold_until_added
from test_batch_engine import PROMPTS, drain, make_engine, reference, submit

from specrt.errors import OverloadedError, SpecrtError
from specrt.runtime.batch.generator import BatchGenerator


def test_a_step_that_raises_fails_the_running_the_prefilling_and_the_waiting_requests(monkeypatch):
    """2 rows, 5 requests, all queued before the first step: step 1 prefills A; step 2 admits B
    and A's round raises. A runs, B is being prefilled, C, D, E wait: each handle's result()
    raises the error (a regression that forgets the waiting ones times out instead of hanging)."""
    eng, lm = make_engine(2, costs=None, draft=False, lookup=False)      # plain rounds: target.step("decode")
    real, broken, seen = lm.step, [True], []

    def step(graph, *a, **k):
        if broken[0] and graph != "prefill":
            seen.append((len(eng.rows), eng.pending is not None, eng.queued))
            raise RuntimeError("boom: the device went away")
        return real(graph, *a, **k)

    monkeypatch.setattr(lm, "step", step)
    g = BatchGenerator(eng, None)
    try:
        hold_until_added(eng, 5, monkeypatch)
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9], [2, 2]]
        handles = [g.submit(p, max_new_tokens=20) for p in prompts]
        for i, h in enumerate(handles):
            with pytest.raises(SpecrtError, match="boom"):
                h.result(timeout=60)
        assert seen == [(1, True, 3)]            # one running, one being prefilled, three waiting
        assert eng.idle()
        broken[0] = False                        # the engine serves the next request
        assert g.submit([1, 2, 3], max_new_tokens=6).result(timeout=60).tokens == reference(lm, [1, 2, 3], 6)[0]
    finally:
        g.close()


@pytest.mark.parametrize("how", ["cancelled", "timeout"])
def test_a_request_ended_during_its_prefill_ends_then_with_no_tokens_and_frees_its_row(how):
    """A 28-token prompt prefills in 7 chunks of 4. Cancelled (or past its deadline on the fake
    clock) after its first chunk: the next step ends it with no tokens and runs no more of its
    chunks; the request waiting behind it takes its row; the running one is unchanged."""
    now = [0.0]
    eng, lm = make_engine(2, prefill=4, clock=lambda: now[0])
    short = submit(eng, [1, 2, 3], 30)
    eng.step()                                           # short: one chunk, then it runs in row 0
    long_prompt = list(range(1, 15)) * 2
    long = submit(eng, long_prompt, 10, deadline=5.0 if how == "timeout" else None)
    after = submit(eng, PROMPTS[0], 8)                   # waits: row 1 is long's
    eng.step()
    assert eng.pending is not None and eng.pending.req.sink is long and eng.pending.length == 4
    chunks = eng.stats.prefill_chunks
    if how == "cancelled":
        eng.pending.req.cancel()
    else:
        now[0] = 10.0
    eng.step()
    assert long.done is not None and long.done.finish_reason == how
    assert long.done.completion_tokens == 0 and long.tokens == [] and long.done.prompt_tokens == len(long_prompt)
    # none of its chunks ran after: the one chunk of this step is the waiting request's, which
    # took row 1 in the same step (its prompt fits one chunk, so it already runs there)
    assert eng.stats.prefill_chunks == chunks + 1 and eng.pending is None
    assert [r.req.sink for r in eng.rows] == [short, after]
    drain_steps = 0
    while not eng.idle():
        eng.step()
        drain_steps += 1
        assert drain_steps < 1000
    assert long.tokens == []                             # (Collect fails on a Delta after Done)
    assert (short.tokens, short.done.finish_reason) == reference(lm, [1, 2, 3], 30)
    assert (after.tokens, after.done.finish_reason) == reference(lm, PROMPTS[0], 8)


@pytest.mark.parametrize("rows, max_queue", [(1, 1), (3, 2)])
def test_the_queue_admits_exactly_max_num_seqs_plus_max_queue_requests(rows, max_queue, monkeypatch):
    """Each of `rows` requests is submitted and given one step (one prompt chunk: it holds a row),
    then max_queue more wait: all accepted; the next one is refused with OverloadedError, and
    every accepted one is then served."""
    eng, lm = make_engine(rows)
    gate = StepGate(eng, monkeypatch)
    g = BatchGenerator(eng, None, max_queue=max_queue)
    prompts = [[1 + i, 2, 3] for i in range(rows + max_queue + 1)]
    try:
        handles = []
        for p in prompts[:rows]:
            handles.append(g.submit(p, max_new_tokens=40, ignore_eos=True))
            gate.run(1)
        assert (len(eng.rows), eng.pending, eng.queued) == (rows, None, 0)
        handles += [g.submit(p, max_new_tokens=40, ignore_eos=True) for p in prompts[rows:-1]]
        assert eng.queued == max_queue
        with pytest.raises(OverloadedError, match=f"max_queue={max_queue}"):
            g.submit(prompts[-1], max_new_tokens=40, ignore_eos=True)
        gate.free()
        for p, h in zip(prompts, handles):
            assert h.result(timeout=60).tokens == reference(lm, p, 40, eos=None)[0]
    finally:
        gate.free()
        g.close()


@pytest.mark.parametrize("how", ["cancelled", "timeout"])
def test_a_running_request_ended_between_steps_gets_no_further_round_and_keeps_its_reason(how):
    """Cancelled (or past its deadline) after its round of step s, a running row leaves at step
    s + 1 before any round: no token is added, its reason is not overwritten by the budget it
    would have reached in that round ("length"), and its row is free for the request waiting in
    that same step."""
    now = [0.0]
    eng, lm = make_engine(1, costs=None, draft=False, lookup=False, clock=lambda: now[0])   # one token a round
    run = submit(eng, PROMPTS[0], 4, ignore_eos=True, deadline=5.0 if how == "timeout" else None)
    while len(run.tokens) < 3:                   # one token short of its budget
        eng.step()
    wait = submit(eng, PROMPTS[1], 5)
    if how == "cancelled":
        eng.rows[0].req.cancel()
    else:
        now[0] = 10.0
    eng.step()
    assert run.done is not None and (run.done.finish_reason, run.done.completion_tokens) == (how, 3)
    assert len(run.tokens) == 3
    assert eng.pending is not None and eng.pending.req.sink is wait    # admitted in the same step
    drain(eng)
    assert (wait.tokens, wait.done.finish_reason) == reference(lm, PROMPTS[1], 5)


def test_closing_cancels_a_request_caught_between_the_queue_and_its_row(monkeypatch):
    """close() from another thread may land while the engine thread is admitting a request
    (admission.py _admit: its row is made while it still waits, then it leaves the queue for the
    rows being prefilled, for a moment in neither list, so the owner's snapshot may miss it). The
    engine's `closing` flag cancels every request it holds at the next step, in whatever state:
    the request ends "cancelled", not with its whole answer."""
    import specrt.runtime.batch.admission as admission_mod
    eng, lm = make_engine(1, costs=None, draft=False, lookup=False)
    real_row, landed = admission_mod.Row, []

    def row(req, *a, **k):
        if not landed:               # the first Row made is _admit's: the request is on its way to its row
            assert eng.pending is None and not eng.rows
            eng.closing = True       # what BatchGenerator.close() sets
            landed.append(req)
        return real_row(req, *a, **k)

    monkeypatch.setattr(admission_mod, "Row", row)
    got = submit(eng, [1, 2, 3], 30)
    steps = 0
    while not eng.idle():
        eng.step()
        steps += 1
        assert steps < 1000
    assert landed and got.done is not None and got.done.finish_reason == "cancelled"
    assert len(got.tokens) < 30 and got.tokens == reference(lm, [1, 2, 3], 30)[0][:len(got.tokens)]


def test_close_sets_the_engines_closing_flag():
    eng, _ = make_engine(1, costs=None, draft=False, lookup=False)
    g = BatchGenerator(eng, None)
    assert not eng.closing
    g.close()
    assert eng.closing


def test_a_request_submitted_as_close_begins_is_answered_or_refused_never_lost(monkeypatch):
    """submit() checks that the generator is open and queues its request under the lock the
    engine thread takes to decide it may stop: close() landing between the two cannot let the
    thread stop with the request queued and never answered (the caller's result() would hang).
    Here close() runs while submit() is queueing, and the thread is given a second to stop."""
    import threading
    eng, _ = make_engine(1, costs=None, draft=False, lookup=False)
    g = BatchGenerator(eng, None)
    real_add, closer = eng.add, []

    def add(req, max_waiting=None):
        if not closer:
            closer.append(threading.Thread(target=g.close))
            closer[0].start()
            g._thread.join(1.0)      # the engine thread stops here unless it must wait for this submit
        return real_add(req, max_waiting)

    monkeypatch.setattr(eng, "add", add)
    h = g.submit([1, 2, 3], max_new_tokens=20)
    c = h.result(timeout=60)
    assert c.finish_reason in ("cancelled", "length", "stop")
    closer[0].join(60)
    assert not closer[0].is_alive() and not g._thread.is_alive()
    with pytest.raises(Exception, match="closed"):
        g.submit([1, 2, 3], max_new_tokens=5)
