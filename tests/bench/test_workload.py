"""Arrival schedules, prompt-length distributions and prompts: seeded and as specified."""

import numpy as np
import pytest

from aioprefill.bench.workload import LengthSpec, Schedule, make_prompts, make_schedule, parse_rates


def rng(seed=0):
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def test_parse_rates():
    rates = parse_rates("2, 4.5/s,0.8x")
    assert [(r.value, r.relative) for r in rates] == [(2, False), (4.5, False), (0.8, True)]
    assert [r.label for r in rates] == ["2/s", "4.5/s", "0.8x"]
    assert rates[2].resolve(50.0) == pytest.approx(40.0)
    assert rates[0].resolve(None) == 2
    with pytest.raises(ValueError, match="capacity"):
        rates[2].resolve(None)
    for bad in ("", "x", "-1", "nan", "1,,2", "0x"):
        with pytest.raises(ValueError):
            parse_rates(bad)


@pytest.mark.parametrize(
    ("text", "lo", "hi"),
    [("17", 17, 17), ("fixed:8", 8, 8), ("uniform:3:9", 3, 9), ("lognormal:64:0.5", 1, 4096)],
)
def test_lengths_within_bounds(text, lo, hi):
    x = LengthSpec.parse(text).sample(rng(), 5000, max_len=4096)
    assert x.dtype == np.int64 and len(x) == 5000
    assert x.min() >= lo and x.max() <= hi


def test_lognormal_median_and_clipping():
    spec = LengthSpec.parse("lognormal:64:0.5")
    x = spec.sample(rng(1), 20000, max_len=10_000)
    assert np.median(x) == pytest.approx(64, rel=0.05)
    assert x.mean() == pytest.approx(spec.mean(10_000), rel=0.05)
    assert LengthSpec.parse("lognormal:64:2").sample(rng(), 1000, max_len=100).max() == 100
    assert LengthSpec.parse("uniform:10:30").sample(rng(), 1000, max_len=20).max() == 20


def test_schedule_has_the_nominal_rate_and_is_reproducible():
    a = make_schedule(rng(3), 40.0, 5.0, LengthSpec.parse("32"), max_len=100)
    b = make_schedule(rng(3), 40.0, 5.0, LengthSpec.parse("32"), max_len=100)
    assert len(a) == 200
    assert np.array_equal(a.arrivals_s, b.arrivals_s)
    assert np.all(np.diff(a.arrivals_s) >= 0)
    assert a.arrivals_s[0] >= 0 and a.arrivals_s[-1] < 5.0
    assert np.all(a.lengths == 32)


def test_burstiness_shapes_the_gaps():
    def cv(burstiness):
        s = make_schedule(
            rng(4), 100.0, 200.0, LengthSpec.parse("1"), burstiness=burstiness, max_len=1
        )
        gaps = np.diff(s.arrivals_s)
        return gaps.std() / gaps.mean()

    # gamma(k) gaps have a coefficient of variation of 1/sqrt(k); Poisson (k=1) has 1
    assert cv(1.0) == pytest.approx(1.0, abs=0.05)
    assert cv(0.25) == pytest.approx(2.0, abs=0.15)
    assert cv(4.0) == pytest.approx(0.5, abs=0.05)


def test_schedule_rescaling_and_truncation():
    s = Schedule(np.array([0.0, 1.0, 2.0, 4.0]), np.array([1, 2, 3, 4]))
    assert s.mean_rate == pytest.approx(0.75)
    fast = s.scaled_to_rate(3.0)
    assert fast.mean_rate == pytest.approx(3.0) and fast.arrivals_s[-1] == pytest.approx(1.0)
    assert len(s.truncated(2.0)) == 2
    assert s.clipped(2).lengths.tolist() == [1, 2, 2, 2]


def test_prompts_match_lengths_and_vocab():
    lengths = np.array([1, 5, 300])
    prompts = make_prompts(rng(), lengths, vocab_size=100)
    assert [len(p) for p in prompts] == [1, 5, 300]
    assert all(p.dtype == np.int32 and p.min() >= 1 and p.max() < 100 for p in prompts)
    again = make_prompts(rng(), lengths, vocab_size=100)
    assert all(np.array_equal(p, q) for p, q in zip(prompts, again, strict=True))
