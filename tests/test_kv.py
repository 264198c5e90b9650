"""KV export handles end to end (SimModel workers): what they hold, closing them, the byte
budget, failed and cancelled requests, engine close, and callers that die holding them. No
/dev/shm entry may survive any of it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, EngineOverloaded, ForwardFailed, InvalidRequest
from aioprefill.errors import KVBudgetExceeded, KVExportClosed, WorkerCrashed
from aioprefill.shm.segments import cleanup_stale_segments, owner_pid
from aioprefill.wire.kv import SIM_KV_LAYOUT
from aioprefill.workers.sim import sim_kv
from tests.conftest import own_segments
from tests.reliability.util import sim, until_sent, wait_dead

SHM = Path("/dev/shm")
ROOT = Path(__file__).parents[1]
PER_TOKEN = SIM_KV_LAYOUT.nbytes(1)  # 2 layers x 2 heads x 8 dims x 4 bytes x (K, V) = 256


def kv_segments(engine: Engine) -> list[str]:
    return [n for n in own_segments() if n.endswith("-" + engine._kv._tag)]


@pytest.mark.asyncio
async def test_handle_maps_closes_and_frees():
    async with Engine(EngineConfig(model=sim())) as engine:
        r = await engine.prefill([4, 5, 6], return_kv=True)
        kv = r.kv
        path = SHM / kv.name
        assert owner_pid(kv.name) == os.getpid()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.stat().st_size == kv.nbytes == 3 * PER_TOKEN
        assert engine._kv.used_bytes == kv.nbytes
        with kv as opened:
            keys = opened.keys
            want_keys, want_values = sim_kv([4, 5, 6])
            assert np.array_equal(keys, want_keys) and np.array_equal(opened.values, want_values)
            with pytest.raises(ValueError):
                keys[0, 0, 0, 0] = 1.0  # read-only views
        assert kv.closed and not path.exists() and engine._kv.used_bytes == 0
        assert np.array_equal(keys, want_keys)  # arrays held past close() stay readable
        with pytest.raises(KVExportClosed):
            _ = kv.keys
        kv.close()  # twice: a no-op
        assert kv_segments(engine) == []


@pytest.mark.asyncio
async def test_engine_close_frees_exports_left_open():
    async with Engine(EngineConfig(model=sim())) as engine:
        results = await asyncio.gather(*(engine.prefill([i, 1], return_kv=True) for i in range(8)))
        names = [r.kv.name for r in results]
        assert all((SHM / n).exists() for n in names)
    assert all(r.kv.closed for r in results)
    assert not any((SHM / n).exists() for n in names)


@pytest.mark.asyncio
async def test_budget_refuses_before_queueing_and_recovers_on_close():
    config = EngineConfig(model=sim(), max_kv_export_bytes=10 * PER_TOKEN)
    async with Engine(config) as engine:
        first = await engine.prefill(list(range(8)), return_kv=True)
        submitted = engine.stats().submitted
        with pytest.raises(KVBudgetExceeded) as caught:
            await engine.prefill([1, 2, 3], return_kv=True)
        assert isinstance(caught.value, EngineOverloaded)
        assert "max_kv_export_bytes" in str(caught.value)
        with pytest.raises(InvalidRequest, match="max_kv_export_bytes"):
            await engine.prefill(list(range(11)), return_kv=True)  # could never fit
        assert engine.stats().submitted == submitted
        plain = await engine.prefill([1, 2, 3])  # plain requests do not care
        assert plain.kv is None
        first.kv.close()  # kept for reuse and still counted...
        assert engine._kv.used_bytes == engine._kv.pooled_bytes == 8 * PER_TOKEN
        second = await engine.prefill([1, 2, 3], return_kv=True)  # ...until room is needed
        assert engine._kv.pooled_bytes == 0 and engine._kv.used_bytes == 3 * PER_TOKEN
        third = await engine.prefill(list(range(7)), return_kv=True)  # exactly the budget
        assert engine._kv.used_bytes == config.max_kv_export_bytes
        second.kv.close()
        third.kv.close()


@pytest.mark.asyncio
async def test_failed_crashed_and_cancelled_requests_leave_nothing():
    model = sim(fixed_ms=300.0, fail_token=31000, crash_token=31001)
    config = EngineConfig(model=model, max_retries=0)
    async with Engine(config) as engine:
        with pytest.raises(ForwardFailed):
            await engine.prefill([1, 31000], return_kv=True)
        with pytest.raises(WorkerCrashed):
            await engine.prefill([1, 31001], return_kv=True)
        task = asyncio.ensure_future(engine.prefill([1, 2, 3], return_kv=True))
        await until_sent(engine)  # in the worker's forward now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The worker still writes the export; the engine removes it when the answer comes.
        await engine.prefill([9])
        assert engine._kv.used_bytes == 0 and engine._kv.num_open == 0
        assert kv_segments(engine) == []


@pytest.mark.asyncio
async def test_a_tp_sim_group_exports_rank_0s_kv_into_fresh_segments():
    """Rank 0 alone writes a TP SimModel group's export: two ranks creating one fresh segment
    raced (one mapped it before the other had sized it: `ForwardFailed`, ~1 batch in 100)."""
    async with Engine(EngineConfig(model=sim(), tp_size=2)) as engine:
        prompts = [[i, 7, i + 3] for i in range(40)]
        rs = await asyncio.gather(*(engine.prefill(p, return_kv=True) for p in prompts))
        for p, r in zip(prompts, rs, strict=True):
            with r.kv as kv:
                keys, values = sim_kv(p)
                assert np.array_equal(kv.keys, keys) and np.array_equal(kv.values, values)
        assert engine._kv.num_open == 0


@pytest.mark.parametrize("mode", ["exit", "kill", "kill-tracker"])
def test_a_caller_that_dies_holding_exports_leaks_nothing(mode: str):
    """`exit`/`kill`: the caller's resource tracker removes its exports once it is gone.
    `kill-tracker`: the tracker dies too; the next engine's start sweeps them (dead owner pid)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = ROOT / "tests" / "kv_child.py"
    arg = "exit" if mode == "exit" else "kill"
    proc = subprocess.Popen([sys.executable, str(child), arg], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        report = json.loads(proc.stdout.readline())
        names = report["names"]
        assert len(names) == 3 and all(owner_pid(n) == report["pid"] for n in names)
        assert all((SHM / n).exists() for n in names)
        if mode == "kill-tracker":
            os.kill(report["tracker"], signal.SIGKILL)
            assert not wait_dead([report["tracker"]], 5)
        if mode != "exit":
            proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert not wait_dead([report["tracker"]], 10)
    if mode == "kill-tracker":
        # Nobody removed them: this engine-start sweep must (an engine another test process
        # starts meanwhile may sweep them first: same uid, same rule).
        cleanup_stale_segments()
    deadline = time.monotonic() + 10
    while any((SHM / n).exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)  # the tracker unlinks right after it exits... or just before
    assert not any((SHM / n).exists() for n in names)


def test_a_retry_replaces_the_half_written_export_of_a_dead_worker():
    """The engine keeps a request's segment name across retries: a worker that died part-way
    through writing leaves the segment behind, and the retry's writer replaces it."""
    from aioprefill.wire.kv import KVExports
    from aioprefill.workers.kv_writer import KVSegmentWriter

    ledger = KVExports(sim(), 1 << 20)
    ticket = ledger.reserve(4)
    dead = KVSegmentWriter(ticket.name, SIM_KV_LAYOUT, 4)
    dead.keys[...] = 7.0
    dead.close()  # as if its process died here: the segment stays
    retry = KVSegmentWriter(ticket.name, SIM_KV_LAYOUT, 4)
    retry.keys[...], retry.values[...] = sim_kv([1, 2, 3, 4])
    retry.close()
    with ledger.open(ticket) as kv:
        assert np.array_equal(kv.keys, sim_kv([1, 2, 3, 4])[0])
    ledger.close_all()
    assert not (SHM / ticket.name).exists() and ledger.used_bytes == 0


@pytest.mark.asyncio
async def test_closed_exports_are_reused_unless_their_arrays_are_still_held():
    async with Engine(EngineConfig(model=sim())) as engine:
        a = await engine.prefill([1, 2, 3, 4], return_kv=True)
        name = a.kv.name
        with a.kv as kv:
            assert np.array_equal(kv.keys, sim_kv([1, 2, 3, 4])[0])
        assert (SHM / name).exists() and engine._kv.pooled_bytes == a.kv.nbytes
        # A prompt of 3 tokens fits the 4-token segment (not more than twice its size).
        b = await engine.prefill([5, 6, 7], return_kv=True)
        assert b.kv.name == name and engine._kv.pooled_bytes == 0
        with b.kv as kv:
            held = kv.keys  # the caller keeps an array past close()
            want_keys, want_values = sim_kv([5, 6, 7])
            assert np.array_equal(held, want_keys) and np.array_equal(kv.values, want_values)
        assert not (SHM / name).exists()  # so these pages are never handed out again
        c = await engine.prefill([5, 6, 7, 8], return_kv=True)
        assert c.kv.name != name
        assert np.array_equal(held, want_keys)
        tiny = await engine.prefill([9], return_kv=True)  # too small for c's segment: fresh
        c.kv.close()
        tiny.kv.close()
        assert engine._kv.num_open == 0 and engine._kv.pooled_bytes == engine._kv.used_bytes
        kept = [n for n, _ in engine._kv._pool]
    assert not any((SHM / n).exists() for n in kept)  # engine close removes kept segments
