"""Prometheus collectors behind GET /metrics, in a registry of their own (one per app,
so two servers in one process, as in the tests, never share counters).

Names follow vLLM's where one exists (time_to_first_token_seconds,
inter_token_latency_seconds); the acceptance rate is exported both as the two counters
it is made of (rate() them in PromQL) and as a cumulative gauge.
"""
from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# TTFT includes queueing; ITL is the gap between two streamed tokens (speculation emits
# bursts: a verify pass releases up to k+1 tokens at once, then the next pass takes a step)
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
OUTCOMES = ("ok", "bad_request", "rejected", "cancelled", "timeout", "error")


class ServerMetrics:
    def __init__(self, model: str):
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)            # process_resident_memory_bytes, cpu seconds
        label = {"model": model}
        self.requests = Counter("specrt_requests", "Requests answered, by endpoint and outcome",
                                ["model", "endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("specrt_prompt_tokens", "Prompt tokens processed", ["model"],
                                     registry=r).labels(**label)
        self.generation_tokens = Counter("specrt_generation_tokens", "Tokens generated", ["model"],
                                         registry=r).labels(**label)
        self.draft_tokens = Counter("specrt_spec_decode_draft_tokens", "Draft tokens proposed", ["model"],
                                    registry=r).labels(**label)
        self.accepted_tokens = Counter("specrt_spec_decode_accepted_tokens", "Draft tokens accepted",
                                       ["model"], registry=r).labels(**label)
        self.acceptance_rate = Gauge("specrt_spec_decode_acceptance_rate",
                                     "Accepted / drafted tokens since the server started", ["model"],
                                     registry=r).labels(**label)
        self.acceptance_rate.set_function(self._rate)
        self.queue_depth = Gauge("specrt_queue_depth", "Requests waiting for a worker", ["model"],
                                 registry=r).labels(**label)
        self.workers_busy = Gauge("specrt_workers_busy", "Workers running a generation", ["model"],
                                  registry=r).labels(**label)
        self.ttft = Histogram("specrt_time_to_first_token_seconds", "Request arrival to first token",
                              ["model"], buckets=_TTFT_BUCKETS, registry=r).labels(**label)
        self.itl = Histogram("specrt_inter_token_latency_seconds", "Gap between consecutive streamed tokens",
                             ["model"], buckets=_ITL_BUCKETS, registry=r).labels(**label)
        self.e2e = Histogram("specrt_request_duration_seconds", "Request arrival to last token",
                             ["model"], buckets=_E2E_BUCKETS, registry=r).labels(**label)
        self.model = model
        self._lock = threading.Lock()
        self._drafted = self._accepted = 0

    def _rate(self) -> float:
        with self._lock:
            return self._accepted / self._drafted if self._drafted else 0.0

    def record_generation(self, prompt_tokens: int, tokens: int, drafted: int, accepted: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(tokens)
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        with self._lock:
            self._drafted += drafted
            self._accepted += accepted

    def watch(self, queued: Callable[[], int], busy: Callable[[], int]) -> None:
        self.queue_depth.set_function(queued)
        self.workers_busy.set_function(busy)

    def watch_batch(self, stats: Callable[[], list]) -> None:
        """The engines' gauges: stats() -> each engine copy's EngineStats (runtime/batch/engine.py),
        an empty list before they load; steps and chunks are summed over the copies, occupancy
        is the mean running rows of a step of any copy."""
        r, label = self.registry, {"model": self.model}

        def total(fn):
            return lambda: sum(fn(s) for s in stats())

        def occupancy() -> float:
            steps = sum(s.steps for s in stats())
            return sum(s.row_steps for s in stats()) / steps if steps else 0.0

        Gauge("specrt_batch_occupancy", "Mean running rows per engine step since the server started", ["model"],
              registry=r).labels(**label).set_function(occupancy)
        Gauge("specrt_batch_steps", "Engine steps run since the server started", ["model"],
              registry=r).labels(**label).set_function(total(lambda s: s.steps))
        Gauge("specrt_batch_prefill_chunks", "Prompt chunks prefilled since the server started", ["model"],
              registry=r).labels(**label).set_function(total(lambda s: s.prefill_chunks))
        r.register(_StepCosts(self.model, stats))
        choice = Gauge("specrt_batch_step_choice", "Engine steps by the kind chosen (plain, pair, lookup, draft)",
                       ["model", "kind"], registry=r)
        for kind in ("plain", "pair", "lookup", "draft"):
            choice.labels(model=self.model, kind=kind).set_function(total(lambda s, k=kind: s.choices.get(k, 0)))

    def count(self, endpoint: str, outcome: str) -> None:
        assert outcome in OUTCOMES, outcome
        self.requests.labels(model=self.model, endpoint=endpoint, outcome=outcome).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StepCosts:
    """specrt_step_cost_factor{engine, shape}: how far the loop's own step times sit from the
    build's cost table (runtime/batch/live_costs.py), per engine copy: "overall" and
    each shape run ("target/T/rows", "draft/rows"). Far from 1 for long: the table is not this
    machine's now (`specrt retime` the folder). Absent while nothing was observed
    (SPECRT_LIVE_COSTS=0, plain steps only)."""

    def __init__(self, model: str, stats: Callable[[], list]):
        self.model, self.stats = model, stats

    def collect(self):
        g = GaugeMetricFamily("specrt_step_cost_factor",
                              "Observed step time / the build's table (running median), by engine copy and shape",
                              labels=["model", "engine", "shape"])
        for i, st in enumerate(self.stats()):
            live = getattr(st, "live", None)
            if live is None:
                continue
            snap = live.snapshot()
            g.add_metric([self.model, str(i), "overall"], snap["overall"])
            for shape, (factor, _) in sorted(snap["shapes"].items()):
                g.add_metric([self.model, str(i), "/".join(map(str, shape))], factor)
        yield g
