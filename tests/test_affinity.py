"""Loop affinity: an engine's coroutines refuse other loops and threads before queueing
anything; sync threads go through submit_threadsafe()."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from aioprefill import (
    AioprefillError,
    Engine,
    EngineClosed,
    EngineConfig,
    InvalidRequest,
    SimModel,
    WrongLoop,
)
from aioprefill.engine.affinity import LoopAffinity
from aioprefill.workers.sim import expected_token


def sim(fixed_ms: float = 1.0) -> SimModel:
    return SimModel(fixed_ms=fixed_ms, per_token_us=0.0)


def test_another_loop_or_thread_is_refused_before_anything_is_queued():
    loop = asyncio.new_event_loop()
    engine = Engine(EngineConfig(model=sim()))
    loop.run_until_complete(engine.start())
    try:
        # A second asyncio.run() in the same thread: another loop.
        with pytest.raises(WrongLoop, match="another event loop") as info:
            asyncio.run(engine.prefill([1, 2]))
        assert isinstance(info.value, AioprefillError) and isinstance(info.value, RuntimeError)
        # A thread running its own loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            job = pool.submit(asyncio.run, engine.prefill([1, 2]))
            with pytest.raises(WrongLoop, match="another thread"):
                job.result(timeout=30)
            job = pool.submit(asyncio.run, engine.drain())
            with pytest.raises(WrongLoop):
                job.result(timeout=30)
        stats = engine.stats()
        assert stats.submitted == 0 and stats.in_flight == 0 and stats.pending == 0
        # Nothing was disturbed: the engine still serves its own loop.
        assert loop.run_until_complete(engine.prefill([1, 2])).token == expected_token([1, 2])
        with pytest.raises(WrongLoop):
            asyncio.run(engine.close())
        assert engine.is_running
    finally:
        loop.run_until_complete(engine.close())
        loop.close()


def test_a_closed_loop_is_named():
    aff = LoopAffinity()
    loop = asyncio.new_event_loop()
    loop.run_until_complete(_bind(aff))
    loop.close()
    with pytest.raises(WrongLoop, match="that loop is closed"):
        asyncio.run(_check(aff))


async def _bind(aff: LoopAffinity) -> None:
    aff.bind()


async def _check(aff: LoopAffinity) -> None:
    aff.check("prefill()")


@pytest.mark.asyncio
async def test_submit_threadsafe_from_sync_threads():
    async with Engine(EngineConfig(model=sim(5.0), max_batch_size=64)) as engine:

        def sync_caller(i: int) -> int:
            return engine.submit_threadsafe([i + 1, 7], wait=True).result(timeout=30).token

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            tokens = await asyncio.gather(
                *(asyncio.wrap_future(pool.submit(sync_caller, i)) for i in range(64))
            )
        assert tokens == [expected_token([i + 1, 7]) for i in range(64)]
        assert engine.stats().batch_size.max > 1  # threads' requests were batched together

        # Bad input fails the future with the same typed error.
        bad = await asyncio.to_thread(engine.submit_threadsafe, [1, True])
        with pytest.raises(InvalidRequest, match="bool True at index 1"):
            await asyncio.wrap_future(bad)

        # On the engine's own loop thread it would deadlock a blocking caller: refused.
        with pytest.raises(WrongLoop, match="own loop thread"):
            engine.submit_threadsafe([1])
    late = await asyncio.to_thread(engine.submit_threadsafe, [1])
    with pytest.raises(EngineClosed):
        await asyncio.wrap_future(late)


def test_submit_threadsafe_to_an_engine_on_a_background_loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = Engine(EngineConfig(model=sim(100.0)))
    asyncio.run_coroutine_threadsafe(engine.start(), loop).result(timeout=60)

    def on_loop(fn):  # read engine state on its own loop, as the rules require
        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=30)

    try:
        futures = [engine.submit_threadsafe([i + 1]) for i in range(20)]
        assert [f.result(timeout=30).token for f in futures] == [
            expected_token([i + 1]) for i in range(20)
        ]
        # Cancelling the future cancels the request inside the engine.
        blocker = engine.submit_threadsafe([3])
        victim = engine.submit_threadsafe([4])
        while on_loop(lambda: engine.stats().submitted) < 22:
            pass
        victim.cancel()
        assert blocker.result(timeout=30).token == expected_token([3])
        stats = on_loop(engine.stats)
        assert stats.cancelled == 1 and stats.completed == 21 and stats.in_flight == 0
    finally:
        asyncio.run_coroutine_threadsafe(engine.close(), loop).result(timeout=60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
