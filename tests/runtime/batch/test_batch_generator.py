"""BatchGenerator: the engine on its own thread, requests from many threads, each streamed to
its own handle; offline generate_batch; a failing model fails the requests, not the thread."""
from __future__ import annotations

import threading

import pytest
from fake_batch import FakeTokenizer, StepGate, hold_until_added
from test_batch_engine import EOS, PROMPTS, make_engine, reference

from specrt.errors import OverloadedError, SpecrtError
from specrt.runtime.batch.generator import BatchGenerator
from specrt.runtime.batch.request import Delta, Done, Failed
from specrt.runtime.sampling import SamplingParams


@pytest.fixture()
def gen():
    eng, lm = make_engine(3, tokenizer=FakeTokenizer(EOS))
    g = BatchGenerator(eng, FakeTokenizer(EOS))
    g.lm = lm
    yield g
    g.close()


def test_requests_from_many_threads_each_get_their_own_answer(gen, monkeypatch):
    """8 threads submit while the engine is held until all 8 wait (hold_until_added): the rows
    share steps by construction, not because the threads happened to be faster than the engine."""
    hold_until_added(gen.engine, 8, monkeypatch)
    out = {}

    def client(i):
        out[i] = gen.submit(PROMPTS[i % len(PROMPTS)], max_new_tokens=12 + i).result(timeout=60)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and sorted(out) == list(range(8))
    for i, c in out.items():
        want, reason = reference(gen.lm, PROMPTS[i % len(PROMPTS)], 12 + i)
        assert (c.tokens, c.finish_reason) == (want, reason), i
    assert gen.engine.stats.occupancy > 1.0, gen.engine.stats


def test_generate_batch_keeps_the_prompts_order(gen):
    outs = gen.generate_batch(PROMPTS, max_new_tokens=10)
    assert [c.tokens for c in outs] == [reference(gen.lm, p, 10)[0] for p in PROMPTS]


def test_closing_a_stream_early_cancels_its_request(gen, monkeypatch):
    """The engine is held from the step that sends the first chunk until the stream is closed,
    so the request cannot finish its 40 tokens first however slow the test thread is."""
    handles, submit = [], gen.submit
    monkeypatch.setattr(gen, "submit", lambda *a, **kw: handles.append(submit(*a, **kw)) or handles[-1])
    gate = StepGate(gen.engine, monkeypatch)

    def feed():                  # steps until the request has sent its first event, then holds
        for _ in range(6000):
            if handles:
                break
            threading.Event().wait(0.01)
        req, sent = handles[0].request, threading.Event()
        real = req.sink
        req.sink = lambda ev: (real(ev), sent.set())
        while not sent.is_set():
            gate.run(1)
    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        s = gen.stream(PROMPTS[3], max_new_tokens=40, ignore_eos=True)
        next(s)
        feeder.join(60)
        s.close()
    finally:
        gate.free()
    (h,) = handles
    done = [ev for ev in h.events(timeout=60)][-1]           # the rest of its events, up to its Done
    assert done.finish_reason == "cancelled" and done.completion_tokens < 40
    c = gen.generate(PROMPTS[0], max_new_tokens=5)        # the engine carries on
    assert c.tokens == reference(gen.lm, PROMPTS[0], 5)[0]
    assert gen.engine.stats.finished >= 2


def test_a_full_queue_refuses_with_a_typed_error(monkeypatch):
    eng, lm = make_engine(1)
    go = threading.Event()
    real = eng.step
    monkeypatch.setattr(eng, "step", lambda: go.wait(30) and real())     # the engine waits for the test
    g = BatchGenerator(eng, None, max_queue=1)
    try:
        first = g.submit([1, 2, 3], max_new_tokens=4)
        with pytest.raises(OverloadedError, match="max_queue=1"):
            g.submit([4, 5, 6], max_new_tokens=4)
        go.set()
        assert first.result(30).tokens == reference(lm, [1, 2, 3], 4)[0]
    finally:
        go.set()
        g.close()


def test_threads_racing_for_the_last_queue_places_never_overfill_it(monkeypatch):
    eng, _ = make_engine(1)
    go = threading.Event()
    real = eng.step
    monkeypatch.setattr(eng, "step", lambda: go.wait(30) and real())     # nothing leaves the queue
    g = BatchGenerator(eng, None, max_queue=3)
    start, results = threading.Barrier(16), []

    def client(i):
        start.wait()
        try:
            results.append(g.submit([1, 2, 3 + i % 8], max_new_tokens=2).request.id)
        except OverloadedError:
            results.append(None)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        ids = [r for r in results if r is not None]
        assert len(results) == 16 and len(ids) == 3 and eng.queued == 3
        assert len(set(ids)) == 3                  # each request its own id
    finally:
        go.set()
        g.close()


def test_a_model_error_fails_the_running_requests_and_the_engine_serves_the_next(gen, monkeypatch):
    real = gen.engine.target.step
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(*a, **k)

    monkeypatch.setattr(gen.engine.target, "step", flaky)
    with pytest.raises(SpecrtError, match="boom"):
        gen.generate(PROMPTS[1], max_new_tokens=10)
    c = gen.generate(PROMPTS[0], max_new_tokens=6, sampling=SamplingParams(temperature=0.5, seed=3))
    assert c.tokens == reference(gen.lm, PROMPTS[0], 6, SamplingParams(temperature=0.5), 3)[0]



def _move_fails(monkeypatch, cache, src: int, dst: int) -> list:
    """The cache's next move of row src into row dst raises (a device error mid-step)."""
    real, seen = cache.move_row, []

    def move_row(s, d, length):
        if (s, d) == (src, dst) and not seen:
            seen.append((s, d))
            raise RuntimeError("device lost while moving a row")
        return real(s, d, length)

    monkeypatch.setattr(cache, "move_row", move_row)
    return seen


class Record:
    """A request's sink: its events in order; `ended` once a Done or Failed came."""

    def __init__(self):
        self.events, self.ended = [], threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if isinstance(ev, (Done, Failed)):
            self.ended.set()

    def end(self):
        assert self.ended.wait(60), "the request was never told how it ended"
        return self.events[-1]

    def ends(self) -> int:
        return sum(isinstance(e, (Done, Failed)) for e in self.events)


@pytest.mark.parametrize("own_draft", [False, True])
def test_a_sample_whose_row_copy_fails_is_told_once_and_none_waits_for_ever(monkeypatch, own_draft):
    """n=3: the copy of the prefilled prompt into the first sample's row raises (the target's
    cache, or the draft's own). Every sample is told its error exactly once (a sample taken off
    the to-fork list before its copy succeeded waited for ever), and the engine serves the next."""
    eng, lm = make_engine(3, tokenizer=FakeTokenizer(EOS), draft=own_draft, own_draft=own_draft)
    seen = _move_fails(monkeypatch, (eng.draft if own_draft else eng.target).cache, 0, 1)
    sinks = [Record() for _ in range(3)]
    with BatchGenerator(eng, FakeTokenizer(EOS)) as g:
        g.submit_n(PROMPTS[0], 3, max_new_tokens=4, sampling=SamplingParams(temperature=1.0, seed=1), sinks=sinks)
        for r in sinks:
            assert isinstance(r.end(), Failed) and "device lost" in str(r.end().error)
        assert seen == [(0, 1)]
        assert g.generate(PROMPTS[1], max_new_tokens=5).tokens == reference(lm, PROMPTS[1], 5)[0]
    assert [r.ends() for r in sinks] == [1, 1, 1]


@pytest.mark.parametrize("gap", [False, True])
def test_a_finished_row_is_told_once_before_any_row_moves_into_its_place(monkeypatch, gap):
    """A (short) ends while another row runs or a long prompt is being prefilled after it, and
    the move of a row into A's place raises: the prefilling row moving down (gap False: A is
    the last running row), or the last running row moving into A's gap (gap True). A is told
    its answer, exactly once (a row popped before the failing move waited for ever; one moved
    over before it was popped was told Failed), the others their error."""
    eng, lm = make_engine(3 if gap else 2, tokenizer=FakeTokenizer(EOS), draft=False, lookup=False)
    seen = _move_fails(monkeypatch, eng.target.cache, 1, 0)
    a, others = Record(), [Record() for _ in range(2 if gap else 1)]
    with BatchGenerator(eng, FakeTokenizer(EOS)) as g:
        hold_until_added(eng, 1 + len(others), monkeypatch)
        n = 4 if gap else 2
        g.submit(PROMPTS[0], max_new_tokens=n, ignore_eos=True, sink=a)
        if gap:      # B (one prompt chunk) runs in row 1 when A (row 0) ends: B moves into row 0
            g.submit([4, 4, 5], max_new_tokens=40, ignore_eos=True, sink=others[0])
        g.submit(list(range(1, 14)) * 4, max_new_tokens=4, sink=others[-1])   # 52 tokens: 7 chunks of 8
        end = a.end()
        assert isinstance(end, Done), end
        assert [t for e in a.events if isinstance(e, Delta) for t in e.tokens] == reference(lm, PROMPTS[0], n,
                                                                                            eos=None)[0]
        for r in others:
            assert isinstance(r.end(), Failed) and "device lost" in str(r.end().error)
        assert seen == [(1, 0)]
    assert [r.ends() for r in (a, *others)] == [1] * (1 + len(others))
