"""`BatchPool`: the server's requests on one batched engine (runtime/batch/): one copy of the
weights, up to `max_num_seqs` requests decoding together, the rest queued.

It offers the app what `EnginePool` does (submit / cancel / start / close, queued, busy,
info), so the HTTP layer does not know which one it drives:

    async handler ──submit(job)──► BatchGenerator.submit(ids, sink=...) ──► engine thread
          ▲                                                                    │ one step for all rows
          └── job.events (asyncio.Queue) ◄── loop.call_soon_threadsafe ◄── sink(Delta | Done | Failed)

A job that is cancelled (client gone, timeout) is dropped at the engine's next step, from the
queue or from its row; its cache row goes to the next request at once.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from specrt.errors import OverloadedError, SpecrtError
from specrt.runtime.batch.request import Delta as EngineDelta
from specrt.runtime.batch.request import Done as EngineDone
from specrt.runtime.batch.request import Failed as EngineFailed
from specrt.runtime.grammar import GrammarError
from specrt.serve.errors import QueueFullError, RequestError, ServerShuttingDownError
from specrt.serve.workers import FINISH_REASONS, Delta, Done, Failed, Job, rss_mib

log = logging.getLogger("specrt.serve")


@dataclass
class EngineInfo:
    max_num_seqs: int
    load_mib: float             # process RSS growth while the engine loaded
    requests: int = 0


class BatchPool:
    def __init__(self, engines: str | Path, *, max_num_seqs: int, queue_size: int, threads: int,
                 factory: Callable, on_generation: Callable[[int, int, int, int], None] | None = None):
        """factory(engines, max_num_seqs=, threads=) -> a BatchGenerator."""
        if max_num_seqs < 1 or queue_size < 0:
            raise SpecrtError(f"max_num_seqs={max_num_seqs}, queue_size={queue_size}: need max_num_seqs >= 1 and "
                              "queue_size >= 0")
        self.engines, self.max_num_seqs, self.queue_size, self.threads = Path(engines), max_num_seqs, queue_size, threads
        self.factory, self.on_generation = factory, on_generation
        self.gen = None
        self.info: list[EngineInfo] = []
        self._closing = False
        self.method = "batched"

    def start(self) -> None:
        before = rss_mib()
        self.gen = self.factory(self.engines, max_num_seqs=self.max_num_seqs, threads=self.threads)
        self.info = [EngineInfo(self.max_num_seqs, round(rss_mib() - before, 1))]
        log.info("batched engine loaded (max_num_seqs %d): +%.0f MiB, process RSS %.0f MiB",
                 self.max_num_seqs, self.info[0].load_mib, rss_mib())

    def close(self, timeout: float | None = None) -> None:
        self._closing = True
        if self.gen is not None:
            self.gen.close(timeout)

    @property
    def queued(self) -> int:
        return self.gen.engine.queued if self.gen else 0

    @property
    def busy(self) -> int:
        return self.gen.engine.active if self.gen else 0

    @property
    def stats(self):
        return self.gen.engine.stats if self.gen else None

    def submit(self, job: Job) -> None:
        if self._closing:
            raise ServerShuttingDownError("the server is shutting down: retry on another instance")
        if self.busy + self.queued >= self.max_num_seqs + self.queue_size:
            raise QueueFullError(
                f"{self.busy} requests are running and {self.queued} waiting (max-num-seqs {self.max_num_seqs}, "
                f"queue size {self.queue_size}): retry later, or start the server with a larger --max-num-seqs "
                "or --queue-size", code="queue_full")
        r = job.request
        try:
            # n samples: the prompt prefilled once, a row per sample (BatchGenerator.submit_n)
            job.handles = self.gen.submit_n(list(r.prompt_ids), r.n, max_new_tokens=r.max_tokens, sampling=r.sampling,
                                            stop=list(r.stop), sinks=[self._sink(job, i) for i in range(r.n)],
                                            stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos,
                                            structured=r.structured, logprobs=r.logprobs)
        except OverloadedError as e:
            raise QueueFullError(str(e), code="queue_full") from None
        self.info[0].requests += 1

    def cancel(self, job: Job) -> None:
        """Idempotent: the engine drops the request at its next step."""
        job.cancelled.set()
        for h in getattr(job, "handles", ()):
            h.cancel()

    def _sink(self, job: Job, index: int = 0):
        r = job.request
        state = {"n": 0}

        def sink(ev) -> None:      # on the engine thread
            if isinstance(ev, EngineDelta):
                state["n"] += len(ev.tokens)
                job.push(Delta(ev.text, len(ev.tokens), time.perf_counter(), ev.logprobs, index))
            elif isinstance(ev, EngineDone):
                m = ev.metrics
                if self.on_generation is not None:
                    self.on_generation(len(r.prompt_ids), state["n"], m.drafted, m.accepted)
                if ev.finish_reason in ("cancelled", "timeout"):
                    return          # the handler is gone or has answered already
                job.push(Done(FINISH_REASONS.get(ev.finish_reason, "stop"), len(r.prompt_ids), state["n"], {
                    "method": "batched", "acceptance_rate": round(m.acceptance_rate, 4),
                    "mean_acceptance_length": round(m.mean_acceptance_length, 3)}, index))
            elif isinstance(ev, EngineFailed):
                e = ev.error
                log.error("batched generation failed: %s", e)
                if isinstance(e, GrammarError):     # a request's own grammar failed: its 400, as the workers'
                    e = RequestError(str(e))
                job.push(Failed(e if isinstance(e, RequestError) else RequestError(
                    f"generation failed ({type(e).__name__}: {e}); see the server log", status=500,
                    type="server_error")))
        return sink
