"""Worker death: SIGKILL mid-forward, a crash inside the model, a worker that keeps dying,
failures while starting or restarting. Each ends with a result or a typed error, never a wait."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import signal
import time

import pytest

from aioprefill import (
    Engine,
    EngineConfig,
    PaddleModel,
    WorkerCrashed,
)
from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.errors import WorkerStartFailed
from aioprefill.workers.sim import expected_token
from tests.conftest import own_segments
from tests.reliability.util import all_ready, busy_worker, kill_worker, pid_alive, sim, until

pytestmark = pytest.mark.asyncio

CRASH = 31000  # SimModel.crash_token: the forward calls os._exit(70)


@pytest.fixture(autouse=True)
def _no_loop_errors(caplog: pytest.LogCaptureFixture):
    """Fail a test whose event loop logged an unhandled callback or task exception."""
    yield
    errors = [r for r in caplog.records if r.name == "asyncio" and r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def death_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "aioprefill" and "died" in r.getMessage()]


async def test_sigkill_mid_forward_is_detected_at_once_and_retried_elsewhere(caplog):
    cfg = EngineConfig(model=sim(300.0), num_workers=2)
    async with Engine(cfg) as engine:
        old_pids = engine.worker_pids()
        task = asyncio.create_task(engine.prefill([7, 8, 9]))
        await until(lambda: busy_worker(engine) is not None, what="a forward to start")
        victim = busy_worker(engine)
        assert victim is not None
        killed_at = time.time()
        kill_worker(engine, victim)
        result = await task
        assert result.token == expected_token([7, 8, 9])
        assert result.worker == 1 - victim  # retried on the healthy worker
        detected = death_records(caplog)
        assert len(detected) == 1
        # The sentinel woke the loop: detection takes milliseconds, not a poll interval.
        assert detected[0].created - killed_at < 0.5
        await until(lambda: all_ready(engine), what="the restart")
        new_pids = engine.worker_pids()
        assert new_pids[1 - victim] == old_pids[1 - victim]
        assert new_pids[victim] != old_pids[victim]
        stats = engine.stats()
        assert stats.retried == 1 and stats.failed == 0 and stats.worker_restarts == 1
        r = await engine.prefill([1])
        assert r.token == expected_token([1])


async def test_max_retries_zero_fails_at_once_and_the_engine_recovers():
    cfg = EngineConfig(model=sim(300.0), num_workers=1, max_retries=0)
    async with Engine(cfg) as engine:
        task = asyncio.create_task(engine.prefill([5]))
        await until(lambda: busy_worker(engine) is not None, what="a forward to start")
        kill_worker(engine, 0)
        with pytest.raises(WorkerCrashed, match=r"worker 0 died \(exit code -9\)"):
            await task
        # A request made while the only worker is down waits for the replacement.
        r = await asyncio.wait_for(engine.prefill([6]), 10)
        assert r.token == expected_token([6])
        stats = engine.stats()
        assert stats.retried == 0 and stats.failed == 1 and stats.worker_restarts == 1


async def test_crash_in_the_model_is_retried_once_then_fails():
    cfg = EngineConfig(model=sim(20.0, crash_token=CRASH), num_workers=2, max_retries=1)
    async with Engine(cfg) as engine:
        with pytest.raises(WorkerCrashed, match=r"exit code 70.*1 retries used"):
            await asyncio.wait_for(engine.prefill([1, CRASH]), 10)
        stats = engine.stats()
        assert stats.retried == 1 and stats.failed == 1
        # Both workers died once; both come back and serve.
        await until(lambda: engine.stats().worker_restarts == 2, what="two restarts")
        results = await asyncio.gather(*(engine.prefill([i + 1]) for i in range(40)))
        assert [r.token for r in results] == [expected_token([i + 1]) for i in range(40)]


async def test_a_worker_that_keeps_dying_trips_a_clear_error():
    cfg = EngineConfig(
        model=sim(50.0, crash_token=CRASH), num_workers=1, max_retries=0, max_restarts=2
    )
    async with Engine(cfg) as engine:
        started = time.monotonic()
        for _ in range(2):  # two deaths: restarted each time
            with pytest.raises(WorkerCrashed):
                await asyncio.wait_for(engine.prefill([CRASH]), 10)
            await until(lambda: all_ready(engine), what="the restart")
        # The third death is one too many. Requests queued behind the fatal forward fail too.
        doomed = asyncio.create_task(engine.prefill([CRASH]))
        await asyncio.sleep(0)  # dispatched to the idle worker, which dies at once
        queued = [asyncio.create_task(engine.prefill([i + 1])) for i in range(5)]
        outcomes = await asyncio.wait_for(
            asyncio.gather(doomed, *queued, return_exceptions=True), 10
        )
        assert isinstance(outcomes[0], WorkerCrashed)
        for o in outcomes[1:]:
            assert isinstance(o, WorkerStartFailed)
            assert "max_restarts=2" in str(o)
        with pytest.raises(WorkerStartFailed):
            await engine.prefill([1])
        assert engine.worker_pids() == []
        assert engine.stats().worker_restarts == 2
        assert time.monotonic() - started < 10


async def test_a_hung_forward_is_killed_retried_and_then_fails():
    hang = 31001
    cfg = EngineConfig(
        model=sim(5.0, hang_token=hang), num_workers=2, forward_timeout_s=0.3, max_retries=1
    )
    async with Engine(cfg) as engine:
        started = time.monotonic()
        doomed = asyncio.create_task(engine.prefill([hang]))
        await until(lambda: busy_worker(engine) is not None, what="the hung forward")
        innocent = await engine.prefill([3])  # the other worker keeps serving
        assert innocent.token == expected_token([3])
        with pytest.raises(WorkerCrashed, match="1 retries used"):
            await asyncio.wait_for(doomed, 10)
        elapsed = time.monotonic() - started
        assert 0.6 <= elapsed < 5  # two forwards, each killed at forward_timeout_s
        assert engine.stats().retried == 1
        await until(lambda: engine.stats().worker_restarts == 2, what="two restarts")
        assert (await engine.prefill([4])).token == expected_token([4])


async def test_a_stopped_worker_times_out_and_its_request_succeeds_elsewhere():
    cfg = EngineConfig(model=sim(100.0), num_workers=2, forward_timeout_s=0.5)
    async with Engine(cfg) as engine:
        task = asyncio.create_task(engine.prefill([11, 12]))
        await until(lambda: busy_worker(engine) is not None, what="a forward to start")
        victim = busy_worker(engine)
        assert victim is not None
        kill_worker(engine, victim, signal.SIGSTOP)  # frozen: alive, silent, never answers
        result = await asyncio.wait_for(task, 10)
        assert result.token == expected_token([11, 12]) and result.worker == 1 - victim
        assert engine.stats().retried == 1


async def test_start_failure_in_the_model_raises_and_leaves_nothing():
    cfg = EngineConfig(model=PaddleModel(weights="/nonexistent/model.safetensors"))
    engine = Engine(cfg)
    with pytest.raises(WorkerStartFailed, match="no such weights file"):
        await engine.start()
    assert not multiprocessing.active_children()
    assert not own_segments()


async def test_start_timeout_raises_and_leaves_nothing():
    engine = Engine(EngineConfig(model=sim(), num_workers=2, worker_start_timeout_s=0.001))
    with pytest.raises(WorkerStartFailed, match="not ready within"):
        await engine.start()
    assert not multiprocessing.active_children()
    assert not own_segments()


async def test_one_worker_failing_to_launch_stops_the_others(monkeypatch):
    launch = WorkerHandle.start

    def flaky_start(self: WorkerHandle) -> None:
        if self.index == 1:  # fork() fails inside Process.start(): a process object, no pid
            self.process = multiprocessing.get_context("spawn").Process(target=print)
            raise OSError(11, "Resource temporarily unavailable (injected)")
        launch(self)

    monkeypatch.setattr(WorkerHandle, "start", flaky_start)
    engine = Engine(EngineConfig(model=sim(), num_workers=2))
    with pytest.raises(OSError, match="injected"):
        await engine.start()
    assert not multiprocessing.active_children()
    assert not own_segments()


async def test_a_restart_that_cannot_launch_backs_off_then_gives_up(monkeypatch):
    cfg = EngineConfig(model=sim(), num_workers=1, max_restarts=2)
    async with Engine(cfg) as engine:

        def broken_start(self: WorkerHandle) -> None:
            raise OSError(24, "Too many open files (injected)")

        monkeypatch.setattr(WorkerHandle, "start", broken_start)
        kill_worker(engine, 0)
        with pytest.raises(WorkerStartFailed, match="max_restarts=2"):
            await asyncio.wait_for(engine.prefill([1]), 10)
        assert engine.worker_pids() == [] and engine.stats().worker_restarts == 0


async def test_a_worker_dying_while_others_start_is_restarted(monkeypatch):
    wait_ready = WorkerHandle.wait_ready
    gate = asyncio.Event()

    async def gated(self: WorkerHandle, timeout: float):  # type: ignore[no-untyped-def]
        ready = await wait_ready(self, timeout)
        if self.index == 1:
            await gate.wait()  # worker 1 is slow to start
        return ready

    monkeypatch.setattr(WorkerHandle, "wait_ready", gated)
    engine = Engine(EngineConfig(model=sim(), num_workers=2))
    starting = asyncio.create_task(engine.start())
    try:
        await until(lambda: engine._pool.slots[0].ready, what="worker 0 ready")
        kill_worker(engine, 0)
        await until(lambda: engine._pool.slots[0].handle is None, what="worker 0's death")
        gate.set()
        await starting
        await until(lambda: all_ready(engine), timeout=10, what="worker 0 back")
        results = await asyncio.gather(*(engine.prefill([i + 1]) for i in range(20)))
        assert [r.token for r in results] == [expected_token([i + 1]) for i in range(20)]
    finally:
        gate.set()
        await engine.close()


async def test_close_during_a_restart_leaves_nothing():
    engine = Engine(EngineConfig(model=sim(), num_workers=1))
    async with engine:
        kill_worker(engine, 0)
        w = engine._pool.slots[0]
        await until(lambda: w.handle is not None and not w.ready, what="the restart to begin")
        pid = w.handle.pid if w.handle is not None else -1
        started = time.monotonic()
    assert time.monotonic() - started < 3
    assert not multiprocessing.active_children()
    assert pid < 0 or not pid_alive(pid)
    assert not own_segments()
