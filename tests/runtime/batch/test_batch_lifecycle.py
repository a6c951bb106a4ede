"""How a batched request ends when something goes wrong around it: a step that raises fails
every request (running, being prefilled, waiting), so no caller waits for ever; a request
cancelled or timed out during its prompt's prefill ends there and frees its row; the queue
admits exactly max_num_seqs + max_queue requests. The engine thread only steps when a test
lets it (fake_batch.StepGate, hold_until_added), and deadlines run on a fake clock."""
from __future__ import annotations

import pytest
from fake_batch import StepGate, hold_until_added
from test_batch_engine import PROMPTS, make_engine, reference, submit

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
    assert eng.stats.prefill_chunks == chunks and eng.pending is None      # none of its chunks ran after
    eng.step()                                           # the waiting request takes row 1
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
