"""Counters and sample windows behind `engine.stats()`.

Distributions (batch size, batch tokens, queue time, TTFT, forward time, bubble) keep the most
recent `WINDOW` samples in a preallocated NumPy ring, so memory stays flat however long the
engine runs and percentiles are exact over that window; and, for all time, a cumulative
histogram with fixed buckets (`aioprefill.engine.histogram`), which adds up across processes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from aioprefill.engine.histogram import (
    BATCH_SIZE_BOUNDS,
    BATCH_TOKENS_BOUNDS,
    TIME_US_BOUNDS,
    Histogram,
    HistogramRecorder,
)
from aioprefill.sched.prefix.cache import PrefixCacheStats

__all__ = ["Distribution", "EngineStats", "SampleWindow", "StatsRecorder"]

WINDOW = 16384


class SampleWindow:
    """The last `size` samples of one quantity, with exact percentiles over them, plus an
    all-time histogram over fixed `bounds`."""

    __slots__ = ("_count", "_data", "_histogram", "_total")

    def __init__(self, bounds: tuple[float, ...], size: int = WINDOW) -> None:
        self._data = np.zeros(size, dtype=np.float64)
        self._count = 0
        self._total = 0.0
        self._histogram = HistogramRecorder(bounds)

    def add(self, value: float) -> None:
        self._data[self._count % len(self._data)] = value
        self._count += 1
        self._total += value
        self._histogram.add(value)

    def summary(self) -> Distribution:
        n = min(self._count, len(self._data))
        histogram = self._histogram.snapshot()
        if n == 0:
            return Distribution(count=self._count, histogram=histogram)
        window = self._data[:n]
        p50, p90, p99 = np.percentile(window, [50, 90, 99])
        return Distribution(
            count=self._count,
            mean=self._total / self._count,
            p50=float(p50),
            p90=float(p90),
            p99=float(p99),
            max=float(window.max()),
            histogram=histogram,
        )


class Distribution(msgspec.Struct, frozen=True, kw_only=True):
    """Summary of a quantity: `count` and `histogram` over all time, percentiles over the
    recent window (exact, but only mergeable through the histogram)."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    histogram: Histogram | None = None


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of `engine.stats()`. Times are in microseconds.

    `ttft_us`: submitted to result (what the caller waited); `queue_us`: submitted to the start
    of the forward that finished it; `forward_us`: one forward as the worker timed it;
    `bubble_us`: a backlogged worker's idle gap between two forwards. `prefix_cache`: tokens
    looked up and hit, blocks and bytes held, evictions (`PrefixCacheStats`).
    """

    submitted: int
    completed: int
    failed: int
    cancelled: int
    rejected: int
    batches: int
    empty_batches: int  # sent only to keep expert-parallel ranks in step (0 when idle)
    tokens: int
    pending: int
    in_flight: int
    retried: int
    worker_restarts: int
    protocol_errors: int
    batch_size: Distribution
    batch_tokens: Distribution
    queue_us: Distribution
    ttft_us: Distribution
    forward_us: Distribution
    bubble_us: Distribution
    prefix_cache: PrefixCacheStats = PrefixCacheStats()


class StatsRecorder:
    """Mutable counters owned by the engine's event loop (no locks: one thread touches them)."""

    def __init__(self) -> None:
        self.submitted = 0
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        self.rejected = 0
        self.batches = 0
        self.empty_batches = 0
        self.tokens = 0
        self.retried = 0
        self.worker_restarts = 0
        self.protocol_errors = 0
        self.batch_size = SampleWindow(BATCH_SIZE_BOUNDS)
        self.batch_tokens = SampleWindow(BATCH_TOKENS_BOUNDS)
        self.queue_us = SampleWindow(TIME_US_BOUNDS)
        self.ttft_us = SampleWindow(TIME_US_BOUNDS)
        self.forward_us = SampleWindow(TIME_US_BOUNDS)
        self.bubble_us = SampleWindow(TIME_US_BOUNDS)

    def record_result(self, submitted_ns: int, forward_start_ns: int, finished_ns: int) -> None:
        """A request's result reached its caller (`completed` is counted by the caller)."""
        self.queue_us.add((forward_start_ns - submitted_ns) / 1e3)
        self.ttft_us.add((finished_ns - submitted_ns) / 1e3)

    def record_forward(self, start_ns: int, end_ns: int) -> None:
        """A worker answered a batch (results or failure): how long its forward took."""
        self.forward_us.add((end_ns - start_ns) / 1e3)

    def snapshot(self, sched: Any) -> EngineStats:
        """The counters, with the `Scheduler`'s (pending, in flight, its prefix cache)."""
        cache = sched.cache
        return EngineStats(
            submitted=self.submitted,
            completed=self.completed,
            failed=self.failed,
            cancelled=self.cancelled,
            rejected=self.rejected,
            batches=self.batches,
            empty_batches=self.empty_batches,
            tokens=self.tokens,
            pending=sched.num_pending,
            in_flight=sched.num_in_flight,
            retried=self.retried,
            worker_restarts=self.worker_restarts,
            protocol_errors=self.protocol_errors,
            batch_size=self.batch_size.summary(),
            batch_tokens=self.batch_tokens.summary(),
            queue_us=self.queue_us.summary(),
            ttft_us=self.ttft_us.summary(),
            forward_us=self.forward_us.summary(),
            bubble_us=self.bubble_us.summary(),
            prefix_cache=PrefixCacheStats() if cache is None else cache.stats(),
        )
