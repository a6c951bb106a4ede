"""`specrt serve --max-num-seqs N`: one batched engine behind the same HTTP API.

What depends on the order of events is made deterministic by an `EngineProbe`: it holds the
engine thread before a step until the test lets it go (requests overlap, or a client is gone,
by construction) and records each request's engine events (Delta, Done)."""
from __future__ import annotations

import concurrent.futures as cf
import threading

import httpx
import pytest

from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.request import Delta, Done
from specrt.serve.errors import ServeConfigError
from specrt.serve.server import ServeConfig, build_app

from .serve_helpers import WAIT_S, LiveServer, wait_for

PROMPTS = ["hello there", "the quick brown fox", "x", "one two three four five six", "to be or not", "a b c"]


class EngineProbe:
    """The server's batched generator (`factory`), with two seams on its engine thread:
    - `go` clear: the thread waits before its next step while `hold(engine)` is true
      (`held` is set while it waits); set (the default): it steps freely;
    - `events[i]`: the engine events of the i-th request submitted, in order; `rows`: the
      running rows at the start of each step that had work.
    `tune(gen)` may adjust the generator before it serves (e.g. its policy's costs)."""

    def __init__(self, hold=lambda engine: True, tune=lambda gen: None):
        self.hold, self.tune = hold, tune
        self.go, self.held = threading.Event(), threading.Event()
        self.go.set()
        self.events: list[list] = []
        self.rows: list[int] = []
        self.engine = None

    def factory(self, engines, **kw):
        gen = open_batch(engines, **kw)
        self.tune(gen)
        eng, step, submit_n = gen.engine, gen.engine.step, gen.submit_n
        self.engine = eng

        def gated_step():
            # checked on the engine thread, between steps: nothing is admitted or emitted meanwhile
            if not self.go.is_set() and self.hold(eng):
                self.held.set()
                self.go.wait(WAIT_S)
                self.held.clear()
            if not eng.idle():          # (an idle engine polls for work every few ms)
                self.rows.append(len(eng.rows))
            return step()

        def recorded_submit_n(*a, sinks, **kw):
            recorders = []
            for sink in sinks:            # (the server submits every request as n samples)
                events = []
                self.events.append(events)

                def record(ev, events=events, sink=sink):
                    events.append(ev)
                    sink(ev)
                recorders.append(record)
            return submit_n(*a, sinks=recorders, **kw)

        eng.step, gen.submit_n = gated_step, recorded_submit_n     # (the thread looks both up at each call)
        return gen

    def done(self, i: int = -1) -> Done | None:
        return next((e for e in self.events[i] if isinstance(e, Done)), None) if self.events else None


@pytest.fixture(scope="module")
def probe():
    p = EngineProbe()
    yield p
    p.go.set()


@pytest.fixture(scope="module")
def live(tiny_batch_engines, probe):
    server = LiveServer(tiny_batch_engines, factory=probe.factory, max_num_seqs=3, queue_size=8)
    yield server
    server.close()


def _complete(url, model, prompt, **kw):
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16,
                                                  "temperature": 0, **kw}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_concurrent_requests_get_the_answers_they_get_alone(live, probe, tiny_batch_engines):
    ref = open_batch(tiny_batch_engines, max_num_seqs=1)
    try:
        alone = [ref.generate(p, max_new_tokens=16) for p in PROMPTS]
    finally:
        ref.close()
    # each row is admitted one step after the one before it (one prefill at a time): with every
    # answer at least 4 tokens long, the third row joins while the first two still run
    assert min(len(c.tokens) for c in alone) >= 4, "an answer too short to overlap the others"
    eng = probe.engine
    probe.go.clear()                     # the engine waits before its next step...
    assert probe.held.wait(WAIT_S)
    steps0, row_steps0, first = eng.stats.steps, eng.stats.row_steps, len(probe.rows)
    try:
        with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
            futs = [ex.submit(_complete, live.url, live.model, p) for p in PROMPTS]
            # three in the engine's queue (its free rows), three in the server's
            wait_for(lambda: (eng.queued, live.pool.queued) == (3, 3), "every request to be queued")
            probe.go.set()               # ...until every request waits for a row: they overlap by construction
            got = [f.result() for f in futs]
    finally:
        probe.go.set()
    assert got == [c.text for c in alone]
    assert max(probe.rows[first:]) == 3
    st = eng.stats
    assert (st.row_steps - row_steps0) / (st.steps - steps0) > 1.0
    m = live.metrics()
    assert m[("specrt_batch_steps", frozenset())] == st.steps > 0
    assert m[("specrt_batch_occupancy", frozenset())] == pytest.approx(st.occupancy)
    assert m[("specrt_batch_step_choice", frozenset({("kind", "plain")}))] == m[("specrt_batch_steps", frozenset())]
    h = live.health()
    assert h["method"] == "plain" and [w["max_num_seqs"] for w in h["workers"]] == [3]


def test_a_client_that_disconnects_mid_stream_frees_its_row_at_the_next_step(tiny_batch_engines):
    """One row, no queue: a stream the client leaves after two pieces is cancelled in the engine,
    its row freed by the first step after the server saw the disconnect (before that step's
round: no token is made for nobody), and the next request
    gets the row (it would get 429 while the row is held)."""
    probe = EngineProbe(hold=lambda eng: sum(isinstance(e, Delta) and bool(e.text) for e in probe.events[-1]) >= 2
                        if probe.events else False)
    probe.go.clear()                     # the engine stops once the stream's first two pieces are out
    server = LiveServer(tiny_batch_engines, factory=probe.factory, max_num_seqs=1, queue_size=0)
    try:
        with httpx.Client(timeout=WAIT_S) as c:
            with c.stream("POST", server.url + "/v1/completions", json={
                    "model": server.model, "prompt": "hello", "max_tokens": 80, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                lines = r.iter_lines()   # held: a dropped httpx line iterator closes the connection
                pieces = [next(line for line in lines if line.startswith("data: ")) for _ in range(2)]
                assert all('"text":"' in line for line in pieces)
                assert probe.held.wait(WAIT_S)
            # leaving the block closed the connection mid-stream
        wait_for(lambda: server.count("/v1/completions", "cancelled") == 1, "the server to see the disconnect")
        eng, emitted = probe.engine, sum(len(e.tokens) for e in probe.events[0] if isinstance(e, Delta))
        assert probe.done(0) is None and eng.active == 1
        steps = eng.stats.steps
        probe.go.set()                   # the engine steps again
        done = wait_for(lambda: probe.done(0), "the engine to end the request")
        assert done.finish_reason == "cancelled"
        assert eng.stats.steps == steps, "the row ran a round after the client left"
        assert done.completion_tokens == emitted < 80
        assert eng.active == 0
        wait_for(lambda: server.health()["busy"] == 0, "the server to free the row")    # (after the engine's Done)
        got = httpx.post(server.url + "/v1/completions", timeout=WAIT_S, json={
            "model": server.model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0})
        assert got.status_code == 200, got.text
        assert got.json()["usage"]["completion_tokens"] == 8
    finally:
        probe.go.set()
        server.close()


def test_the_config_refuses_what_it_cannot_serve(tiny_int4_engines):
    with pytest.raises(ServeConfigError, match="--workers"):
        ServeConfig("x", max_num_seqs=4, workers=0)
    with pytest.raises(ServeConfigError, match="256"):
        ServeConfig("x", max_num_seqs=0)
    with pytest.raises(ServeConfigError, match="--batch"):
        build_app(ServeConfig(str(tiny_int4_engines), max_num_seqs=4))


def test_top_k_min_p_stop_token_ids_and_ignore_eos_reach_the_batched_engine(live, tiny_batch_engines):
    from specrt.runtime.sampling import SamplingParams
    ref = open_batch(tiny_batch_engines, max_num_seqs=1)
    try:
        full = ref.generate(PROMPTS[1], max_new_tokens=16)
        stop_id = full.tokens[4]
        stopped = ref.generate(PROMPTS[1], max_new_tokens=16, stop_token_ids=[stop_id])
        sampled = ref.generate(PROMPTS[0], max_new_tokens=16,
                               sampling=SamplingParams(temperature=1.0, top_k=3, min_p=0.2, seed=4))
        eos = next((p for p in PROMPTS + ["a", "b", "zz", "hello"]
                    if ref.generate(p, max_new_tokens=60).finish_reason == "eos"), None)
        assert eos is not None, "no prompt reaches EOS: the ignore_eos check would mean nothing"
        ended = ref.generate(eos, max_new_tokens=60)
        through = ref.generate(eos, max_new_tokens=len(ended.tokens) + 6, ignore_eos=True)
    finally:
        ref.close()
    assert stopped.finish_reason == "stop" and len(stopped.tokens) < 5
    assert through.finish_reason == "length" and len(through.tokens) == len(ended.tokens) + 6
    assert _complete(live.url, live.model, PROMPTS[1], stop_token_ids=[stop_id]) == stopped.text
    assert _complete(live.url, live.model, PROMPTS[0], temperature=1.0, top_k=3, min_p=0.2, seed=4) == sampled.text
    r = httpx.post(live.url + "/v1/completions", timeout=WAIT_S, json={
        "model": live.model, "prompt": eos, "temperature": 0, "ignore_eos": True, "max_tokens": len(through.tokens)})
    assert r.json()["choices"][0]["finish_reason"] == "length" and r.json()["choices"][0]["text"] == through.text


def test_two_copies_of_two_rows_answer_as_each_request_alone(tiny_batch_engines):
    """`--workers 2 --max-num-seqs 2`: two engine copies, two rows each, one queue in front."""
    ref = open_batch(tiny_batch_engines, max_num_seqs=1)
    try:
        alone = [ref.generate(p, max_new_tokens=16).text for p in PROMPTS]
    finally:
        ref.close()
    server = LiveServer(tiny_batch_engines, workers=2, max_num_seqs=2, queue_size=8)
    try:
        with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
            got = list(ex.map(lambda p: _complete(server.url, server.model, p), PROMPTS))
        assert got == alone
        h = server.health()
        assert [w["max_num_seqs"] for w in h["workers"]] == [2, 2]
        assert sum(w["requests"] for w in h["workers"]) == len(PROMPTS) and h["busy"] == 0
    finally:
        server.close()


def test_metrics_show_how_far_the_loop_finds_the_build_s_step_costs(tiny_batch_rows_engines):
    """A speculating batched server with live costs on: after a request, /metrics has
    specrt_step_cost_factor for "overall" and for exactly the shapes the engine observed, at the
    engine's own factors; with live costs off there is no such sample."""
    from specrt.runtime.batch.policy import BatchCosts

    def factory(live):
        def make(engines, **kw):
            gen = open_batch(engines, **kw)
            gen.engine.policy.costs = BatchCosts({T: {1: 1.0, 8: 1.0} for T in (1, 2, 4)})   # speculate
            gen.engine.live_costs = live
            return gen
        return make

    for live in (True, False):
        server = LiveServer(tiny_batch_rows_engines, factory=factory(live), max_num_seqs=2, queue_size=4)
        try:
            _complete(server.url, server.model, "a b a b a b a b a b")
            m = server.metrics()
            got = {dict(labels)["shape"]: v for (name, labels), v in m.items() if name == "specrt_step_cost_factor"}
            snap = server.pool.gens[0].engine.policy.costs.live.snapshot()
        finally:
            server.close()
        if not live:
            assert got == {} and snap["shapes"] == {}
            continue
        assert set(got) == {"overall"} | {"/".join(map(str, k)) for k in snap["shapes"]} and len(got) > 1
        assert got["overall"] == pytest.approx(snap["overall"])
        for k, (factor, count) in snap["shapes"].items():
            assert count > 0 and got["/".join(map(str, k))] == pytest.approx(factor)
