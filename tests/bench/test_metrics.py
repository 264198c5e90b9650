"""Figures from results: TTFT, batches, the bubble, saturation throughput, the cost-model fit."""

from collections import Counter

import numpy as np
import pytest

from aioprefill import PrefillResult
from aioprefill.bench.costmodel import CostModel, best_throughput, fit_cost_model
from aioprefill.bench.metrics import Batches, Records, distribution, steady_throughput, summarize

US = 1000  # ns


def result(rid, *, worker=0, batch, size, tokens, sub, start, end, n=10):
    return PrefillResult(
        request_id=rid, token=1, logprob=-1.0, worker=worker, batch_id=batch, batch_size=size,
        batch_tokens=tokens, num_tokens=n, num_chunks=1, submitted_ns=sub, dispatched_ns=sub,
        forward_start_ns=start, forward_end_ns=end, finished_ns=end + 100 * US,
    )  # fmt: skip


def records(results, errors=None):
    return Records.from_results(
        results,
        [r.submitted_ns for r in results],
        [r.num_tokens for r in results],
        n_submitted=len(results) + sum((errors or {}).values()),
        errors=Counter(errors or {}),
    )


def three_batches():
    # batch 1 runs a and b; c arrives during it and waits (a bubble of 300 us follows);
    # d arrives long after batch 2 ended (that idle gap is not a bubble)
    return [
        result(0, batch=1, size=2, tokens=20, sub=0, start=1000 * US, end=2000 * US),
        result(1, batch=1, size=2, tokens=20, sub=500 * US, start=1000 * US, end=2000 * US),
        result(2, batch=2, size=1, tokens=10, sub=1500 * US, start=2300 * US, end=3000 * US),
        result(3, batch=3, size=1, tokens=10, sub=4900 * US, start=5000 * US, end=6000 * US),
    ]


def test_distribution():
    d = distribution(np.arange(1, 101), 1.0)
    assert d["mean"] == 50.5 and d["max"] == 100 and d["p50"] == pytest.approx(50.5)
    assert distribution(np.array([]))["p99"] is None


def test_summary_of_three_batches():
    s = summarize(records(three_batches(), {"EngineOverloaded": 1}), slo_ttft_ms=1.5)
    assert (s["n_submitted"], s["n_completed"], s["n_failed"]) == (5, 4, 1)
    assert s["errors"] == {"EngineOverloaded": 1}
    # TTFT = finished - submitted: 2.1, 1.6, 1.6, 1.2 ms
    assert s["ttft_ms"]["mean"] == pytest.approx((2.1 + 1.6 + 1.6 + 1.2) / 4)
    assert s["ttft_ms"]["max"] == pytest.approx(2.1)
    assert s["queue_ms"]["max"] == pytest.approx(1.0)
    assert s["return_ms"]["mean"] == pytest.approx(0.1)
    assert s["batches"] == 3
    assert s["batch_size"]["hist"] == {"1": 2, "2": 1}
    assert s["batch_size"]["mean"] == pytest.approx(4 / 3)
    assert s["batch_size"]["mean_per_request"] == pytest.approx(1.5)
    assert s["batch_tokens"]["max"] == 20
    assert s["bubble_us"]["count"] == 1 and s["bubble_us"]["mean"] == pytest.approx(300)
    assert s["bubble_us"]["fraction"] == pytest.approx(300 / 5000)
    assert s["utilization"] == pytest.approx(2700 / 5000)
    assert s["throughput"]["requests_per_s"] == pytest.approx(4 / 6.1e-3)
    assert s["throughput"]["tokens_per_s"] == pytest.approx(40 / 6.1e-3)
    # goodput: TTFT <= 1.5 ms for one of five submitted requests
    assert s["goodput"]["fraction"] == pytest.approx(0.2)
    assert summarize(records(three_batches()))["goodput"] is None


def test_bubbles_are_per_worker():
    rs = three_batches()
    # the same shape on worker 1: batch ids repeat across workers and must not merge
    rs += [
        result(10 + r.request_id, worker=1, batch=r.batch_id, size=r.batch_size,
               tokens=r.batch_tokens, sub=r.submitted_ns, start=r.forward_start_ns,
               end=r.forward_end_ns)
        for r in three_batches()
    ]  # fmt: skip
    s = summarize(records(rs))
    assert s["batches"] == 6
    assert s["bubble_us"]["count"] == 2


def test_empty_records():
    s = summarize(records([], {"WorkerCrashed": 3}), slo_ttft_ms=10)
    assert s["n_completed"] == 0 and s["n_failed"] == 3
    assert s["ttft_ms"]["mean"] is None and s["batches"] == 0
    assert s["throughput"]["requests_per_s"] is None


def test_steady_throughput_skips_start_up_and_drain():
    rs = []
    # a start-up batch of 1, then batches of 8 every 10 ms, then a drain batch of 3
    rs.append(result(0, batch=0, size=1, tokens=10, sub=0, start=0, end=2000 * US))
    rid = 1
    for k in range(1, 6):
        for _ in range(8):
            rs.append(result(rid, batch=k, size=8, tokens=80, sub=0, start=(k * 10 - 8) * 1000 * US,
                             end=k * 10_000 * US))  # fmt: skip
            rid += 1
    for _ in range(3):
        rs.append(
            result(rid, batch=6, size=3, tokens=30, sub=0, start=50_000 * US, end=52_000 * US)
        )
        rid += 1
    b = Batches.from_records(records(rs))
    t = steady_throughput(b, (5_000 * US, 45_000 * US))
    # forwards ending at 10..50 ms; the drain one starts after the window: 4 x 8 over 40 ms
    assert t["requests_per_s"] == pytest.approx(32 / 0.040)
    assert t["tokens_per_s"] == pytest.approx(320 / 0.040)
    assert steady_throughput(b, (60_000 * US, 70_000 * US))["requests_per_s"] is None


def test_cost_model_fit_recovers_coefficients():
    gen = np.random.default_rng(5)
    truth = CostModel(3.0, 134.0, 145.0)
    rs, rid, t = [], 0, 0
    for batch in range(60):
        lens = gen.integers(1, 300, size=int(gen.integers(1, 6)))
        dur = int(truth.seconds(lens.sum(), float((lens**2).sum())) * 1e9)
        for n in lens:
            rs.append(result(rid, batch=batch, size=len(lens), tokens=int(lens.sum()), sub=t,
                             start=t, end=t + dur, n=int(n)))  # fmt: skip
            rid += 1
        t += dur + 1000
    fit = fit_cost_model([Batches.from_records(records(rs))])
    assert fit is not None and fit["n_batches"] == 60
    assert fit["fixed_ms"] == pytest.approx(3.0, abs=1e-3)
    assert fit["per_token_us"] == pytest.approx(134.0, rel=1e-3)
    assert fit["attn_ns"] == pytest.approx(145.0, rel=1e-3)
    assert fit["r2"] == pytest.approx(1.0)
    assert fit_cost_model([Batches.from_records(records(rs[:3]))]) is None


def test_best_throughput():
    best = best_throughput(
        CostModel(15.0, 20.0, 0.0), np.full(64, 512), max_batch_tokens=8192, max_batch_size=256
    )
    assert best["mean_batch_size"] == 16
    assert best["requests_per_s"] == pytest.approx(16 / (0.015 + 16 * 512 * 20e-6))
    assert best["single_requests_per_s"] == pytest.approx(1 / (0.015 + 512 * 20e-6))
    small = best_throughput(
        CostModel(15.0, 20.0, 0.0), np.full(64, 512), max_batch_tokens=8192, max_batch_size=4
    )
    assert small["mean_batch_size"] == 4
