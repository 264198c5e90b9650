"""Fixed-bucket cumulative histograms: placement, merging across processes, quantiles."""

from __future__ import annotations

import random

import numpy as np
import pytest

from aioprefill.engine.histogram import TIME_US_BOUNDS, Histogram, HistogramRecorder


def test_samples_land_in_prometheus_le_buckets():
    rec = HistogramRecorder((1.0, 10.0, 100.0))
    for v in (0.5, 1.0, 1.5, 10.0, 99.0, 1000.0):
        rec.add(v)
    h = rec.snapshot()
    assert h.counts == (2, 4, 5, 6)  # <=1, <=10, <=100, +Inf (cumulative)
    assert h.count == 6 and h.sum == pytest.approx(1112.0)


def test_histograms_of_two_processes_merge_into_the_histogram_of_all_samples():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = np.random.default_rng(seed)
    a, b, both = (HistogramRecorder(TIME_US_BOUNDS) for _ in range(3))
    for rec, n in ((a, 5000), (b, 3000)):
        for v in rng.lognormal(8, 1.5, n):
            rec.add(float(v))
            both.add(float(v))
    merged = a.snapshot().merge(b.snapshot())
    assert merged.counts == both.snapshot().counts
    assert merged.sum == pytest.approx(both.snapshot().sum)
    with pytest.raises(ValueError, match="different bucket bounds"):
        merged.merge(HistogramRecorder((1.0,)).snapshot())


def test_quantile_interpolates_within_its_bucket():
    rec = HistogramRecorder((10.0, 20.0, 40.0))
    for v in [5.0] * 50 + [15.0] * 40 + [30.0] * 10:
        rec.add(v)
    h = rec.snapshot()
    assert h.quantile(0.5) == pytest.approx(10.0)
    assert h.quantile(0.7) == pytest.approx(15.0)  # halfway through the (10, 20] bucket
    assert h.quantile(0.95) == pytest.approx(30.0)
    assert Histogram(bounds=(1.0,), counts=(0, 0)).quantile(0.99) == 0.0
