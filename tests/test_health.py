"""engine.health(): each worker's state through start, forwards, deaths and close;
`is_running` False once the engine cannot serve."""

from __future__ import annotations

import asyncio

import pytest

from aioprefill import Engine, EngineConfig, SimModel, WorkerStartFailed
from tests.reliability.util import kill_worker, until

pytestmark = pytest.mark.asyncio


def states(engine: Engine) -> list[str]:
    return [w.state for w in engine.health().workers]


async def test_states_through_a_forward_a_death_and_close():
    cfg = EngineConfig(model=SimModel(fixed_ms=200.0, per_token_us=0.0), num_workers=2)
    engine = Engine(cfg)
    h = engine.health()
    assert not h.is_running and h.state == "new" and states(engine) == ["stopped", "stopped"]
    async with engine:
        h = engine.health()
        assert h.is_running and h.state == "running" and states(engine) == ["ready", "ready"]
        assert [w.pid for w in h.workers] == engine.worker_pids()
        job = asyncio.ensure_future(engine.prefill([1]))
        await until(lambda: "busy" in states(engine), what="a busy worker")
        assert sorted(states(engine)) == ["busy", "ready"]
        assert engine.health().ready_workers == 2
        await job
        assert states(engine) == ["ready", "ready"]
        kill_worker(engine, 1)
        await until(lambda: states(engine)[1] == "restarting", what="worker 1 restarting")
        assert engine.is_running and engine.health().workers[1].deaths == 1
        await until(lambda: states(engine)[1] == "ready", timeout=30, what="worker 1 back")
    h = engine.health()
    assert not h.is_running and h.state == "closed" and states(engine) == ["stopped", "stopped"]


async def test_every_worker_given_up_means_not_running():
    cfg = EngineConfig(model=SimModel(fixed_ms=1.0, per_token_us=0.0), max_restarts=0)
    async with Engine(cfg) as engine:
        kill_worker(engine, 0)
        await until(lambda: states(engine) == ["given_up"], what="worker 0 given up")
        h = engine.health()
        assert not h.is_running and not engine.is_running and h.state == "broken"
        assert h.workers[0].pid == -1 and engine.worker_pids() == []
        with pytest.raises(WorkerStartFailed):
            await engine.prefill([1])
