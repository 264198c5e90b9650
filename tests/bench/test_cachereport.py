"""The prefix cache's report rows and targets, on hand-made points."""

from typing import Any

import pytest

from aioprefill.bench.cachereport import format_prefix, prefix_targets


def point(label, cache, *, hit=0.0, ceil=None, ttft=(10.0, 20.0), rps=5.0, bubble=100.0):
    prompt = 1000
    return {
        "kind": "rate",
        "label": label,
        "policy": "forward",
        "cache": cache,
        "ttft_ms": {"mean": ttft[0], "p99": ttft[1]},
        "throughput": {"requests_per_s": rps},
        "bubble_us": {"mean": bubble},
        "prefix": {
            "cache": cache,
            "capacity_blocks": None if ceil is None else ceil["capacity_blocks"],
            "prompt_tokens": prompt,
            "cached_tokens": int(hit * prompt),
            "computed_tokens": prompt - int(hit * prompt),
            "hit_ratio": hit,
            "ceilings": ceil,
        },
    }


def ceil(capacity, *, workers=1, rr=None):
    return {
        "block_tokens": 16,
        "capacity_blocks": capacity,
        "distinct_blocks": 100,
        "no_eviction": 0.65,
        "lru": 0.3,
        "round_robin": rr,
        "workers": workers,
    }


def by_name(points: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in prefix_targets({"points": points})}


def test_a_budget_that_holds_everything_is_judged_against_no_eviction():
    t = by_name(
        [
            point("trace", "all", hit=0.64, ceil=ceil(100), ttft=(5.0, 9.0)),
            point("trace", "off", ttft=(10.0, 20.0)),
        ]
    )
    hit = t["trace forward/all: hit ratio >= 0.98 x the no-eviction ceiling"]
    assert hit["met"] and hit["value"] == pytest.approx(0.64 / 0.65)
    assert t["trace forward/all vs off: TTFT mean lower"]["value"] == 0.5
    assert t["trace forward/all vs off: TTFT p99 lower"]["met"]


def test_a_small_budget_against_lru_and_several_workers_against_round_robin():
    t = by_name([point("trace", "10%", hit=0.27, ceil=ceil(10), ttft=(30.0, 40.0))])
    assert t["trace forward/10%: hit ratio >= 0.95 x the offline LRU ceiling"]["met"] is False
    t = by_name([point("trace", "10%", hit=0.28, ceil=ceil(10, workers=4, rr=0.07))])
    dp = t["trace forward/10%: hit ratio >= 0.9 x one offline LRU cache of the same total"]
    assert dp["met"] and dp["value"] == pytest.approx(0.28 / 0.3)
    rr = t["trace forward/10%: hit ratio above round-robin dispatch's (offline)"]
    assert rr["met"] and rr["value"] == pytest.approx(4.0)
    # the size in blocks unknown: no target
    assert by_name([point("trace", "default", hit=0.2, ceil=ceil(None))]) == {}


def test_no_reuse_compares_abba_repeats_within_three_percent():
    pts = [
        point("0.8x", "default", rps=10.0, bubble=100.0),
        point("0.8x", "off", rps=10.0, bubble=100.0),
        point("0.8x", "off", rps=10.0, bubble=98.0),
        point("0.8x", "default", rps=9.0, bubble=103.0),
    ]
    t = by_name(pts)
    rps = t["0.8x forward/default vs off: req/s within 3% (no reuse, 2+2 runs)"]
    assert rps["value"] == pytest.approx(9.5 / 10.0) and rps["met"] is False
    bub = t["0.8x forward/default vs off: bubble mean within 3% (no reuse, 2+2 runs)"]
    assert bub["value"] == pytest.approx(101.5 / 99) and bub["met"]
    assert len(t) == 2  # each pair once


def test_table_rows():
    doc = {
        "points": [
            point("trace", "all", hit=0.64, ceil=ceil(100)),
            point("trace", "off"),
        ]
    }
    lines = format_prefix(doc)
    assert lines[0].startswith("Prefix cache:") and "100 distinct blocks of 16" in lines[0]
    head, on, off = lines[1:4]
    assert head.split()[:4] == ["point", "arm", "blocks/worker", "hit"]
    assert on.split()[:6] == ["trace", "forward/all", "100", "0.640", "0.650", "0.300"]
    assert "360 (0.36x)" in on and off.split()[1:4] == ["forward/off", "-", "0.000"]
    assert format_prefix({"points": [point("0.8x", "default")]}) == []
