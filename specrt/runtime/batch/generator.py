"""`BatchGenerator`: one engine (one copy of the weights) for many requests at once.

    gen = BatchGenerator("artifacts/smollm2-int4", max_num_seqs=8)
    h = gen.submit("Tell me a joke.", chat=True, max_new_tokens=64)     # from any thread
    for chunk in h.chunks():
        print(chunk.text, end="")
    outs = gen.generate_batch(["one", "two", "three"], max_new_tokens=32)   # offline
    async for chunk in gen.astream("Name three colors.", chat=True):     # in a coroutine
        ...
    gen.close()

A background thread runs the engine's steps (engine.py: continuous batching, speculation
chosen per step); requests are submitted from any thread or coroutine and stream their
events (request.py: Delta, Done, Failed) to a sink: by default the handle's own queue,
which `chunks()` / `result()` read; a server passes its own sink (an event loop's
`call_soon_threadsafe`). Greedy tokens equal the request run alone; a seeded sample is the
same whatever else is in the batch (runtime/choice.py).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import secrets
import threading
import time
from typing import AsyncIterator, Callable, Iterator, Sequence

from specrt.errors import ConfigError, OverloadedError, SpecrtError
from specrt.runtime.batch.engine import BatchEngine
from specrt.runtime.batch.folder import batch_engine
from specrt.runtime.batch.request import Delta, Done, Failed, Request
from specrt.runtime.logprobs import check_logprobs
from specrt.runtime.prompt import check_request, check_stop_token_ids, encode_prompt
from specrt.runtime.sampling import SamplingParams
from specrt.runtime.text import Chunk, Completion, _stop_strings, stop_token_set

log = logging.getLogger(__name__)


class Handle:
    """One submitted request: read its events (`events()`), its text (`chunks()`), or wait for
    the whole answer (`result()`); `cancel()` stops it at the next step."""

    def __init__(self, req: Request, q: "queue.SimpleQueue | None"):
        self.request, self._q = req, q
        self.done: Done | None = None

    def cancel(self) -> None:
        self.request.cancel()

    def events(self, timeout: float | None = None) -> Iterator[Delta | Done]:
        if self._q is None:
            raise SpecrtError("this request streams to the sink it was submitted with, not to its handle")
        while self.done is None:
            try:
                ev = self._q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no event from the engine within {timeout} s") from None
            if isinstance(ev, Failed):
                raise ev.error
            if isinstance(ev, Done):
                self.done = ev
            yield ev

    def chunks(self, timeout: float | None = None) -> Iterator[Chunk]:
        for ev in self.events(timeout):
            if isinstance(ev, Delta):
                yield _chunk(ev)

    def result(self, timeout: float | None = None) -> Completion:
        text, toks, lps = [], [], []
        for c in self.chunks(timeout):
            text.append(c.text)
            toks += c.tokens
            lps += c.logprobs or ()
        d = self.done
        return Completion("".join(text), toks, d.finish_reason, d.metrics, d.prompt_tokens,
                          logprobs=lps if self.request.logprobs is not None else None)


def _chunk(ev: Delta) -> Chunk:
    return Chunk(ev.text, list(ev.tokens), list(ev.from_draft), None if ev.logprobs is None else list(ev.logprobs))


class _GuardedSink:
    """A caller's sink runs on the engine thread, inside a step: if it raises, only its own
    request ends (cancelled at the next step, its later events dropped); the other rows and
    later requests go on. Unguarded, the step would fail every request in the batch."""

    def __init__(self, sink: Callable[[object], None]):
        self.sink, self.request, self.broken = sink, None, False

    def __call__(self, ev) -> None:
        if self.broken:
            return
        try:
            self.sink(ev)
        except Exception:
            self.broken = True
            rid = getattr(self.request, "id", "?")
            log.exception("request %s: its sink raised; the request is cancelled", rid)
            if self.request is not None:
                self.request.cancel()


class BatchGenerator:
    def __init__(self, engine: BatchEngine, tokenizer=None, *, max_queue: int | None = None):
        """Runs `engine` on a background thread (see `open_batch` for an engine folder).
        max_queue: most requests waiting for a row (None: no limit); beyond it submit raises.
        `feed`, when set, is called on the engine thread before every step (and every idle
        wake-up) that has a row no request holds or waits for: a caller that keeps its own queue
        (the server's pool, serve/pool.py) submits from it the moment a row is free, admitted
        in that same step."""
        self.engine, self.tokenizer, self.max_queue = engine, tokenizer, max_queue
        self.feed: Callable[[], None] | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._ids = itertools.count(1)     # request ids; next() is atomic across threads
        self._thread = threading.Thread(target=self._run, name="specrt-batch-engine", daemon=True)
        self._thread.start()

    # --- requests -----------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], *, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               stop: Sequence[str] = (), chat: bool = False, system: str | None = None,
               timeout: float | None = None, sink: Callable[[object], None] | None = None,
               stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
               poll_cancel: Callable[[], bool] | None = None, structured=None,
               logprobs: int | None = None) -> Handle:
        """Queue a request. timeout: seconds from now after which it ends with reason "timeout".
        sink: receives its events on the engine thread (None: the handle's own queue).
        stop_token_ids, ignore_eos: as `SpeculativeGenerator.stream`'s.
        poll_cancel: called at every engine step while the request waits or runs; True cancels
        it (for callers that can only ask, as Triton's `request.is_cancelled()`).
        structured: the output must match it (runtime/grammar.py: a Structured, or a mapping such as
        {"json_schema": {...}}, {"regex": "..."}, {"choice": [...]}, {"grammar": "..."}); an invalid
        one raises GrammarError here.
        logprobs: None, or n in [0, 20]: each Delta carries its tokens' log-probabilities with the n
        most likely alternatives (runtime/logprobs.py)."""
        return self.submit_n(prompt, 1, max_new_tokens=max_new_tokens, sampling=sampling, stop=stop, chat=chat,
                             system=system, timeout=timeout, sinks=None if sink is None else [sink],
                             stop_token_ids=stop_token_ids, ignore_eos=ignore_eos, poll_cancel=poll_cancel,
                             structured=structured, logprobs=logprobs)[0]

    def submit_n(self, prompt: str | Sequence[int], n: int, *, max_new_tokens: int = 128,
                 sampling: SamplingParams | None = None, stop: Sequence[str] = (), chat: bool = False,
                 system: str | None = None, timeout: float | None = None,
                 sinks: Sequence[Callable[[object], None]] | None = None, stop_token_ids: Sequence[int] = (),
                 ignore_eos: bool = False, poll_cancel: Callable[[], bool] | None = None, structured=None,
                 logprobs: int | None = None) -> list[Handle]:
        """n samples of one prompt (OpenAI's `n`), one Handle each: the prompt is prefilled once and
        its cache row copied into a row per sample, so the request waits until n rows are free (n
        must not exceed max_num_seqs). Sample i is exactly the single request with seed + i (a
        seeded request), or with a seed of its own; greedy samples are all the same answer, as
        vLLM gives them. sinks: one per sample (None: the handles' own queues). The other
        arguments are submit's."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"n={n!r}: give an integer >= 1 (the number of samples)")
        if n > self.engine.max_num_seqs:
            raise ConfigError(f"n={n} samples need {n} rows at once; this engine has max_num_seqs="
                              f"{self.engine.max_num_seqs}: ask for fewer, or open it with a larger max_num_seqs")
        if sinks is not None and len(sinks) != n:
            raise ConfigError(f"{len(sinks)} sinks for n={n} samples: give one per sample")
        return self._submit(prompt, n, max_new_tokens, sampling, stop, chat, system, timeout, sinks, stop_token_ids,
                            ignore_eos, poll_cancel, structured, logprobs)

    def _submit(self, prompt, n, max_new_tokens, sampling, stop, chat, system, timeout, sinks, stop_token_ids,
                ignore_eos, poll_cancel, structured, logprobs) -> list[Handle]:
        """submit_n's work: checks, then the n Requests (the first carries the others)."""
        if self._closed:
            raise ConfigError("this BatchGenerator is closed")
        sampling = sampling or SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ConfigError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        eng = self.engine
        if isinstance(prompt, str) and self.tokenizer is None:
            raise ConfigError("this engine has no tokenizer: pass token ids")
        ids = encode_prompt(self.tokenizer, prompt, chat=chat, system=system)
        ids = check_request(ids, max_new_tokens, eng.max_context, eng.vocab)
        stops = tuple(_stop_strings(stop))
        stop_ids = stop_token_set(check_stop_token_ids(stop_token_ids, eng.vocab), ignore_eos)
        if stops and self.tokenizer is None:
            raise ConfigError("stop strings need the engine's tokenizer")
        logprobs = check_logprobs(logprobs)
        deadline = None if timeout is None else eng.clock() + timeout
        reqs, handles = [], []
        for i in range(n):
            seed = sampling.seed + i if sampling.seed is not None else secrets.randbits(63)
            q = queue.SimpleQueue() if sinks is None else None
            guarded = None if sinks is None else _GuardedSink(sinks[i])
            req = Request(ids, max_new_tokens, sampling, seed, stops, deadline, guarded or q.put, next(self._ids),
                          stop_token_ids=stop_ids, ignore_eos=ignore_eos, poll_cancel=poll_cancel,
                          grammar=matcher(eng.grammars, structured, ignore_eos), logprobs=logprobs)
            if guarded is not None:
                guarded.request = req
            reqs.append(req)
            handles.append(Handle(req, q))
        reqs[0].siblings = tuple(reqs[1:])        # forked from the first one's prefilled prompt
        with self._wake:
            # under the lock the engine thread takes to decide it may stop (_run): a request is
            # either queued while the thread still runs (close() then cancels it at the next
            # step) or refused, never queued after the thread's last look
            if self._closed:
                raise ConfigError("this BatchGenerator is closed")
            added = eng.add(reqs[0], self.max_queue)
            if added:
                self._wake.notify()
        if not added:
            raise OverloadedError(f"{eng.queued} requests are already waiting (max_queue={self.max_queue}): "
                                  "retry later, or raise max_queue / max_num_seqs")
        return handles

    def stream(self, prompt, **kw) -> Iterator[Chunk]:
        h = self.submit(prompt, **kw)
        try:
            yield from h.chunks()
        finally:
            if h.done is None:
                h.cancel()

    def generate(self, prompt, **kw) -> Completion:
        return self.submit(prompt, **kw).result()

    async def aevents(self, prompt, **kw) -> AsyncIterator[Delta | Done]:
        """The request's events for a coroutine, as the engine thread makes them, read without
        blocking the event loop; the last is its Done (a Failed raises its error). Leaving early
        (break, an exception, the task cancelled) cancels the request, which frees its row at
        the next step."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(ev) -> None:
            if not loop.is_closed():     # closed: the coroutine is gone and its request cancelled
                loop.call_soon_threadsafe(events.put_nowait, ev)
        h = self.submit(prompt, sink=put, **kw)
        try:
            while h.done is None:
                ev = await events.get()
                if isinstance(ev, Failed):
                    raise ev.error
                if isinstance(ev, Done):
                    h.done = ev
                yield ev
        finally:
            if h.done is None:
                h.cancel()

    async def astream(self, prompt, **kw) -> AsyncIterator[Chunk]:
        """`stream` for a coroutine (see aevents)."""
        async for ev in self.aevents(prompt, **kw):
            if isinstance(ev, Delta):
                yield _chunk(ev)

    async def agenerate(self, prompt, **kw) -> Completion:
        """`generate` for a coroutine (see aevents)."""
        text, toks, lps = [], [], []
        async for ev in self.aevents(prompt, **kw):
            if isinstance(ev, Delta):
                text.append(ev.text)
                toks += ev.tokens
                lps += ev.logprobs or ()
            else:
                done = ev
        return Completion("".join(text), toks, done.finish_reason, done.metrics, done.prompt_tokens,
                          logprobs=lps if kw.get("logprobs") is not None else None)

    def generate_n(self, prompt, n: int, **kw) -> list[Completion]:
        """n samples of one prompt sharing its prefill (see submit_n), in sample order."""
        return [h.result() for h in self.submit_n(prompt, n, **kw)]

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], **kw) -> list[Completion]:
        """Every prompt submitted at once; answers in the prompts' order."""
        handles = [self.submit(p, **kw) for p in prompts]
        return [h.result() for h in handles]

    # --- lifecycle ------------------------------------------------------------------------------
    def close(self, timeout: float | None = 10.0) -> None:
        """Stop: running and waiting requests are cancelled (Done "cancelled"), the thread joins."""
        self._closed = True
        # the engine thread cancels every request it holds at its next step, in whatever state
        # (one on its way from `waiting` to its row is in neither list for a moment, engine.py
        # _admit); the ones seen here are cancelled now, so a step blocked in a sink leaves them
        # cancelled already
        self.engine.closing = True
        for r in list(self.engine.rows) + list(self.engine.admitting):
            r.req.cancel()
        for req in list(self.engine.waiting):
            req.cancel()
        with self._wake:
            self._wake.notify()
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _run(self) -> None:
        eng = self.engine
        while True:
            feed = self.feed          # (read once: close() may clear it meanwhile)
            if feed is not None and not self._closed and eng.active + eng.queued < eng.max_num_seqs:
                try:
                    feed()
                except Exception:           # the caller's queue: its failure must not stop the engine
                    log.exception("the engine's feed failed")
            try:
                busy = eng.step()
            except Exception as e:          # the model failed: fail every request, keep serving new ones
                log.exception("batched step failed")
                eng.fail_all(e if isinstance(e, SpecrtError) else
                             SpecrtError(f"internal error in the batched engine ({type(e).__name__}: {e})"))
                busy = False
            if self._closed:
                with self._wake:    # a submit() holds it from its closed check to its queueing
                    if eng.idle():
                        return
            if not busy:
                with self._wake:
                    if eng.idle() and not self._closed:
                        self._wake.wait(0.05)        # wake for new requests; deadlines are checked each step
                    elif not eng.rows and not eng.admitting:
                        time.sleep(0.001)


def open_batch(engines, *, max_num_seqs: int = 8, threads: int = 2, max_queue: int | None = None,
               verify: str = "full", buckets: Sequence[int] | None = None, execution: str = "cpu",
               speculate: bool = True, memory: str = "fast", prefill_budget: int | None = None,
               head: str | None = None) -> BatchGenerator:
    """A BatchGenerator over an engine folder built with `specrt build --batch` (its "batch"
    model: the target with a batch dimension). One copy of the weights serves up to
    `max_num_seqs` requests at once; each step runs every running row one round and
    prefills one chunk of the next request (prefill_budget: up to that many prompt tokens a
    step, chunk after chunk and request after request; BatchEngine's docstring). A folder without a batched model (no `--batch`, the
    GPU builds) opens with max_num_seqs=1: its one-row graphs on the same engine, one request at
    a time (batch/one_row.py), the tokens SpeculativeGenerator gives; memory="shared" (one
    memory-mapped copy of the weights for its prefill and one-token graphs, runtime/backends/
    ort_cpu.py) applies to those graphs only.

    The round is chosen per step by measured cost (policy.py: plain, a pair round, prompt
    lookup) when the build showed that a position's logits do not depend on the window they
    are computed in (manifest parity `window_invariance`) and measured the batched step costs
    (`build.speculation.batch_costs_ms`); otherwise (ONNX Runtime's CPU GroupQueryAttention
    graphs: docs/batching.md), or with speculate=False, every step is plain. A build with the
    int8 self-draft (`--draft int8`) and a batch that verifies windows gives the batched model
    a "draft" graph (the int8 copy of its step graph): the draft then runs inside the batch,
    one token a row per draft step over the target's cache, where its measured cost pays.

    buckets: run static row buckets (e.g. (1, 2, 4, 8)) through the device runner with one
    captured graph per bucket (backends/device_batch.py) instead of ONNX Runtime's dynamic
    rows; execution "cpu" runs that path here (tests), "cuda" is GPU-ONLY and NOT YET RUN ON
    A GPU (it needs fp16 batched graphs `specrt build --batch` does not make yet).

    head: a folder written by `specrt train-draft` (runtime/head.py): the trained head drafts
    inside the batch instead of the folder's draft, per row, where its measured cost pays
    (the folder's batched model must return the hidden states it reads: `specrt build --batch
    --hidden-layers ...`)."""
    engine, tok = batch_engine(engines, max_num_seqs=max_num_seqs, threads=threads, verify=verify, buckets=buckets,
                               execution=execution, speculate=speculate, memory=memory, head=head)
    if prefill_budget is not None:
        engine.prefill_budget = _budget(prefill_budget)
    return BatchGenerator(engine, tok, max_queue=max_queue)


def _budget(tokens) -> int:
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ConfigError(f"prefill_budget={tokens!r} must be a positive number of prompt tokens per step")
    return tokens


def matcher(grammars, structured, ignore_eos: bool = False):
    """A new request's grammar matcher (None without `structured`); GrammarError if it cannot be."""
    from specrt.runtime.grammar import GrammarError, Structured
    spec = Structured.coerce(structured)
    if spec is None:
        return None
    if ignore_eos:
        raise GrammarError("ignore_eos with a structured output: the grammar ends the answer with EOS when it is "
                           "complete; leave ignore_eos out")
    if grammars is None:
        raise GrammarError("this engine has no tokenizer to constrain its output with: open it from an engine folder")
    return grammars.matcher(spec)
