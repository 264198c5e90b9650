"""Forged and corrupt bytes in a live engine's result ring.

The worker is frozen with SIGSTOP mid-forward, so the test can write into its result ring
without racing it (the ring has one producer), then wakes the engine through the ring's
eventfd. Garbage is counted and reported; a forged answer never resolves a caller with
someone else's result; a corrupt ring gets the worker killed and its requests retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, PrefillResult
from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.errors import ProtocolError, WorkerStartFailed
from aioprefill.shm import segments
from aioprefill.shm.ring import DATA_OFFSET, Ring
from aioprefill.wire.protocol import BatchResult, Ready, encode
from aioprefill.workers.sim import expected_logprob, expected_token
from tests.conftest import own_segments
from tests.reliability.util import all_ready, kill_worker, sim, until

pytestmark = pytest.mark.asyncio

HEAD, TAIL = 64, 128  # byte offsets of the ring counters (layout: aioprefill/shm/ring.py)


def outbox_ring(engine: Engine, index: int = 0) -> str:
    handle = engine._pool.slots[index].handle
    assert handle is not None and handle.outbox is not None and handle.outbox.ring is not None
    return handle.outbox.ring.name


def wake(engine: Engine, index: int = 0) -> None:
    """Signal the engine as the worker does after writing a frame."""
    handle = engine._pool.slots[index].handle
    assert handle is not None and handle.outbox is not None and handle.outbox.data is not None
    handle.outbox.data.notify()


@contextlib.contextmanager
def forger(engine: Engine) -> Iterator[Ring]:
    """A second producer on worker 0's result ring (safe only while the worker is stopped)."""
    ring = Ring.attach(outbox_ring(engine))
    try:
        yield ring
    finally:
        ring.close()


def result(batch_id: int, ids: list[int], tokens: list[int], n_logprobs: int | None = None):
    n = len(ids) if n_logprobs is None else n_logprobs
    return BatchResult(
        batch_id=batch_id,
        forward_start_ns=1,
        forward_end_ns=2,
        request_ids=np.array(ids, "<i8").tobytes(),
        tokens=np.array(tokens, "<i4").tobytes(),
        logprobs=np.zeros(n, "<f8").tobytes(),
    )


async def stop_mid_forward(engine: Engine, prompts: list[list[int]]):
    """Get `prompts` into one batch in flight on worker 0, then SIGSTOP it mid-forward."""
    w = engine._pool.slots[0]
    first = asyncio.create_task(engine.prefill([99]))  # alone: the others gather behind it
    await until(lambda: bool(w.in_flight), what="the first forward")
    stale_batch = w.in_flight[0].batch_id
    tasks = [asyncio.create_task(engine.prefill(p)) for p in prompts]
    await first
    await until(
        lambda: bool(w.in_flight) and w.in_flight[0].batch_id != stale_batch,
        what="the gathered batch",
    )
    kill_worker(engine, 0, signal.SIGSTOP)
    batch = w.in_flight[0]
    ids = [c.request.request_id for c in batch.chunks]
    assert len(ids) == len(prompts)
    return tasks, stale_batch, batch.batch_id, ids


@pytest.mark.parametrize("answer", ["swapped", "lying-length", "unknown-id"])
async def test_forged_frames_are_counted_and_reach_no_wrong_caller(answer: str):
    prompts = [[1, 2, 3], [4, 5]]
    a, b = (expected_token(p) for p in prompts)
    async with Engine(EngineConfig(model=sim(300.0), num_workers=1)) as engine:
        tasks, stale, current, (id_a, id_b) = await stop_mid_forward(engine, prompts)
        junk = [
            b"",
            b"\xff" * 40,  # not msgpack
            b"\x93\xa5Ready\x01",  # a truncated message
            encode(Ready(worker=0, pid=1, device="x", started_ns=0, ready_ns=0)),  # unexpected
            encode(result(stale, [id_a, id_b], [a, b])),  # a stale batch id
            encode(result(current + 1000, [id_a], [a])),  # an unknown batch id
        ]
        forged = {
            "swapped": result(current, [id_b, id_a], [b, a]),
            "lying-length": result(current, [id_a, id_b], [a, b], n_logprobs=1),
            "unknown-id": result(current, [id_a, 424242], [a, b]),
        }[answer]
        with forger(engine) as ring:
            for frame in [*junk, encode(forged)]:
                assert ring.try_write(frame)
        wake(engine)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        stats = engine.stats()
        assert stats.protocol_errors == len(junk) + (2 if answer == "swapped" else 1)
        if answer == "unknown-id":  # the id that lines up is answered; the other is refused
            assert isinstance(outcomes[0], PrefillResult) and outcomes[0].token == a
            assert isinstance(outcomes[1], ProtocolError)
        else:
            assert all(isinstance(o, ProtocolError) for o in outcomes), outcomes
        # The frozen worker never answers again: kill it; its replacement serves.
        kill_worker(engine, 0)
        await until(lambda: all_ready(engine), what="the restart")
        r = await asyncio.wait_for(engine.prefill([7, 7]), 10)
        assert r.token == expected_token([7, 7])


@pytest.mark.parametrize("corruption", ["head-backwards", "head-unaligned", "lying-length"])
async def test_a_corrupt_result_ring_kills_the_worker_and_retries(corruption: str):
    prompts = [[1, 2, 3], [4, 5]]
    async with Engine(EngineConfig(model=sim(300.0), num_workers=1)) as engine:
        old_pid = engine.worker_pids()[0]
        tasks, _, _, _ = await stop_mid_forward(engine, prompts)
        mm = segments.attach_segment(outbox_ring(engine))
        try:
            head = int.from_bytes(mm[HEAD : HEAD + 8], "little")
            assert head == int.from_bytes(mm[TAIL : TAIL + 8], "little") > 0  # all consumed
            cap = int.from_bytes(mm[16:24], "little")
            if corruption == "head-backwards":
                new_head = head - 8
            elif corruption == "head-unaligned":
                new_head = head + 3
            else:  # a frame whose length prefix claims far more than was published
                at = DATA_OFFSET + head % cap
                mm[at : at + 8] = (cap // 2 - 8).to_bytes(8, "little")
                new_head = head + 16
            mm[HEAD : HEAD + 8] = new_head.to_bytes(8, "little")
        finally:
            mm.close()
        wake(engine)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 10)  # retried: all succeed
        for p, r in zip(prompts, results, strict=True):
            assert r.token == expected_token(p) and r.logprob == pytest.approx(expected_logprob(p))
        stats = engine.stats()
        assert stats.protocol_errors == 1 and stats.retried == 2 and stats.failed == 0
        assert engine.worker_pids() != [old_pid]


async def test_garbage_instead_of_ready_fails_the_start_cleanly(monkeypatch):
    launch = WorkerHandle.start

    def start_then_forge(self: WorkerHandle) -> None:
        assert self.outbox is not None and self.outbox.ring is not None
        ring = Ring.attach(self.outbox.ring.name)
        ring.try_write(b"\xc1 not a message")
        ring.close()
        launch(self)

    monkeypatch.setattr(WorkerHandle, "start", start_then_forge)
    engine = Engine(EngineConfig(model=sim(), num_workers=1))
    with pytest.raises(WorkerStartFailed, match="malformed"):
        await engine.start()
    assert not own_segments()
