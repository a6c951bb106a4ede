"""serve/pool.py's EnginePool without engines: which copy takes a job and when, what waits,
what is refused, and that every way a request ends frees its rows. The copies are stand-ins
that record what they are given; the test plays their engine threads (sinks, feed)."""
from __future__ import annotations

import pytest

from specrt.errors import ConfigError
from specrt.runtime.batch.engine import EngineStats
from specrt.runtime.batch.request import Delta, Done, Failed
from specrt.runtime.grammar import GrammarError
from specrt.runtime.metrics import Metrics
from specrt.runtime.sampling import SamplingParams
from specrt.serve.errors import QueueFullError, RequestError, ServerShuttingDownError
from specrt.serve.pool import EnginePool, Job
from specrt.serve.validation import GenerationRequest


class _Loop:
    """An event loop stand-in: the pool's call_soon_threadsafe runs at once."""

    def call_soon_threadsafe(self, fn, *a):
        fn(*a)


class _Handle:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class _Policy:
    costs, fixed = None, False


class _Engine:
    policy = _Policy()

    def __init__(self):
        self.stats = EngineStats()


class _Copy:
    """A BatchGenerator stand-in: submit_n records (prompt, sinks, handles); `refuse` raises."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs, self.engine, self.feed = max_num_seqs, _Engine(), None
        self.submitted: list[tuple] = []
        self.refuse: Exception | None = None
        self.closed = False

    def submit_n(self, prompt, n, *, sinks, **kw):
        if self.refuse is not None:
            raise self.refuse
        handles = [_Handle() for _ in range(n)]
        self.submitted.append((prompt, sinks, handles))
        return handles

    def close(self, timeout=None):
        self.closed = True


def _pool(copies=2, rows=1, queue_size=2):
    made: list[_Copy] = []
    generations = []

    def factory(engines, *, max_num_seqs, threads, memory):
        made.append(_Copy(max_num_seqs))
        return made[-1]
    pool = EnginePool("unused", copies=copies, max_num_seqs=rows, queue_size=queue_size, factory=factory,
                      on_generation=lambda *a: generations.append(a))
    pool.start()
    return pool, made, generations


def _job(prompt=(1, 2, 3), n=1) -> Job:
    req = GenerationRequest("completion", tuple(prompt), 8, SamplingParams(), (), False, False, n=n)
    return Job(req, _Loop())


def _events(job) -> list:
    out = []
    while not job.events.empty():
        index, ev, _ = job.events.get_nowait()
        out.append((index, ev))
    return out


def _done(reason="eos", tokens=2) -> Done:
    return Done(reason, 3, tokens, Metrics(method="speculative"))


def test_each_job_takes_the_copy_with_the_most_free_rows_and_the_rest_wait_in_order():
    pool, (a, b), _ = _pool(copies=2, rows=1, queue_size=2)
    jobs = [_job((i,)) for i in range(4)]
    for j in jobs:
        pool.submit(j)
    assert [s[0] for s in a.submitted] == [[0]] and [s[0] for s in b.submitted] == [[1]]
    assert (pool.busy, pool.queued) == (2, 2)
    with pytest.raises(QueueFullError):           # 2 copies x 1 row + 2 waiting
        pool.submit(_job())
    # copy b's request ends; its engine thread feeds before its next step: the oldest waiting job
    b.submitted[0][1][0](_done())
    assert pool.busy == 1
    b.feed()
    assert [s[0] for s in b.submitted] == [[1], [2]] and [s[0] for s in a.submitted] == [[0]]
    a.feed()                                      # a has no free row: nothing moves
    assert len(a.submitted) == 1 and pool.queued == 1
    assert [w.requests for w in pool.info] == [1, 2] and [w.busy for w in pool.info] == [1, 1]


def test_a_job_of_n_samples_waits_for_n_rows_of_one_copy_and_the_jobs_behind_it_wait_too():
    pool, (a, b), _ = _pool(copies=2, rows=2, queue_size=4)
    one, two = _job((1,)), _job((2,))
    pool.submit(one)
    pool.submit(two)                               # one row each on a and b
    pair, after = _job((3,), n=2), _job((4,))
    pool.submit(pair)
    pool.submit(after)
    assert pool.queued == 2, "no copy has two free rows: the pair waits, and the job behind it"
    a.submitted[0][1][0](_done())
    a.feed()
    assert a.submitted[-1][0] == [3] and len(a.submitted[-1][1]) == 2
    b.feed()
    assert b.submitted[-1][0] == [4] and pool.queued == 0


def test_a_job_that_leaves_the_queue_never_reaches_an_engine_and_a_running_one_is_cancelled():
    pool, (a,), _ = _pool(copies=1, rows=1, queue_size=2)
    running, waiting = _job((1,)), _job((2,))
    pool.submit(running)
    pool.submit(waiting)
    pool.cancel(waiting)
    assert pool.queued == 0 and waiting.cancelled.is_set()
    pool.cancel(running)
    assert all(h.cancelled for h in a.submitted[0][2])
    a.submitted[0][1][0](_done("cancelled", 0))    # the engine drops it at its next step
    a.feed()
    assert len(a.submitted) == 1 and pool.busy == 0 and _events(running) == []


def test_every_way_a_sample_ends_frees_its_row_and_tells_the_handler_what_it_should_hear():
    pool, (a,), generations = _pool(copies=1, rows=3, queue_size=0)
    job = _job(n=3)
    pool.submit(job)
    sinks = a.submitted[0][1]
    delta = Delta("ab", (5, 6), (False, True))
    sinks[0](delta)
    sinks[0](_done("eos", 99))                 # the handler hears the tokens it was sent
    sinks[1](_done("timeout", 0))              # nobody waits for it: no event
    sinks[2](Failed(RuntimeError("a bug")))
    assert pool.busy == 0 and generations == [(3, 2, 0, 0), (3, 0, 0, 0)]
    (i0, e0), (i1, e1), (i2, e2) = _events(job)
    assert (i0, e0) == (0, delta) and i1 == 0 and e1.completion_tokens == 2 and e1.finish_reason == "eos"
    assert i2 == 2 and isinstance(e2.error, RequestError) and e2.error.status == 500
    assert "a bug" not in str(e2.error) and "server log" in str(e2.error)


def test_a_grammar_failure_is_the_requests_400_and_a_refused_submission_holds_no_row():
    pool, (a,), _ = _pool(copies=1, rows=1, queue_size=0)
    job = _job()
    pool.submit(job)
    a.submitted[0][1][0](Failed(GrammarError("no token fits")))
    [(_, ev)] = _events(job)
    assert ev.error.status == 400 and "no token fits" in str(ev.error)
    a.refuse = ConfigError("refused")
    refused = _job()
    pool.submit(refused)
    [(_, ev)] = _events(refused)
    assert ev.error.status == 400 and pool.busy == 0 and pool.queued == 0


def test_close_fails_the_waiting_jobs_with_a_503_and_closes_every_copy():
    pool, copies, _ = _pool(copies=2, rows=1, queue_size=1)
    jobs = [_job((i,)) for i in range(3)]
    for j in jobs:
        pool.submit(j)
    pool.close()
    [(_, ev)] = _events(jobs[2])
    assert isinstance(ev.error, ServerShuttingDownError) and all(c.closed and c.feed is None for c in copies)
    with pytest.raises(ServerShuttingDownError):
        pool.submit(_job())


def test_a_prefill_budget_reaches_every_copy_and_a_bad_one_is_refused_at_start():
    """--prefill-budget: each copy's factory gets it (only when set: factories that predate it
    keep working); ServeConfig refuses a budget that is not a positive number of tokens."""
    from specrt.serve.errors import ServeConfigError
    from specrt.serve.server import ServeConfig
    got = []

    def factory(engines, *, max_num_seqs, threads, memory, **extra):
        got.append(extra)
        return _Copy(max_num_seqs)
    for budget, want in ((None, {}), (256, {"prefill_budget": 256})):
        got.clear()
        pool = EnginePool("unused", copies=2, max_num_seqs=2, factory=factory, prefill_budget=budget)
        pool.start()
        assert got == [want, want]
        pool.close(timeout=5)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ServeConfigError, match="--prefill-budget"):
            ServeConfig("x", max_num_seqs=4, prefill_budget=bad)
