"""Prometheus metrics of a running server (`GET /metrics`), through prometheus_client.

Gauges are read from the engine when scraped (an EngineGauges, once per scrape; behind Ray, the
replicas' summed); counters and histograms are fed by `observe`,
which the app calls with every RequestOutput it streams. Each is exported under kiln's name and,
where vLLM has a metric of the same meaning, under vLLM's (`vllm:...`, labelled with the served
model's name), so that dashboards and routers built for vLLM read kiln unchanged.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


@dataclass
class EngineGauges:
    """What /metrics reads of an engine when scraped; a sum of them is a cluster's (kiln.serve.cluster)."""
    running: int = 0                  # requests with a sequence in the running batch
    waiting: int = 0                  # requests none of whose sequences runs
    kv_pages_used: int = 0
    kv_pages_total: int = 0
    prefix_queried: int = 0           # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0
    speculative: tuple | None = None  # (drafts, draft tokens, accepted tokens, accepted per position), or None
    lora: tuple | None = None         # (adapter slots, running adapters' names, waiting ones'), or None

    @classmethod
    def of(cls, engine) -> "EngineGauges":
        def request_ids(seqs) -> set[str]:      # n > 1 samples of one request count once
            return {s.request.request_id for s in list(seqs)}
        def adapters(seqs) -> tuple[str, ...]:
            return tuple(sorted({s.request.lora.lora_name for s in list(seqs) if s.request.lora is not None}))
        running = request_ids(engine.scheduler.running)
        stats, spec = engine.pool.stats, getattr(engine, "speculator", None)
        slots = getattr(engine, "lora_slots", None)
        return cls(len(running), len(request_ids(engine.scheduler.waiting) - running),
                   engine.pool.num_pages - engine.pool.num_free, engine.pool.num_pages, stats.queried_tokens,
                   stats.hit_tokens, None if spec is None else (spec.stats.drafts, spec.stats.draft_tokens,
                                                                spec.stats.accepted_tokens,
                                                                tuple(spec.stats.accepted_per_position)),
                   None if slots is None else (len(slots.holds), adapters(engine.scheduler.running),
                                               adapters(engine.scheduler.waiting)))

    def __add__(self, other: "EngineGauges") -> "EngineGauges":
        spec = self.speculative or other.speculative
        if self.speculative and other.speculative:
            a, b = self.speculative, other.speculative
            per = tuple(x + y for x, y in itertools.zip_longest(a[3], b[3], fillvalue=0))
            spec = (a[0] + b[0], a[1] + b[1], a[2] + b[2], per)
        lora = self.lora or other.lora
        if self.lora and other.lora:
            names = (tuple(sorted({*a, *b})) for a, b in zip(self.lora[1:], other.lora[1:]))
            lora = (self.lora[0] + other.lora[0], *names)
        counts = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                  if f.name not in ("speculative", "lora")}
        return EngineGauges(**counts, speculative=spec, lora=lora)


class ServerMetrics:
    def __init__(self, gauges_ref, model_name: str = "kiln"):
        """`gauges_ref()` returns the EngineGauges of the engine (or engines) behind the server, or
        None while the model loads."""
        r = self.registry = CollectorRegistry()
        self._gauges_ref, self.model_name = gauges_ref, model_name
        self.snapshot: EngineGauges | None = None        # taken once per scrape (render)

        def gauge_value(fn):
            return lambda: (fn(g) if (g := self.snapshot) is not None else 0.0)

        def gauge(names: tuple[str, str | None], doc: str, fn) -> None:
            Gauge(names[0], doc, registry=r).set_function(gauge_value(fn))
            if names[1]:
                Gauge(names[1], doc, ["model_name"], registry=r).labels(model_name).set_function(gauge_value(fn))
        gauge(("kiln_requests_running", "vllm:num_requests_running"), "Requests with a sequence in the running batch",
              lambda g: g.running)
        gauge(("kiln_requests_waiting", "vllm:num_requests_waiting"),
              "Requests waiting to be admitted (none of their sequences running)", lambda g: g.waiting)
        gauge(("kiln_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"), "Share of KV pages held by sequences",
              lambda g: g.kv_pages_used / g.kv_pages_total if g.kv_pages_total else 0.0)
        gauge(("kiln_kv_pages_used", None), "KV pages held by sequences", lambda g: g.kv_pages_used)
        gauge(("kiln_kv_pages_total", None), "KV pages in the pool", lambda g: g.kv_pages_total)
        gauge(("kiln_prefix_cache_hit_rate", None), "Prompt tokens found in the prefix cache / prompt tokens looked up",
              lambda g: g.prefix_hits / g.prefix_queried if g.prefix_queried else 0.0)
        r.register(_PrefixCacheCounters(self))
        r.register(_SpeculativeCounters(self))
        r.register(_LoRAInfo(self))

        def both(kind, names: tuple[str, str], doc: str, labels: tuple[str, ...] = (), **kw):
            """kiln's metric and vLLM's of the same meaning: a function of the labels' values -> both children."""
            ours = kind(names[0], doc, list(labels), registry=r, **kw)
            theirs = kind(names[1], doc, ["model_name", *[{"reason": "finished_reason"}.get(x, x) for x in labels]],
                          registry=r, **kw)
            return lambda *values: ((ours.labels(*values) if labels else ours), theirs.labels(model_name, *values))
        self.prompt_tokens = both(Counter, ("kiln_prompt_tokens", "vllm:prompt_tokens"),
                                  "Prompt tokens of finished requests")()
        self.generation_tokens = both(Counter, ("kiln_generation_tokens", "vllm:generation_tokens"),
                                      "Generated tokens")()
        self.finished = both(Counter, ("kiln_requests_finished", "vllm:request_success"),
                             "Finished requests by finish reason", ("reason",))
        self.ttft = both(Histogram, ("kiln_time_to_first_token_seconds", "vllm:time_to_first_token_seconds"),
                         "Time to first token", buckets=LATENCY_BUCKETS)()
        self.itl = both(Histogram, ("kiln_inter_token_latency_seconds", "vllm:inter_token_latency_seconds"),
                        "Time between tokens of a request", buckets=LATENCY_BUCKETS)()
        self.e2e = both(Histogram, ("kiln_e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds"),
                        "Arrival to finish", buckets=LATENCY_BUCKETS)()

    def render(self) -> bytes:
        self.snapshot = self._gauges_ref()
        return generate_latest(self.registry)

    def tracker(self) -> "RequestTracker":
        return RequestTracker(self)


class _PrefixCacheCounters:
    """vLLM's prefix-cache counters (tokens looked up, tokens found), read from the engine when scraped."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        g = self.metrics.snapshot
        for name, doc, value in (("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  g.prefix_queried if g else 0),
                                 ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  g.prefix_hits if g else 0)):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self.metrics.model_name], value)
            yield family


class _SpeculativeCounters:
    """Speculative decoding's counters under vLLM's names (spec_decode_*) and kiln's, read from the
    engines' Speculators when scraped; none where the engine does not speculate."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        g = self.metrics.snapshot
        if g is None or g.speculative is None:
            return
        (drafts, draft_tokens, accepted, per_position), model = g.speculative, [self.metrics.model_name]
        for name, doc, value in (("spec_decode_num_drafts", "Verify steps of a sequence with at least one guess",
                                  drafts),
                                 ("spec_decode_num_draft_tokens", "Guessed tokens verified", draft_tokens),
                                 ("spec_decode_num_accepted_tokens", "Guessed tokens the model confirmed",
                                  accepted)):
            ours = CounterMetricFamily(f"kiln_{name}", doc)
            ours.add_metric([], value)
            theirs = CounterMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
            theirs.add_metric(model, value)
            yield ours
            yield theirs
        doc = "Guessed tokens confirmed, by their position in the guess"
        ours = CounterMetricFamily("kiln_spec_decode_num_accepted_tokens_per_pos", doc, labels=["position"])
        theirs = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", doc,
                                     labels=["model_name", "position"])
        for position, value in enumerate(per_position):
            ours.add_metric([str(position)], value)
            theirs.add_metric([*model, str(position)], value)
        yield ours
        yield theirs


class _LoRAInfo:
    """vLLM's vllm:lora_requests_info: the adapters running and waiting as labels, the scrape's time as its
    value; none where the artifact has no adapter slots."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        g = self.metrics.snapshot
        if g is None or g.lora is None:
            return
        slots, running, waiting = g.lora
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        family.add_metric([str(slots), ",".join(waiting), ",".join(running)], time.time())
        yield family


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
                    _each(self.m.ttft, "observe", out.metrics.ttft)
            else:
                _each(self.m.itl, "observe", (now - self.last_time) / new)
            self.last_time = now
            self.tokens += new
            _each(self.m.generation_tokens, "inc", new)
        if out.finished:
            _each(self.m.prompt_tokens, "inc", len(out.prompt_token_ids))
            _each(self.m.e2e, "observe", now - out.metrics.arrival_time)
            for c in out.outputs:
                _each(self.m.finished(c.finish_reason or "unknown"), "inc")

    def aborted(self, choices: int = 1) -> None:
        """A request (with `choices` unfinished samples) that a client closed or a failure ended."""
        _each(self.m.finished("abort"), "inc", choices)


def _each(metrics: tuple, method: str, *args) -> None:
    """kiln's metric and vLLM's, fed alike."""
    for metric in metrics:
        getattr(metric, method)(*args)
