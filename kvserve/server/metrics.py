"""Prometheus metrics: engine figures read from LLM.stats() at scrape time, latencies observed here.

/metrics answers from the server's start: while the model loads every engine figure is 0, and a
figure the engine has not reported (yet) is 0 rather than a failed scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = _Figures(self.stats() or {})  # None: still loading
        total = s["kv_blocks_total"] or 1
        yield GaugeMetricFamily("kvserve_requests_running", "Requests in the running batch.", s["num_running"])
        yield GaugeMetricFamily("kvserve_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"])
        yield GaugeMetricFamily(
            "kvserve_requests_paused", "Requests held out of the batch: their client is not reading.", s["num_paused"]
        )
        yield GaugeMetricFamily(
            "kvserve_kv_cache_usage_ratio", "Fraction of KV blocks in use.", s["kv_blocks_used"] / total
        )
        yield GaugeMetricFamily("kvserve_kv_blocks_used", "KV blocks in use.", s["kv_blocks_used"])
        yield GaugeMetricFamily(
            "kvserve_kv_blocks_cached", "Free KV blocks kept for prefix hits.", s["kv_blocks_cached"]
        )
        yield GaugeMetricFamily("kvserve_kv_blocks_total", "KV blocks in the pool.", s["kv_blocks_total"])
        yield GaugeMetricFamily("kvserve_sessions_active", "Open sessions.", s["num_sessions"])
        yield GaugeMetricFamily(
            "kvserve_session_kv_blocks", "KV blocks pinned by sessions between turns.", s["session_kv_blocks"]
        )
        for name, key, doc in (
            ("kvserve_prefix_cache_hit_tokens", "prefix_cache_hit_tokens_total", "Prompt tokens served from cache."),
            ("kvserve_prompt_tokens", "prompt_tokens_total", "Prompt tokens received."),
            ("kvserve_generation_tokens", "generation_tokens_total", "Tokens generated (computed)."),
            ("kvserve_requests_aborted", "num_aborted_total", "Requests aborted."),
            ("kvserve_preemptions", "num_preemptions_total", "Requests preempted for KV space."),
            ("kvserve_engine_steps", "steps_total", "Engine steps run."),
        ):
            yield CounterMetricFamily(name, doc, value=s[key])


class _Figures(dict):
    """Engine stats where a figure not reported is 0."""

    def __missing__(self, key: str) -> int:
        return 0


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any] | None]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.rejected = Counter(
            "kvserve_requests_rejected", "Requests refused for overload (429).", registry=self.registry
        )
        self.ttft = Histogram(
            "kvserve_time_to_first_token_seconds",
            "Time from request arrival to its first token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvserve_e2e_request_latency_seconds",
            "Time from request arrival to its last token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
