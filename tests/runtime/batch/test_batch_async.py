"""The engine from a coroutine: `BatchGenerator.aevents` / `astream` / `agenerate` read the
engine thread's events without blocking the event loop, give the answer `generate` gives, and
cancel the request when the coroutine leaves early."""
from __future__ import annotations

import asyncio

from specrt.runtime import SamplingParams, open_batch
from specrt.runtime.batch.request import Done

PROMPTS = ["a b a b a b a b", "the cat the cat the cat", "hello there"]


def test_coroutines_get_the_answers_generate_gives_and_leaving_early_cancels(tiny_batch_rows_engines):
    seeded = SamplingParams(temperature=0.8, seed=3)
    with open_batch(tiny_batch_rows_engines, max_num_seqs=2) as g:
        want = [g.generate(p, max_new_tokens=16, sampling=seeded) for p in PROMPTS]
        handles = []
        submit = g.submit

        def spy(*a, **kw):
            handles.append(submit(*a, **kw))
            return handles[-1]
        g.submit = spy

        async def main():
            got = await asyncio.gather(*(g.agenerate(p, max_new_tokens=16, sampling=seeded) for p in PROMPTS))
            chunks = [c async for c in g.astream(PROMPTS[0], max_new_tokens=16, sampling=seeded)]
            events = g.aevents(PROMPTS[1], max_new_tokens=64, ignore_eos=True)
            first = await events.__anext__()
            await events.aclose()                     # the caller leaves after one event
            return got, chunks, first
        got, chunks, first = asyncio.run(main())
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert sum((c.tokens for c in chunks), []) == want[0].tokens
    assert not isinstance(first, Done)
    assert handles[-1].request.cancelled.is_set() and all(not h.request.cancelled.is_set() for h in handles[:-1])


def test_a_sink_that_raises_ends_only_its_own_request(tiny_batch_rows_engines):
    """A caller's sink runs inside an engine step (a coroutine whose event loop has closed, a
    server whose client went away): its error cancels its own request, and the rows beside it
    and the requests after it get the answers they get alone."""
    with open_batch(tiny_batch_rows_engines, max_num_seqs=3) as g:
        want = [g.generate(p, max_new_tokens=16, ignore_eos=True) for p in PROMPTS]
        seen = []

        def broken(ev):
            seen.append(ev)
            raise RuntimeError("Event loop is closed")
        bad = g.submit(PROMPTS[0], max_new_tokens=64, ignore_eos=True, sink=broken)
        beside = [g.submit(p, max_new_tokens=16, ignore_eos=True) for p in PROMPTS[1:]]
        got = [h.result(timeout=120) for h in beside]
        after = g.generate(PROMPTS[0], max_new_tokens=16, ignore_eos=True)
    assert [c.tokens for c in got] == [c.tokens for c in want[1:]]
    assert after.tokens == want[0].tokens
    assert bad.request.cancelled.is_set() and len(seen) == 1


def test_a_coroutine_gone_with_its_loop_leaves_the_engine_serving(tiny_batch_rows_engines):
    """asyncio.run ends while a request streams: its later events find the loop closed, and the
    engine goes on serving."""
    with open_batch(tiny_batch_rows_engines, max_num_seqs=2) as g:
        want = g.generate(PROMPTS[1], max_new_tokens=16)

        async def leave():
            events = g.aevents(PROMPTS[0], max_new_tokens=64, ignore_eos=True)
            return await events.__anext__()         # the loop closes with the stream still open
        first = asyncio.run(leave())
        assert not isinstance(first, Done)
        assert g.generate(PROMPTS[1], max_new_tokens=16).tokens == want.tokens
        assert g._thread.is_alive()
