"""Prometheus metrics of a running server (`GET /metrics`), through prometheus_client.

Gauges are read from the engine when scraped; counters and histograms are fed by `observe`,
which the app calls with every RequestOutput it streams.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class ServerMetrics:
    def __init__(self, engine_ref):
        """`engine_ref()` returns the Engine, or None while the model loads."""
        r = self.registry = CollectorRegistry()
        self._engine = engine_ref

        def engine_value(fn):
            return lambda: (fn(self._engine()) if self._engine() is not None else 0.0)

        def request_ids(seqs) -> set[str]:      # n > 1 samples of one request count once
            return {s.request.request_id for s in list(seqs)}
        Gauge("kiln_requests_running", "Requests with a sequence in the running batch", registry=r).set_function(
            engine_value(lambda e: len(request_ids(e.scheduler.running))))
        Gauge("kiln_requests_waiting", "Requests waiting to be admitted (none of their sequences running)",
              registry=r).set_function(engine_value(
                  lambda e: len(request_ids(e.scheduler.waiting) - request_ids(e.scheduler.running))))
        Gauge("kiln_kv_cache_usage_ratio", "Share of KV pages held by sequences", registry=r).set_function(
            engine_value(lambda e: 1 - e.pool.num_free / e.pool.num_pages))
        Gauge("kiln_kv_pages_used", "KV pages held by sequences", registry=r).set_function(
            engine_value(lambda e: e.pool.num_pages - e.pool.num_free))
        Gauge("kiln_kv_pages_total", "KV pages in the pool", registry=r).set_function(
            engine_value(lambda e: e.pool.num_pages))
        def hit_rate(e):
            stats = e.pool.stats
            return stats.hit_tokens / stats.queried_tokens if stats.queried_tokens else 0.0
        Gauge("kiln_prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up",
              registry=r).set_function(engine_value(hit_rate))
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("kiln_requests_finished", "Finished requests by finish reason", ["reason"], registry=r)
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("kiln_inter_token_latency_seconds", "Time between tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS,
                             registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class RequestTracker:
    """Feeds one request's outputs into the metrics as they stream."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics
        self.last_time: float | None = None
        self.tokens = 0

    def observe(self, out) -> None:
        now = time.perf_counter()
        new = sum(len(c.new_token_ids) for c in out.outputs)
        if new:
            if self.last_time is None:
                if out.metrics.ttft is not None:
                    self.m.ttft.observe(out.metrics.ttft)
            else:
                self.m.itl.observe((now - self.last_time) / new)
            self.last_time = now
            self.tokens += new
            self.m.generation_tokens.inc(new)
        if out.finished:
            self.m.prompt_tokens.inc(len(out.prompt_token_ids))
            self.m.e2e.observe(now - out.metrics.arrival_time)
            for c in out.outputs:
                self.m.finished.labels(c.finish_reason or "unknown").inc()

    def aborted(self, choices: int = 1) -> None:
        """A request (with `choices` unfinished samples) that a client closed or a failure ended."""
        self.m.finished.labels("abort").inc(choices)
