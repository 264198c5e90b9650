"""Counters and sample windows behind `engine.stats()`.

Distributions (batch size, batch tokens, queue time, bubble) keep the most recent
`WINDOW` samples in a preallocated NumPy ring, so memory stays flat however long the engine runs
and percentiles are exact over that window.
"""

from __future__ import annotations

import msgspec
import numpy as np

__all__ = ["Distribution", "EngineStats", "SampleWindow", "StatsRecorder"]

WINDOW = 16384


class SampleWindow:
    """The last `size` samples of one quantity, with exact percentiles over them."""

    __slots__ = ("_count", "_data", "_total")

    def __init__(self, size: int = WINDOW) -> None:
        self._data = np.zeros(size, dtype=np.float64)
        self._count = 0
        self._total = 0.0

    def add(self, value: float) -> None:
        self._data[self._count % len(self._data)] = value
        self._count += 1
        self._total += value

    def summary(self) -> Distribution:
        n = min(self._count, len(self._data))
        if n == 0:
            return Distribution(count=self._count)
        window = self._data[:n]
        p50, p90, p99 = np.percentile(window, [50, 90, 99])
        return Distribution(
            count=self._count,
            mean=self._total / self._count,
            p50=float(p50),
            p90=float(p90),
            p99=float(p99),
            max=float(window.max()),
        )


class Distribution(msgspec.Struct, frozen=True, kw_only=True):
    """Summary of a quantity: `count` over all time, percentiles over the recent window."""

    count: int = 0
    mean: float = 0.0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of `engine.stats()`. Times are in microseconds."""

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
    bubble_us: Distribution


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
        self.batch_size = SampleWindow()
        self.batch_tokens = SampleWindow()
        self.queue_us = SampleWindow()
        self.bubble_us = SampleWindow()

    def snapshot(self, *, pending: int, in_flight: int) -> EngineStats:
        return EngineStats(
            submitted=self.submitted,
            completed=self.completed,
            failed=self.failed,
            cancelled=self.cancelled,
            rejected=self.rejected,
            batches=self.batches,
            empty_batches=self.empty_batches,
            tokens=self.tokens,
            pending=pending,
            in_flight=in_flight,
            retried=self.retried,
            worker_restarts=self.worker_restarts,
            protocol_errors=self.protocol_errors,
            batch_size=self.batch_size.summary(),
            batch_tokens=self.batch_tokens.summary(),
            queue_us=self.queue_us.summary(),
            bubble_us=self.bubble_us.summary(),
        )
