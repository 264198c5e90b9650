"""Long runs with random cancellations: no request lost, the books balance, memory stays flat.
Plus the cancellation race the soak found: a caller cancelled right as its answer lands."""

from __future__ import annotations

import asyncio
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, SimModel
from aioprefill.workers.sim import expected_token
from tests.reliability.util import seeded, sim

ROOT = Path(__file__).parents[2]


@pytest.mark.asyncio
@pytest.mark.parametrize("outcome", ["result", "error"])
async def test_cancel_as_the_answer_lands_keeps_the_books(outcome: str):
    """The caller's task is cancelled after its future got its answer but before the task
    woke (a wait_for timeout or a client disconnect in the same loop iteration)."""
    engine = Engine(EngineConfig(model=sim(20.0, fail_token=31002), shutdown_timeout_s=30))
    started = time.monotonic()
    async with engine:
        tasks: list[asyncio.Task] = []
        hook = "resolve" if outcome == "result" else "fail_batch"
        answer = getattr(engine._outcomes, hook)

        def answer_then_cancel(w, batch, msg):  # type: ignore[no-untyped-def]
            answer(w, batch, msg)
            if len(batch.chunks) == len(tasks):  # the gathered batch, not the first one
                for t in tasks:
                    t.cancel()

        setattr(engine._outcomes, hook, answer_then_cancel)
        first = asyncio.create_task(engine.prefill([1]))  # gathers the rest behind it
        await asyncio.sleep(0.005)
        token = 31002 if outcome == "error" else 5
        tasks += [asyncio.create_task(engine.prefill([token, i + 1])) for i in range(8)]
        outcomes = await asyncio.gather(first, *tasks, return_exceptions=True)
        assert all(isinstance(o, asyncio.CancelledError) for o in outcomes[1:])
        stats = engine.stats()
        assert stats.in_flight == 0 and stats.pending == 0
        assert stats.cancelled == 0  # the engine had finished them: not cancellations
        assert stats.completed + stats.failed == 9
        if outcome == "error":
            assert stats.failed == 8
        delattr(engine._outcomes, hook)
        assert (await engine.prefill([2])).token == expected_token([2])
    assert time.monotonic() - started < 5  # close() did not wait for phantom requests


@pytest.mark.asyncio
async def test_soak_8k_in_process_with_random_cancellations():
    """In process, on both event loops in debug mode: 8,000 requests, ~5% cancelled."""
    rng = seeded()
    n, concurrency = 8_000, 500
    model = SimModel(fixed_ms=0.0, per_token_us=0.0)
    outcomes = {"answered": 0, "cancelled": 0}
    async with Engine(EngineConfig(model=model, num_workers=2)) as engine:
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(concurrency)

        def ended(task: asyncio.Task, expected: int) -> None:
            slots.release()
            if task.cancelled():
                outcomes["cancelled"] += 1
            else:
                assert task.result().token == expected
                outcomes["answered"] += 1

        for i in range(n):
            prompt = np.array([i // 30000, i % 30000, *range(1, 1 + i % 17)], np.int32)
            await slots.acquire()
            task = loop.create_task(engine.prefill(prompt))
            task.add_done_callback(functools.partial(ended, expected=expected_token(prompt)))
            if rng.random() < 0.05:
                loop.call_later(rng.random() * 0.002, task.cancel)
        for _ in range(concurrency):
            await asyncio.wait_for(slots.acquire(), 30)
        stats = engine.stats()
        assert outcomes["answered"] + outcomes["cancelled"] == n
        assert outcomes["cancelled"] > 0
        assert stats.failed == 0 and stats.pending == 0 and stats.in_flight == 0
        assert stats.submitted == stats.completed + stats.cancelled
        assert stats.completed >= outcomes["answered"]
        assert not engine._sched.pending and not any(engine._pool.in_flight_batches())


@pytest.mark.slow
def test_soak_200k_requests_flat_memory():
    """benchmarks/soak.py: 200,000 requests on uvloop, zero lost, RSS growth under 32 MB."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--requests", "200000", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=2))
    assert report["lost"] == 0 and report["wrong"] == 0 and report["error"] == 0
    assert report["answered"] + report["cancelled"] == 200_000
    assert report["rss_growth_mb"] <= 32
    assert report["ok"] and proc.returncode == 0, proc.stderr[-2000:]


def test_the_invariant_checks_are_on_here():
    """The soak and fault tests run with `Scheduler.checking` (tests/reliability/conftest.py)."""
    from aioprefill.sched.scheduler import Scheduler

    assert Scheduler.checking
