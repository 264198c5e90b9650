"""Cumulative histograms with fixed buckets: counts that add up across processes and restarts.

A percentile over a recent window (`stats.SampleWindow`) is exact but cannot be combined: the
p99 of two servers is not a function of their two p99s. Bucket counts can be: every engine uses
the same bucket bounds for a quantity (the constants below), so the histograms of N server
processes merge by adding their counts, and Prometheus can aggregate them
(`histogram_quantile(0.99, sum by (le) (rate(aioprefill_ttft_seconds_bucket[1m])))`).

Counts are cumulative in the Prometheus sense: `counts[i]` is the number of samples
`<= bounds[i]`, and the last entry (the `+Inf` bucket) is the total.
"""

from __future__ import annotations

from bisect import bisect_left

import msgspec

__all__ = [
    "BATCH_SIZE_BOUNDS",
    "BATCH_TOKENS_BOUNDS",
    "TIME_US_BOUNDS",
    "Histogram",
    "HistogramRecorder",
]

# Microseconds: 10 us to 60 s in 1-2.5-5 steps (wake-ups, bubbles, forwards, TTFT under load).
TIME_US_BOUNDS: tuple[float, ...] = (
    *(float(m * 10**e) for e in range(1, 7) for m in (1, 2.5, 5)),
    1e7,
    3e7,
    6e7,
)
# Requests per batch and tokens per batch: powers of two.
BATCH_SIZE_BOUNDS: tuple[float, ...] = tuple(float(1 << i) for i in range(13))  # 1 .. 4096
BATCH_TOKENS_BOUNDS: tuple[float, ...] = tuple(float(1 << i) for i in range(4, 21))  # 16 .. 1 Mi


class Histogram(msgspec.Struct, frozen=True, kw_only=True):
    """All-time bucket counts of one quantity (cumulative; `counts[-1]` is the `+Inf` bucket)."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float = 0.0

    @property
    def count(self) -> int:
        return self.counts[-1] if self.counts else 0

    def merge(self, other: Histogram) -> Histogram:
        """The histogram of both sample sets (e.g. two server processes' engines)."""
        if other.bounds != self.bounds:
            raise ValueError("cannot merge histograms with different bucket bounds")
        return Histogram(
            bounds=self.bounds,
            counts=tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
            sum=self.sum + other.sum,
        )

    def quantile(self, q: float) -> float:
        """Estimate the q-quantile (0..1) by linear interpolation within its bucket, as
        Prometheus's `histogram_quantile` does; the top bound when it lies in `+Inf`."""
        total = self.count
        if total == 0:
            return 0.0
        rank = q * total
        lower_bound, lower_count = 0.0, 0
        for bound, cum in zip(self.bounds, self.counts, strict=False):
            if cum >= rank:
                in_bucket = cum - lower_count
                frac = (rank - lower_count) / in_bucket if in_bucket else 0.0
                return lower_bound + (bound - lower_bound) * frac
            lower_bound, lower_count = bound, cum
        return self.bounds[-1]


class HistogramRecorder:
    """The mutable side: per-bucket (non-cumulative) counts, made cumulative on snapshot."""

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def add(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += (
            1  # bucket i holds bounds[i-1] < v <= bounds[i]
        )
        self._sum += value

    def snapshot(self) -> Histogram:
        cumulative = []
        running = 0
        for c in self._counts:
            running += c
            cumulative.append(running)
        return Histogram(bounds=self._bounds, counts=tuple(cumulative), sum=self._sum)
