"""Real worker processes started as the ranks of a group (what the engine's pool does): they
form the group before Ready, a tensor-parallel rank > 0 only acknowledges, and when one rank
dies its peer leaves with EXIT_GROUP_BROKEN instead of waiting forever."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator

import numpy as np
import pytest

from aioprefill.config import EngineConfig, ModelSpec, SimModel
from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.parallel import ParallelInfo, ParallelMode
from aioprefill.sched.batching import make_prefill_batch
from aioprefill.wire import protocol
from aioprefill.wire.protocol import BatchDone, BatchResult
from aioprefill.workers.group import EXIT_GROUP_BROKEN, free_port
from aioprefill.workers.sim import expected_token
from tests.model.batches import SMALL

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def group(
    model: ModelSpec, parallel: ParallelMode, size: int = 2
) -> AsyncIterator[list[WorkerHandle]]:
    config = EngineConfig(model=model, num_workers=size)
    master = f"127.0.0.1:{free_port()}"
    handles = []
    try:
        for rank in range(size):
            place = ParallelInfo(mode=parallel, rank=rank, size=size, master=master)
            h = WorkerHandle(rank, config, place)
            handles.append(h)
            h.start()
        await asyncio.gather(*(h.wait_ready(120.0) for h in handles))
        yield handles
    finally:
        for h in handles:
            h.kill()
            if h.process is not None:
                h.process.join(10)
            h.close()


def send(h: WorkerHandle, batch_id: int, prompts: list[list[int]]) -> None:
    parts = [np.asarray(p, dtype="<i4").tobytes() for p in prompts]
    msg = make_prefill_batch(batch_id, list(range(len(prompts))), parts, None, None, [], 0)
    assert h.inbox is not None and h.inbox.send_nowait(protocol.encode(msg))


async def answer(h: WorkerHandle):
    assert h.outbox is not None
    while (view := h.outbox.recv_nowait()) is None:
        await h.outbox.wait_async()
    try:
        return protocol.decode_from_worker(view)
    finally:
        h.outbox.release()


async def exit_code(h: WorkerHandle, timeout: float = 60.0) -> int | None:
    assert h.process is not None
    await asyncio.to_thread(h.process.join, timeout)
    return h.process.exitcode


PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]]


async def test_tp_rank_acknowledges_and_a_dead_peer_breaks_the_group() -> None:
    async with group(SimModel(fixed_ms=2.0), "tp") as (rank0, rank1):
        for h in (rank0, rank1):
            send(h, 1, PROMPTS)
        first, second = await answer(rank0), await answer(rank1)
        assert isinstance(first, BatchResult) and first.batch_id == 1
        assert first.arrays()[1].tolist() == [expected_token(p) for p in PROMPTS]
        assert isinstance(second, BatchDone) and second.batch_id == 1
        os.kill(rank1.pid, signal.SIGKILL)
        send(rank0, 2, PROMPTS)  # rank 0 reaches the step's barrier alone
        assert await exit_code(rank0) == EXIT_GROUP_BROKEN


async def test_slow_rank_answers_after_its_peer() -> None:
    """SimModel(slow_rank=1): rank 1 answers each batch slow_rank_ms after the step's barrier
    (the straggler the engine's TP race tests need)."""
    async with group(SimModel(fixed_ms=1.0, slow_rank=1, slow_rank_ms=300.0), "tp") as ranks:
        for h in ranks:
            send(h, 1, PROMPTS)
        first, late = await answer(ranks[0]), await answer(ranks[1])
    assert isinstance(first, BatchResult) and isinstance(late, BatchDone)
    # rank 1 left the barrier after rank 0 did, then slept 300 ms before stamping its end
    assert late.forward_end_ns - first.forward_end_ns >= 250e6


async def test_ep_rank_with_an_empty_batch_completes_the_step() -> None:
    async with group(SimModel(fixed_ms=2.0), "ep") as (rank0, rank1):
        send(rank0, 1, PROMPTS)
        send(rank1, 1, [])
        busy, idle = await answer(rank0), await answer(rank1)
        assert isinstance(busy, BatchResult) and len(busy.arrays()[0]) == 2
        assert isinstance(idle, BatchResult) and len(idle.arrays()[0]) == 0


@pytest.mark.slow
async def test_paddle_tp_group_answers_like_a_single_rank() -> None:
    from tests.model.batches import make_batch, runner

    async with group(SMALL, "tp") as (rank0, rank1):
        for h in (rank0, rank1):
            send(h, 7, PROMPTS)
        got, ack = await answer(rank0), await answer(rank1)
    want = runner(SMALL).forward(make_batch([np.asarray(p) for p in PROMPTS]))
    assert isinstance(got, BatchResult) and isinstance(ack, BatchDone)
    _, tokens, logprobs = got.arrays()
    assert tokens.tolist() == want.tokens.tolist()
    assert np.abs(logprobs - want.logprobs).max() <= 1e-5
