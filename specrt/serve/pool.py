"""`EnginePool`: the server's requests on N copies of the one decode engine (runtime/batch/),
each running up to `max_num_seqs` of them at once, behind one bounded queue.

    async handler ──submit(job)──► pending deque ──► a copy with a free row: BatchGenerator.submit_n
          ▲                    (capacity: copies x max_num_seqs + queue_size, else 429)   │ engine thread
          └── job.events (asyncio.Queue) ◄── loop.call_soon_threadsafe ◄── sink (Delta | Done | Failed)

`specrt serve --workers N` is N copies of one row each (a folder's one-row graphs, or its
batched model with one row); `--max-num-seqs M` is one copy of M rows on a batched model;
both together, N copies of M rows. Every copy is `open_batch` (runtime/batch/generator.py):
the engine, policy, accept rule and events every other caller gets, so a request's answer
does not depend on the pool it runs in.

The events a job receives are the engine's own (runtime/batch/request.py: Delta, Done,
Failed), as `(sample index, event, time)`; the pool only turns an engine error into the
request's HTTP error. A job waits in the pool's queue, not in an engine's, until a copy has
a row for each of its n samples: the copy's engine thread takes it the moment a row frees
(`BatchGenerator.feed`, admitted in that same step), and a client that leaves while it waits
is dropped at once. A job that is cancelled while it runs (client gone, timeout) ends at its
engine's next step, which frees its rows.

Lock order: the pool's lock, then an engine's; the row counts have their own lock, which the
sinks take (an engine calls some sinks under its lock) and which is never held around a call
into an engine.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specrt.errors import SpecrtError
from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.request import Delta, Done, Failed
from specrt.runtime.grammar import GrammarError
from specrt.serve.errors import QueueFullError, RequestError, ServerShuttingDownError
from specrt.serve.validation import GenerationRequest

log = logging.getLogger("specrt.serve")

# the engine's finish reasons (runtime/batch/request.py FINISH) as OpenAI's
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "max_context": "length"}


class Job:
    """One request on its way through the pool. `events` is read by the async handler only:
    (sample index, Delta | Done | Failed, time.perf_counter() when the engine made it)."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.t_arrival = time.perf_counter()
        self.handles: list = []        # the engine's handles, once a copy took the job

    def push(self, index: int, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (index, event, time.perf_counter()))
        except RuntimeError:    # the event loop is closed: nobody is listening any more
            self.cancelled.set()
            for h in self.handles:
                h.cancel()


@dataclass
class EngineInfo:
    """One engine copy, as /health shows it."""
    index: int
    max_num_seqs: int
    memory: str
    load_mib: float             # process RSS growth while this copy loaded
    requests: int = 0           # jobs it took
    busy: int = 0               # rows its jobs hold (running, or admitted at its next step)


def rss_mib() -> float:
    """Resident set size of this process (Linux /proc; 0.0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def done_metrics(done: Done, method: str) -> dict:
    """The `specrt` field of a final response: the engines' method (EnginePool.method) and the
    request's speculation, as the engine counted it."""
    m = done.metrics
    return {"method": method, "acceptance_rate": round(m.acceptance_rate, 4),
            "mean_acceptance_length": round(m.mean_acceptance_length, 3)}


def http_error(e: Exception) -> RequestError:
    """An engine's error as the request's HTTP error: its own grammar's failure is its 400; a
    RequestError stays; anything else is a 500 that points to the log."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, GrammarError):
        return RequestError(str(e))
    return RequestError(f"generation failed ({type(e).__name__}); see the server log", status=500,
                        type="server_error")


class EnginePool:
    def __init__(self, engines: str | Path, *, copies: int = 1, max_num_seqs: int = 1, queue_size: int = 8,
                 threads: int = 2, memory: str = "fast", factory: Callable = open_batch,
                 on_generation: Callable[[int, int, int, int], None] | None = None,
                 prefill_budget: int | None = None, head: str | None = None):
        """factory(engines, max_num_seqs=, threads=, memory=[, prefill_budget=][, head=]) -> a
        BatchGenerator (one copy; prefill_budget and head are passed only when set). on_generation(prompt tokens, tokens,
        drafted, accepted): once per finished sample."""
        if copies < 1 or max_num_seqs < 1 or queue_size < 0:
            raise SpecrtError(f"copies={copies}, max_num_seqs={max_num_seqs}, queue_size={queue_size}: need copies "
                              ">= 1, max_num_seqs >= 1 and queue_size >= 0")
        self.engines, self.copies, self.max_num_seqs = Path(engines), copies, max_num_seqs
        self.queue_size, self.threads, self.memory = queue_size, threads, memory
        self.factory, self.on_generation = factory, on_generation
        self.extra = {**({"prefill_budget": prefill_budget} if prefill_budget is not None else {}),
                      **({"head": head} if head is not None else {})}
        self.info: list[EngineInfo] = []
        self.gens: list = []
        self._pending: collections.deque[Job] = collections.deque()
        self._lock = threading.Lock()          # the queue and the choice of a copy
        self._rows = threading.Lock()          # EngineInfo.busy (taken by sinks)
        self._closing = False

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Load the copies one after the other (measuring each one's memory); each copy's engine
        thread takes queued jobs as its rows free."""
        for i in range(self.copies):
            before = rss_mib()
            gen = self.factory(self.engines, max_num_seqs=self.max_num_seqs, threads=self.threads,
                               memory=self.memory, **self.extra)
            self.info.append(EngineInfo(i, self.max_num_seqs, self.memory, round(rss_mib() - before, 1)))
            self.gens.append(gen)
            gen.feed = lambda i=i: self._feed(i)
            log.info("engine copy %d loaded (max_num_seqs %d, %s memory): +%.0f MiB, process RSS %.0f MiB",
                     i, self.max_num_seqs, self.memory, self.info[i].load_mib, rss_mib())

    def close(self, timeout: float | None = None) -> None:
        """Stop taking jobs, fail the queued ones (503), cancel the running ones, join the engines."""
        with self._lock:
            self._closing = True
            dropped = list(self._pending)
            self._pending.clear()
        for job in dropped:
            job.cancelled.set()
            job.push(0, Failed(ServerShuttingDownError("the server is shutting down: retry on another instance")))
        for gen in self.gens:
            gen.feed = None
            gen.close(timeout)

    @property
    def method(self) -> str:
        """"speculative" when the engines may speculate (by measured cost, or every round), else "plain"."""
        pol = self.gens[0].engine.policy if self.gens else None
        return "speculative" if pol is not None and (pol.costs is not None or pol.fixed) else "plain"

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> int:
        """Rows held by running requests, over all copies."""
        return sum(w.busy for w in self.info)

    @property
    def stats(self) -> list:
        """Each copy's EngineStats (runtime/batch/engine.py)."""
        return [g.engine.stats for g in self.gens]

    # --- the handler's side -----------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue `job` (QueueFullError when the pool is full) and start it now if a copy has rows free."""
        with self._lock:
            if self._closing:
                raise ServerShuttingDownError("the server is shutting down: retry on another instance")
            n = job.request.n
            used = self.busy + sum(j.request.n for j in self._pending)
            if used + n > self.copies * self.max_num_seqs + self.queue_size:
                raise QueueFullError(
                    f"{self.busy} rows are in use and {len(self._pending)} requests waiting ({self.copies} engine "
                    f"cop{'y' if self.copies == 1 else 'ies'} x max-num-seqs {self.max_num_seqs}, queue size "
                    f"{self.queue_size}): retry later, or start the server with more --workers, a larger "
                    "--max-num-seqs or a larger --queue-size", code="queue_full")
            self._pending.append(job)
            self._dispatch(None)

    def cancel(self, job: Job) -> None:
        """Idempotent. A queued job leaves the queue now; a running one ends at its engine's next step."""
        job.cancelled.set()
        with self._lock:
            try:
                self._pending.remove(job)
            except ValueError:
                pass
            handles = list(job.handles)
        for h in handles:
            h.cancel()

    # --- the engines' side ------------------------------------------------------------
    def _feed(self, i: int) -> None:
        """On copy i's engine thread, before its step: take the queued jobs its free rows fit."""
        if self._pending:
            with self._lock:
                self._dispatch(i)

    def _dispatch(self, only: int | None) -> None:
        """Start queued jobs, oldest first, on the copy with the most free rows (or on copy
        `only`); the first job no copy has rows for waits, and so do the ones behind it.
        Called with self._lock held."""
        while self._pending and not self._closing:
            job = self._pending[0]
            n = job.request.n
            with self._rows:
                free = [(self.max_num_seqs - w.busy, w.index) for w in self.info if only in (None, w.index)]
            rows, i = max(free, default=(0, -1), key=lambda f: (f[0], -f[1]))
            if rows < n:
                return
            self._pending.popleft()
            self._start(job, i)

    def _start(self, job: Job, i: int) -> None:
        r, info = job.request, self.info[i]
        with self._rows:
            info.busy += r.n
        sinks = [self._sink(job, info, s) for s in range(r.n)]
        try:
            # n samples: the prompt prefilled once, a row per sample (BatchGenerator.submit_n)
            job.handles = self.gens[i].submit_n(
                list(r.prompt_ids), r.n, max_new_tokens=r.max_tokens, sampling=r.sampling, stop=list(r.stop),
                sinks=sinks, stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos, structured=r.structured,
                logprobs=r.logprobs)
        except Exception as e:        # refused before it reached the engine: its rows were never taken
            with self._rows:
                info.busy -= r.n
            if isinstance(e, SpecrtError):      # the request's arguments (GrammarError is one): its 400
                e = RequestError(str(e))
            else:
                log.exception("submitting a request failed")
            job.push(0, Failed(http_error(e)))
            return
        with self._rows:
            info.requests += 1
        if job.cancelled.is_set():    # the client left while it was being submitted
            for h in job.handles:
                h.cancel()

    def _sink(self, job: Job, info: EngineInfo, index: int):
        """Sample `index` of `job`: its engine events, on the engine thread, to the handler. It
        never raises (a sink that raised would lose the request's final event, and its row)."""
        r, tokens = job.request, [0]

        def sink(ev) -> None:
            final = not isinstance(ev, Delta)
            try:
                # counted before its row is free: whoever sees the row free (/health) sees its tokens
                if isinstance(ev, Done) and self.on_generation is not None:
                    self.on_generation(len(r.prompt_ids), tokens[0], ev.metrics.drafted, ev.metrics.accepted)
            except Exception:
                log.exception("counting a request's tokens failed")
            if final:
                with self._rows:        # its row is free for the next job from the next step
                    info.busy -= 1
            try:
                if not final:
                    tokens[0] += len(ev.tokens)
                    job.push(index, ev)
                elif isinstance(ev, Done):
                    if ev.finish_reason not in ("cancelled", "timeout"):   # else nobody waits for it
                        job.push(index, dataclasses.replace(ev, completion_tokens=tokens[0]))
                else:
                    log.error("generation failed: %s", ev.error)
                    job.push(index, Failed(http_error(ev.error)))
            except Exception:
                log.exception("passing a request's event on failed")
        return sink
