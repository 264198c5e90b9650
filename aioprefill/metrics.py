"""Optional Prometheus exporter: `engine.stats()` as Prometheus metrics, read at scrape time.

Needs the `prometheus` extra (`pip install 'aioprefill[prometheus]'`). Nothing is recorded
twice: a custom collector reads one `engine.stats()` snapshot per scrape, so the engine's hot
path never touches prometheus_client. Histograms use the engine's fixed buckets
(`aioprefill.engine.histogram`), converted to seconds, so the series of several server processes
aggregate in PromQL::

    registry = metrics.registry_for(engine)            # at startup, once the engine exists
    body, content_type = metrics.render(registry)      # in the server's GET /metrics handler
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

try:
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"aioprefill.metrics needs prometheus-client: pip install 'aioprefill[prometheus]' ({exc})"
    ) from exc

from aioprefill.engine.histogram import Histogram

if TYPE_CHECKING:
    from aioprefill.engine.stats import EngineStats

__all__ = ["EngineCollector", "registry_for", "render"]

# (field of EngineStats, metric name, help)
_COUNTERS = (
    ("submitted", "requests_submitted", "Requests accepted by prefill()."),
    ("completed", "requests_completed", "Requests answered with a result."),
    ("failed", "requests_failed", "Accepted requests that failed (worker crash, forward error)."),
    ("cancelled", "requests_cancelled", "Accepted requests whose caller went away."),
    ("rejected", "requests_rejected", "Requests refused with EngineOverloaded."),
    ("batches", "batches", "Batches handed to workers."),
    ("tokens", "batch_tokens", "Prompt tokens handed to workers."),
    ("retried", "requests_retried", "Requests retried after their worker died."),
    ("worker_restarts", "worker_restarts", "Worker processes restarted after a death."),
    ("protocol_errors", "protocol_errors", "Malformed or unexpected messages from workers."),
)
_GAUGES = (
    ("pending", "requests_pending", "Requests accepted but not yet fully dispatched."),
    ("in_flight", "requests_in_flight", "Requests accepted and not yet answered."),
)
# Prefix cache (`EngineStats.prefix_cache`): (field, metric name, help, is a counter)
_PREFIX_CACHE = (
    ("queried_tokens", "prefix_cache_queries", "Prompt tokens looked up in a prefix cache.", 1),
    ("hit_tokens", "prefix_cache_hits", "Prompt tokens read from a prefix cache.", 1),
    ("store_hit_tokens", "prefix_cache_store_hits", "Prompt tokens loaded from the KV store.", 1),
    ("evictions", "prefix_cache_evictions", "Cached blocks evicted to make room.", 1),
    ("blocks", "prefix_cache_blocks", "Blocks the workers' prefix caches hold.", 0),
    ("bytes", "prefix_cache_bytes", "Bytes the workers' prefix caches hold (every rank).", 0),
    ("capacity_blocks", "prefix_cache_capacity_blocks", "Prefix cache slots, all workers.", 0),
)
# (field, metric name, help, scale from the recorded unit to the exported one)
_HISTOGRAMS = (
    ("ttft_us", "ttft_seconds", "Time to first token: prefill() call to result.", 1e-6),
    ("queue_us", "queue_seconds", "prefill() call to the start of its last forward.", 1e-6),
    ("forward_us", "forward_seconds", "One forward, as its worker timed it.", 1e-6),
    ("bubble_us", "bubble_seconds", "A backlogged worker's idle gap between forwards.", 1e-6),
    ("batch_size", "batch_size_requests", "Requests (chunks) per batch.", 1.0),
    ("batch_tokens", "batch_size_tokens", "Tokens per batch.", 1.0),
)


class EngineCollector(Collector):
    """A prometheus_client collector that reads `stats()` (and, when given, `health()`)."""

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        *,
        health: Callable[[], Any] | None = None,
        prefix: str = "aioprefill",
    ) -> None:
        self._stats = stats
        self._health = health
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        p = self._prefix
        s = self._stats()
        for field, name, doc in _COUNTERS:
            yield CounterMetricFamily(f"{p}_{name}", doc, value=getattr(s, field))
        for field, name, doc in _GAUGES:
            yield GaugeMetricFamily(f"{p}_{name}", doc, value=getattr(s, field))
        for field, name, doc, counter in _PREFIX_CACHE:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            yield family(f"{p}_{name}", doc, value=getattr(s.prefix_cache, field))
        for field, name, doc, scale in _HISTOGRAMS:
            hist = getattr(s, field).histogram
            if hist is not None:
                yield _histogram(f"{p}_{name}", doc, hist, scale)
        if self._health is not None:
            yield from _health_metrics(p, self._health())


def _histogram(name: str, doc: str, hist: Histogram, scale: float) -> HistogramMetricFamily:
    buckets: list[tuple[str, float]] = [
        (repr(float(f"{bound * scale:.12g}")), float(count))  # "1e-05", not "9.99...e-06"
        for bound, count in zip(hist.bounds, hist.counts, strict=False)
    ]
    buckets.append(("+Inf", float(hist.count)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=hist.sum * scale)


def _health_metrics(p: str, health: Any) -> Iterator[Metric]:
    up = GaugeMetricFamily(f"{p}_engine_running", "1 while the engine can serve requests.")
    up.add_metric([], 1.0 if health.is_running else 0.0)
    yield up
    states = GaugeMetricFamily(
        f"{p}_worker_state", "1 for each worker's current state.", labels=["worker", "state"]
    )
    for w in health.workers:
        states.add_metric([str(w.index), w.state], 1.0)
    yield states


def registry_for(engine: Any, *, prefix: str = "aioprefill") -> CollectorRegistry:
    """A fresh registry holding one `EngineCollector` for `engine` (its stats and health)."""
    registry = CollectorRegistry(auto_describe=False)
    health = getattr(engine, "health", None)
    registry.register(EngineCollector(engine.stats, health=health, prefix=prefix))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition body and its Content-Type, for a GET /metrics handler."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
