"""Prometheus metrics: engine gauges and counters read at scrape time, latency histograms.

Each app owns a private ``CollectorRegistry`` (tests build several apps in one process).
Engine numbers come from ``engine.stats()`` when ``/metrics`` is scraped; the server
observes TTFT, inter-token latency and end-to-end latency per choice. The process's own
``process_*`` series (prometheus-client's ProcessCollector) come with them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.cache_salt import SALT_BUCKETS
from engine.engine_stats import salt_counter
from engine.kvcache.miss_reasons import MISS_REASONS
from engine.request import RequestOutput

PREFIX = "hiserve:"
TTFT_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)

# (metric name, help, stats key) of engine counters without labels
_PLAIN_COUNTERS = (
    ("prompt_tokens_total", "Prompt tokens of admitted requests.", "prompt_tokens_total"),
    ("generation_tokens_total", "Generated tokens.", "generation_tokens_total"),
    ("requests_finished_total", "Requests that finished (any reason).", "requests_finished_total"),
    ("retractions_total", "Running requests retracted to free KV.", "retractions_total"),
    (
        "share_preemptions_total",
        "Running requests retracted so that another client got its share of running slots.",
        "share_preemptions_total",
    ),
    (
        "reader_pauses_total",
        "Running requests retracted because their stream's reader was behind.",
        "reader_pauses_total",
    ),
    (
        "mixed_steps_total",
        "Forward passes holding decode tokens and prefill chunks together.",
        "mixed_steps_total",
    ),
    (
        "decode_graph_replays_total",
        "Decode steps replayed from device graphs.",
        "decode_graph_replays_total",
    ),
    (
        "mixed_graph_replays_total",
        "Steps that prefill (with or without decodes) replayed from device graphs.",
        "mixed_graph_replays_total",
    ),
    ("hicache_backup_tokens_total", "Tokens copied device -> host.", "backup_tokens_total"),
    ("hicache_backup_bytes_total", "Bytes copied device -> host.", "backup_bytes_total"),
    ("hicache_loadback_tokens_total", "Tokens copied host -> device.", "loadback_tokens_total"),
    ("hicache_loadback_bytes_total", "Bytes copied host -> device.", "loadback_bytes_total"),
    (
        "hicache_storage_write_tokens_total",
        "Tokens written host -> L3 store.",
        "storage_write_tokens_total",
    ),
    (
        "hicache_storage_write_failed_tokens_total",
        "Tokens the L3 store did not take (errors, full).",
        "storage_write_failed_tokens_total",
    ),
    (
        "hicache_storage_write_dropped_tokens_total",
        "Tokens not written to L3 because its write queue was full.",
        "storage_write_dropped_tokens_total",
    ),
    (
        "hicache_storage_prefetch_tokens_total",
        "Tokens read L3 store -> host at admission.",
        "storage_prefetch_tokens_total",
    ),
    (
        "hicache_storage_pages_rejected_total",
        "L3 pages that failed authentication (swapped, forged, cut short): misses.",
        "storage_pages_rejected_total",
    ),
    (
        "hicache_storage_pages_evicted_total",
        "L3 pages this replica removed to keep the store under its size.",
        "storage_pages_evicted_total",
    ),
    (
        "hicache_storage_writes_refused_total",
        "L3 pages not written because the store or its volume was full.",
        "storage_writes_refused_total",
    ),
)


class EngineCollector(Collector):
    """Reads ``engine.stats()``/``health()`` at scrape time; nothing before the engine loads."""

    def __init__(self, get_engine: Callable[[], Any]) -> None:
        self._get_engine = get_engine

    def describe(self) -> list[Metric]:
        return []  # dynamic: the registry must not call collect() at registration

    def collect(self) -> Iterator[Metric]:
        engine = self._get_engine()
        ready = GaugeMetricFamily(
            PREFIX + "engine_ready", "1 once the model is loaded and the engine loop is alive."
        )
        alive = engine is not None and bool(engine.is_alive())
        ready.add_metric([], 1.0 if alive else 0.0)
        yield ready
        if engine is None:
            return
        stats = engine.stats()

        def get(key: str) -> float:
            return float(stats.get(key, 0.0))

        # Host slots in neither the free list nor the tree (copies in flight); 0 when idle.
        host_used = (
            get("host_used")
            if "host_used" in stats
            else (
                max(0.0, get("host_total") - get("host_free") - get("host_cached"))
                if "host_free" in stats
                else 0.0
            )
        )
        for name, doc, values in (
            ("kv_used_tokens", "KV tokens owned by running requests.", (get("kv_used"), host_used)),
            (
                "kv_cached_tokens",
                "KV tokens held by the prefix cache.",
                (get("kv_cached"), get("host_cached")),
            ),
            ("kv_free_tokens", "Free KV tokens.", (get("kv_free"), get("host_free"))),
            ("kv_total_tokens", "KV capacity in tokens.", (get("kv_total"), get("host_total"))),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["tier"])
            gauge.add_metric(["device"], values[0])
            gauge.add_metric(["host"], values[1])
            yield gauge
        for name, doc, key in (
            ("num_running_requests", "Requests in the running batch.", "running"),
            ("num_waiting_requests", "Requests waiting for admission.", "waiting"),
            (
                "hicache_storage_writes_pending",
                "L3 writes queued or in progress (0: every page handed over is stored).",
                "storage_writes_pending",
            ),
            (
                "hicache_storage_used_bytes",
                "Bytes in the file L3 store's directory, every replica's pages (last measured).",
                "storage_used_bytes",
            ),
        ):
            gauge = GaugeMetricFamily(PREFIX + name, doc)
            gauge.add_metric([], get(key))
            yield gauge
        prompt_total = get("prompt_tokens_total")
        cached_device, cached_host, cached_storage = (
            get("cached_tokens_device_total"),
            get("cached_tokens_host_total"),
            get("cached_tokens_storage_total"),
        )
        hit_rate = GaugeMetricFamily(
            PREFIX + "prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens, since start."
        )
        hit_rate.add_metric(
            [],
            (cached_device + cached_host + cached_storage) / prompt_total if prompt_total else 0.0,
        )
        yield hit_rate
        for name, doc, key in _PLAIN_COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, doc)
            counter.add_metric([], get(key))
            yield counter
        cached = CounterMetricFamily(
            PREFIX + "cached_prompt_tokens_total",
            "Prompt tokens served from the prefix cache.",
            labels=["source"],
        )
        cached.add_metric(["device"], cached_device)
        cached.add_metric(["host"], cached_host)
        cached.add_metric(["storage"], cached_storage)
        yield cached
        missed = CounterMetricFamily(
            PREFIX + "prompt_tokens_missed_total",
            "Prompt tokens not served by any cache tier, by why they missed "
            "(cached + missed == prompt tokens).",
            labels=["reason"],
        )
        for reason in MISS_REASONS:
            missed.add_metric([reason], get(f"prompt_tokens_missed_{reason}_total"))
        yield missed
        yield from _salt_bucket_counters(get)
        evicted = CounterMetricFamily(
            PREFIX + "evicted_tokens_total", "KV tokens evicted from a tier.", labels=["tier"]
        )
        evicted.add_metric(["device"], get("evicted_device_tokens_total"))
        evicted.add_metric(["host"], get("evicted_host_tokens_total"))
        yield evicted
        health = engine.health()
        info = GaugeMetricFamily(
            PREFIX + "host_tier_info",
            "HiCache host tier: allocation method and pinning (value 1).",
            labels=["enabled", "alloc_method", "pinned"],
        )
        info.add_metric(
            [
                str(bool(health.get("hicache", False))).lower(),
                str(health.get("host_alloc_method") or "none"),
                str(bool(health.get("pinned", False))).lower(),
            ],
            1.0,
        )
        yield info


def _salt_bucket_counters(get: Callable[[str], float]) -> Iterator[Metric]:
    """Prompt and cached tokens of salted requests by ``salt_bucket`` (the salt's digest
    mod SALT_BUCKETS): per-tenant hit rates with a fixed label set, never the salt."""
    for what, doc in (
        ("prompt", "Prompt tokens of requests with a cache_salt, by salt bucket."),
        ("cached", "Cached prompt tokens (every tier) of requests with a cache_salt, by bucket."),
    ):
        family = CounterMetricFamily(
            PREFIX + f"salted_{what}_tokens_total", doc, labels=["salt_bucket"]
        )
        for bucket in range(SALT_BUCKETS):
            family.add_metric([str(bucket)], get(salt_counter(bucket, what)))
        yield family


class ServerMetrics:
    """The app's registry plus the per-request histograms the server observes."""

    def __init__(self, get_engine: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(get_engine))
        # The standard process_* series (resident memory, CPU seconds, open descriptors):
        # what an operator watches during an attack or a leak, and what
        # bench.grammar_abuse reads to check memory comes back afterwards.
        ProcessCollector(registry=self.registry)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Arrival at the server to the first generated token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival at the server to the last token.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.finished = Counter(
            PREFIX + "request_success_total",
            "Choices finished, by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, start: float) -> RequestTimer:
        return RequestTimer(self, start)


class RequestTimer:
    """Latency bookkeeping of one choice (one engine request)."""

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics = metrics
        self.start = start
        self.last_token: float | None = None

    def observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.new_token_ids:
            if self.last_token is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                per_token = (now - self.last_token) / len(out.new_token_ids)
                for _ in out.new_token_ids:
                    self.metrics.itl.observe(per_token)
            self.last_token = now
        if out.finished:
            self.metrics.e2e.observe(now - self.start)
            self.metrics.finished.labels(finished_reason=out.finish_reason or "unknown").inc()
