"""A worker that dies takes its prefix cache with it: its index is dropped at once, nothing is
read from it again (the retried request is computed afresh and answers the same), and the
restarted worker's cache fills again from nothing."""

from __future__ import annotations

import asyncio

import pytest

from aioprefill import Engine, EngineConfig, SimModel
from aioprefill.workers.sim import expected_token
from tests.reliability.util import all_ready, busy_worker, kill_worker, until

pytestmark = pytest.mark.asyncio


def sim(fixed_ms: float) -> SimModel:
    return SimModel(fixed_ms=fixed_ms, per_token_us=0.0, kv_bytes_per_token=16)


PREFIX = [(11 * i) % 29000 for i in range(160)]


async def test_a_killed_worker_mid_run_drops_its_index_and_nothing_is_read_from_it():
    cfg = EngineConfig(model=sim(200.0), prefix_cache_bytes=1 << 20)
    async with Engine(cfg) as engine:
        assert (await engine.prefill([*PREFIX, 1])).cached_tokens == 0
        assert engine.stats().prefix_cache.blocks == 10
        task = asyncio.create_task(engine.prefill([*PREFIX, 2]))  # planned to read 160
        await until(lambda: busy_worker(engine) is not None, what="the forward")
        kill_worker(engine, 0)
        await until(lambda: engine.stats().prefix_cache.blocks == 0, what="the index dropped")
        r = await task  # retried on the restarted worker: computed, not read
        assert r.token == expected_token([*PREFIX, 2]) and r.cached_tokens == 0
        await until(lambda: all_ready(engine), what="the restart")
        again = await engine.prefill([*PREFIX, 3])
        assert again.cached_tokens == 160  # what the retry wrote on the new worker
        stats = engine.stats()
        assert stats.retried == 1 and stats.worker_restarts == 1
        assert stats.prefix_cache.hit_tokens == 160 + 160  # the lost attempt's lookup counted


async def test_with_two_workers_the_survivor_computes_what_the_dead_one_held():
    cfg = EngineConfig(model=sim(5.0), num_workers=2, prefix_cache_bytes=1 << 20)
    async with Engine(cfg) as engine:
        holder = (await engine.prefill([*PREFIX, 1])).worker
        kill_worker(engine, holder)
        await until(lambda: engine.stats().prefix_cache.blocks == 0, what="the index dropped")
        r = await engine.prefill([*PREFIX, 2])
        assert r.cached_tokens == 0 and r.token == expected_token([*PREFIX, 2])
        await until(lambda: all_ready(engine), what="the restart")
        again = await engine.prefill([*PREFIX, 4])
        assert (again.worker, again.cached_tokens) == (r.worker, 160)
