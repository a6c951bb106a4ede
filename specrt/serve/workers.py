"""`EnginePool`: N worker threads, each owning one `SpeculativeGenerator`, behind a bounded queue.

Ownership, not locking, keeps requests apart: worker i creates generator i and only
worker i's thread ever calls it, one job at a time, so two requests can never share
a KV cache (the runtime's own concurrent-use guard is never reached).

    async handler ──submit(job)──► pending deque ──► worker thread i ── gen_i.stream()
          ▲                        (capacity: workers + queue_size, else 429)   │
          └──── job.events (asyncio.Queue) ◄── loop.call_soon_threadsafe ◄───────┘

A job that is cancelled (client gone, timeout) is dropped from the queue at once, or,
if running, stopped at its next token: the worker closes the `stream()` generator,
whose `finally` rewinds the caches, and takes the next job. Capacity is released
before the final event is sent, so a client that has read its answer can send the
next request into a free slot.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specrt import manifest as mf
from specrt.errors import SpecrtError
from specrt.runtime import SpeculativeGenerator
from specrt.serve.errors import QueueFullError, RequestError, ServerShuttingDownError
from specrt.serve.validation import GenerationRequest

log = logging.getLogger("specrt.serve")

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "max_context": "length"}


@dataclass(frozen=True)
class Delta:
    text: str
    tokens: int
    t: float                    # time.perf_counter() when the worker produced it
    logprobs: tuple | None = None   # TokenLogprob per token (runtime/logprobs.py), when asked for
    index: int = 0                  # which of the request's n samples (OpenAI's choices[].index)


@dataclass(frozen=True)
class Done:
    finish_reason: str          # OpenAI's: "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    metrics: dict = field(default_factory=dict)
    index: int = 0                  # which of the request's n samples


@dataclass(frozen=True)
class Failed:
    error: RequestError


class Job:
    """One request on its way through the pool. `events` is read by the async handler only."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.t_arrival = time.perf_counter()

    def push(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:    # the event loop is closed: nobody is listening any more
            self.cancelled.set()


@dataclass
class WorkerInfo:
    index: int
    memory: str
    load_mib: float             # process RSS growth while this worker's generator loaded
    requests: int = 0
    busy: bool = False


def load_generator(engines: Path, *, memory: str, threads: int, engine: str = "auto") -> SpeculativeGenerator:
    """A service speculates (or decodes plainly, when the build has no draft). A quantized
    target also loads its one-token graph: adaptive k then falls back to plain and pair steps
    when drafting does not pay, which on SmolLM2 int4 doubles a request's speed (measured
    2026-12-01: 98-104 vs 41-50 tok/s, 3 chat prompts x 128 tokens, same run); the graph's
    weights are small. An fp32 target does not: its one-token graph would hold another
    pre-packed copy of the fp32 weights. engine: as SpeculativeGenerator's (auto: the batch of one
    on a `--batch` folder; "one-row": its one-row graphs)."""
    man = mf.load(engines)
    if man.draft is None:
        methods = ("plain",)
    elif man.target.precision != "fp32":
        methods = ("speculative", "plain")
    else:
        methods = ("speculative",)
    return SpeculativeGenerator(engines, memory=memory, threads=threads, methods=methods, engine=engine)


def rss_mib() -> float:
    """Resident set size of this process (Linux /proc; 0.0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


class EnginePool:
    def __init__(self, engines: str | Path, *, workers: int = 1, queue_size: int = 8, memory: str = "fast",
                 threads: int = 2, factory: Callable[..., SpeculativeGenerator] = load_generator,
                 on_generation: Callable[[int, int, int, int], None] | None = None):
        if workers < 1 or queue_size < 0:
            raise SpecrtError(f"workers={workers}, queue_size={queue_size}: need workers >= 1 and queue_size >= 0")
        self.engines, self.workers, self.queue_size = Path(engines), workers, queue_size
        self.memory, self.threads, self.factory, self.on_generation = memory, threads, factory, on_generation
        self.info: list[WorkerInfo] = []
        self._gens: list[SpeculativeGenerator] = []
        self._threads: list[threading.Thread] = []
        self._pending: collections.deque[Job] = collections.deque()
        self._busy = 0
        self._closing = False
        self._cond = threading.Condition()

    # --- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        """Load one generator per worker (sequentially, measuring each one's memory), then
        start the worker threads."""
        for i in range(self.workers):
            before = rss_mib()
            self._gens.append(self.factory(self.engines, memory=self.memory, threads=self.threads))
            self.info.append(WorkerInfo(i, self.memory, round(rss_mib() - before, 1)))
            log.info("worker %d loaded (%s memory): +%.0f MiB, process RSS %.0f MiB",
                     i, self.memory, self.info[i].load_mib, rss_mib())
        for i in range(self.workers):
            t = threading.Thread(target=self._work, args=(i,), name=f"specrt-worker-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, timeout: float | None = None) -> None:
        """Stop taking jobs, fail the queued ones (503), let running ones end, join the threads."""
        with self._cond:
            self._closing = True
            dropped = list(self._pending)
            self._pending.clear()
            self._cond.notify_all()
        for job in dropped:
            job.cancelled.set()
            job.push(Failed(ServerShuttingDownError("the server is shutting down: retry on another instance")))
        for t in self._threads:
            t.join(timeout)
        self._gens.clear()

    @property
    def method(self) -> str:
        return self._gens[0].methods[0] if self._gens else "speculative"

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def busy(self) -> int:
        return self._busy

    # --- the handler's side -----------------------------------------------------------
    def submit(self, job: Job) -> None:
        with self._cond:
            if self._closing:
                raise ServerShuttingDownError("the server is shutting down: retry on another instance")
            if len(self._pending) + self._busy >= self.workers + self.queue_size:
                raise QueueFullError(
                    f"all {self.workers} workers are busy and {len(self._pending)} requests are waiting "
                    f"(queue size {self.queue_size}): retry later, or start the server with more "
                    "--workers or a larger --queue-size", code="queue_full")
            self._pending.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Idempotent. A queued job leaves the queue now; a running one stops at its next token."""
        job.cancelled.set()
        with self._cond:
            try:
                self._pending.remove(job)
            except ValueError:
                pass

    # --- the worker's side ------------------------------------------------------------
    def _work(self, i: int) -> None:
        gen, info = self._gens[i], self.info[i]
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                job = self._pending.popleft()
                self._busy += 1
                info.busy = True
            final = None
            try:
                final = self._run(gen, job)
            finally:
                with self._cond:
                    self._busy -= 1
                    info.busy = False
                    info.requests += 1
            if final is not None:
                job.push(final)

    def _run(self, gen: SpeculativeGenerator, job: Job):
        if job.cancelled.is_set():
            return None
        r = job.request
        before, n, cancelled = gen.last_metrics, 0, False
        stream = gen.stream(list(r.prompt_ids), max_new_tokens=r.max_tokens, sampling=r.sampling,
                            stop=list(r.stop), method=self.method, stop_token_ids=r.stop_token_ids,
                            ignore_eos=r.ignore_eos, structured=r.structured, logprobs=r.logprobs)
        try:
            for chunk in stream:
                if job.cancelled.is_set():
                    cancelled = True
                    break
                n += len(chunk.tokens)
                if chunk.text or chunk.tokens:
                    job.push(Delta(chunk.text, len(chunk.tokens), time.perf_counter(),
                                   None if chunk.logprobs is None else tuple(chunk.logprobs)))
        except SpecrtError as e:
            return Failed(RequestError(str(e)))
        except Exception:
            log.exception("generation failed")
            return Failed(RequestError("internal error during generation (see the server log)", status=500,
                                       type="server_error"))
        finally:
            stream.close()      # the loop's `finally` rewinds every cache before the next job
            m = gen.last_metrics if gen.last_metrics is not before else None
            if m is not None and self.on_generation is not None:
                self.on_generation(len(r.prompt_ids), n, m.drafted, m.accepted)
        if cancelled:
            return None
        if m is None:       # nothing ran (cannot happen for a validated request)
            return Done("stop", len(r.prompt_ids), n)
        return Done(FINISH_REASONS.get(m.finish_reason, "stop"), len(r.prompt_ids), n, {
            "method": m.method, "acceptance_rate": round(m.acceptance_rate, 4),
            "mean_acceptance_length": round(m.mean_acceptance_length, 3),
            "tokens_per_s": round(m.decode_tokens_per_s, 2), "time_s": round(m.time_total, 4)})
