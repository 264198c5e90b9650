"""Per-request controls: deadline_s (never runs past it), request_id (in errors and logs), and
drain() (stop admitting, finish what was accepted)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from aioprefill import (
    DeadlineExceeded,
    Engine,
    EngineClosed,
    EngineConfig,
    EngineOverloaded,
    ForwardFailed,
    InvalidRequest,
    SimModel,
)
from aioprefill.workers.sim import expected_token

pytestmark = pytest.mark.asyncio


def sim(fixed_ms: float, **kw: int) -> SimModel:
    return SimModel(fixed_ms=fixed_ms, per_token_us=0.0, **kw)


async def test_a_request_not_dispatched_by_its_deadline_fails_and_never_runs():
    async with Engine(EngineConfig(model=sim(1000.0))) as engine:
        busy = asyncio.ensure_future(engine.prefill([1]))  # holds the only worker for 1 s
        await asyncio.sleep(0.01)
        with pytest.raises(DeadlineExceeded, match=r"request 'late-1'.*deadline_s=0.05") as info:
            await engine.prefill([2], deadline_s=0.05, request_id="late-1")
        assert isinstance(info.value, TimeoutError)
        assert not busy.done()  # it failed at its deadline, not once the worker was free
        ok = asyncio.ensure_future(engine.prefill([3], deadline_s=5.0))
        assert (await busy).batch_size == 1
        assert (await ok).token == expected_token([3])
        stats = engine.stats()
    # The late request never reached a worker: two forwards, one request each.
    assert stats.batches == 2 and stats.tokens == 2
    assert stats.failed == 1 and stats.completed == 2 and stats.in_flight == 0


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "soon"])
async def test_bad_deadlines_are_refused_before_anything_is_queued(bad):
    async with Engine(EngineConfig(model=sim(1.0))) as engine:
        with pytest.raises(InvalidRequest, match="deadline_s"):
            await engine.prefill([1], deadline_s=bad)
        assert engine.stats().submitted == 0


async def test_request_id_appears_in_errors_and_logs(caplog):
    caplog.set_level(logging.INFO, logger="aioprefill")
    async with Engine(EngineConfig(model=sim(1.0, fail_token=31999))) as engine:
        with pytest.raises(ForwardFailed, match=r"request 'req-42'") as info:
            await engine.prefill([5, 31999], request_id="req-42")
        assert info.value.request_id == "req-42"
        with pytest.raises(InvalidRequest, match="request_id must be a str or an int"):
            await engine.prefill([5], request_id=4.5)
        assert (await engine.prefill([5], request_id="req-44")).token == expected_token([5])
    assert "req-42" in caplog.text


async def test_request_id_names_errors_raised_before_admission():
    """Refusals before anything is queued name the caller's request too (type kept)."""
    async with Engine(EngineConfig(model=sim(1000.0), max_pending=1)) as engine:
        with pytest.raises(InvalidRequest, match=r"^request 'bad-1': .*32000") as info:
            await engine.prefill([5, 32000], request_id="bad-1")
        assert info.value.request_id == "bad-1"
        with pytest.raises(InvalidRequest, match=r"^request 7: top_k"):
            await engine.prefill([5], top_k=-1, request_id=7)
        with pytest.raises(InvalidRequest, match=r"^prompt") as plain:  # no id: as before
            await engine.prefill([])
        assert not hasattr(plain.value, "request_id")
        busy = asyncio.ensure_future(engine.prefill([1]))  # holds the worker
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(engine.prefill([2]))  # the one pending slot
        await asyncio.sleep(0.05)
        with pytest.raises(EngineOverloaded, match=r"^request 'over-1': 1 requests already"):
            await engine.prefill([3], request_id="over-1")
        assert engine.stats().submitted == 2
        queued.cancel()
        busy.cancel()
    with pytest.raises(EngineClosed, match=r"^request 'late': engine is closed"):
        await engine.prefill([4], request_id="late")


async def test_drain_stops_admitting_and_finishes_what_was_accepted():
    async with Engine(EngineConfig(model=sim(50.0), max_batch_size=8)) as engine:
        accepted = [asyncio.ensure_future(engine.prefill([i + 1])) for i in range(30)]
        await asyncio.sleep(0)  # every request is accepted (queued) now
        draining = asyncio.ensure_future(engine.drain())
        await asyncio.sleep(0)
        assert not engine.is_running and engine.health().state == "draining"
        with pytest.raises(EngineClosed, match="draining"):
            await engine.prefill([99])
        await draining
        results = await asyncio.gather(*accepted)
        assert [r.token for r in results] == [expected_token([i + 1]) for i in range(30)]
        assert engine.stats().in_flight == 0
    assert engine.health().state == "closed"
