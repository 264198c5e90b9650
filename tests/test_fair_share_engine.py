"""A burst over several worker groups, end to end with SimModel workers (real processes, rings):
policy `forward` spreads it over the groups (`policies/share.py`) instead of giving it whole to
the first one free; cancelled and crashed requests lose nothing; requests the prefix cache
homes on a group still go there. The scheduler's invariants are checked after every event."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from aioprefill import Engine, EngineConfig, SimModel, WorkerCrashed
from aioprefill.sched.scheduler import Scheduler
from aioprefill.workers.sim import expected_token
from tests.reliability.util import all_ready, until

pytestmark = pytest.mark.asyncio

CRASH = 31000  # SimModel.crash_token: the forward calls os._exit(70)


@pytest.fixture(autouse=True)
def _check_invariants(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(Scheduler, "checking", True)


def prompts(n: int, length: int, first: int = 1) -> list[list[int]]:
    return [[(first + 101 * i + j) % 30000 for j in range(length)] for i in range(n)]


async def test_a_burst_is_spread_over_both_workers_and_cancels_and_crashes_lose_nothing():
    # Mostly per-token cost, as on a CPU: 48 tokens take ~10 ms.
    model = SimModel(fixed_ms=1.0, per_token_us=200.0, crash_token=CRASH)
    config = EngineConfig(model=model, num_workers=2, max_retries=1, max_batch_tokens=1 << 16)
    async with Engine(config) as engine:
        burst = prompts(32, 48)
        results = await asyncio.gather(*(engine.prefill(p) for p in burst))
        assert [r.token for r in results] == [expected_token(p) for p in burst]
        per_worker = Counter(r.worker for r in results)
        # The first two go one to each worker at once; of the other 30 the worker free first
        # takes its share (about half), not all of them (greedy: 31 and 1).
        assert min(per_worker.values()) >= 8, per_worker
        assert max(r.batch_size for r in results) <= 20, [r.batch_size for r in results]

        # Cancel every other caller while the burst waits: the rest are answered, none hangs.
        tasks = [asyncio.ensure_future(engine.prefill(p)) for p in prompts(32, 48, 7)]
        await asyncio.sleep(0)
        for t in tasks[1::2]:
            t.cancel()
        done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        assert all(isinstance(d, asyncio.CancelledError) for d in done[1::2])
        assert [d.token for d in done[::2]] == [expected_token(p) for p in prompts(32, 48, 7)[::2]]

        # A crash inside a shared burst: every caller gets its answer or WorkerCrashed (its
        # batch-mates ride the retries with it), none waits; then a burst is spread again.
        crashing = prompts(24, 48, 11)
        crashing[5] = [*crashing[5][:47], CRASH]
        got = await asyncio.wait_for(
            asyncio.gather(*(engine.prefill(p) for p in crashing), return_exceptions=True), 30
        )
        assert isinstance(got[5], WorkerCrashed)
        for p, r in zip(crashing, got, strict=True):
            assert isinstance(r, WorkerCrashed) or r.token == expected_token(p)
        assert sum(not isinstance(r, WorkerCrashed) for r in got) >= 12  # (one batch's worth)
        stats = engine.stats()
        assert stats.pending == 0 and stats.in_flight == 0
        await until(lambda: all_ready(engine), what="the restarts")
        again = await asyncio.wait_for(asyncio.gather(*(engine.prefill(p) for p in burst)), 30)
        assert [r.token for r in again] == [r.token for r in results]
        assert len({r.worker for r in again}) == 2


async def test_a_burst_on_a_shared_prefix_goes_to_its_home_and_the_rest_is_spread():
    model = SimModel(fixed_ms=1.0, per_token_us=200.0, kv_bytes_per_token=16)
    config = EngineConfig(model=model, num_workers=2, prefix_cache_bytes=1 << 20)
    async with Engine(config) as engine:
        base = prompts(1, 100, 3)[0]
        home = (await engine.prefill(base)).worker
        homed = [[*base, 20000 + i] for i in range(8)]
        plain = prompts(8, 12, 5)  # no full block: no home
        got = await asyncio.gather(*(engine.prefill(p) for p in [*homed, *plain]))
        assert [(r.worker, r.cached_tokens) for r in got[:8]] == [(home, 96)] * 8
        assert [r.token for r in got] == [expected_token(p) for p in [*homed, *plain]]
        assert 1 - home in {r.worker for r in got[8:]}  # the other worker is not left idle
