"""The Prometheus exporter over a real engine: what a scrape of /metrics would return."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from aioprefill import Engine, EngineConfig, SimModel, metrics

pytestmark = pytest.mark.asyncio


def scrape(registry) -> dict[str, dict]:
    body, content_type = metrics.render(registry)
    assert content_type.startswith("text/plain")
    samples: dict[str, dict] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            key = s.name + "".join(f"|{k}={v}" for k, v in sorted(s.labels.items()))
            samples[key] = s.value
    return samples


async def test_scrape_reflects_stats_with_cumulative_second_buckets():
    config = EngineConfig(model=SimModel(fixed_ms=2.0, per_token_us=0.0), max_batch_size=8)
    async with Engine(config) as engine:
        registry = metrics.registry_for(engine)
        before = scrape(registry)
        assert before["aioprefill_requests_completed_total"] == 0
        await asyncio.gather(*(engine.prefill([i + 1, 2, 3]) for i in range(40)))
        s = scrape(registry)
        stats = engine.stats()
    assert s["aioprefill_requests_submitted_total"] == 40
    assert s["aioprefill_requests_completed_total"] == 40
    assert s["aioprefill_requests_in_flight"] == 0
    assert s["aioprefill_engine_running"] == 1  # from engine.health()
    assert s["aioprefill_worker_state|state=ready|worker=0"] == 1
    assert s["aioprefill_ttft_seconds_count"] == 40
    assert s["aioprefill_ttft_seconds_sum"] == pytest.approx(
        stats.ttft_us.mean * 40 / 1e6, rel=1e-6
    )
    # Every TTFT is over 2 ms (the forward) and well under 10 s: buckets are cumulative, in s.
    assert s["aioprefill_ttft_seconds_bucket|le=0.001"] == 0
    assert s["aioprefill_ttft_seconds_bucket|le=10.0"] == 40
    assert s["aioprefill_ttft_seconds_bucket|le=+Inf"] == 40
    assert s["aioprefill_forward_seconds_count"] == stats.batches
    assert s["aioprefill_batch_size_requests_count"] == stats.batches
    assert s["aioprefill_batch_size_requests_sum"] == 40
    assert s["aioprefill_batch_size_tokens_sum"] == 120
    bounds = [
        float(k.split("le=")[1])
        for k in s
        if k.startswith("aioprefill_queue_seconds_bucket") and "+Inf" not in k
    ]
    assert bounds == sorted(bounds) and len(bounds) == len(stats.queue_us.histogram.bounds)


async def test_prefix_cache_counters_and_gauges():
    model = SimModel(fixed_ms=1.0, per_token_us=0.0, kv_bytes_per_token=16)
    async with Engine(EngineConfig(model=model, prefix_cache_bytes=4 * 16 * 16)) as engine:
        registry = metrics.registry_for(engine)
        prompt = list(range(1, 50))  # three full blocks
        await engine.prefill(prompt)
        await engine.prefill(prompt)
        await engine.prefill(list(range(100, 150)))  # three more: two evicted
        s = scrape(registry)
    assert s["aioprefill_prefix_cache_queries_total"] == 49 + 49 + 50
    assert s["aioprefill_prefix_cache_hits_total"] == 48
    assert s["aioprefill_prefix_cache_evictions_total"] == 2
    assert s["aioprefill_prefix_cache_blocks"] == 4
    assert s["aioprefill_prefix_cache_bytes"] == 4 * 16 * 16
    assert s["aioprefill_prefix_cache_capacity_blocks"] == 4
