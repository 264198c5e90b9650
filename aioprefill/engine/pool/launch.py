"""Starting the processes of one collective group: every rank of the given slots, meeting at
one fresh localhost port, all ready or none left running.

A lone worker is a group of one (no port). A tensor-parallel replica is `tp_size` ranks in one
slot; an expert-parallel group is one rank in each of the `num_workers` slots. The ranks form
their collectives before they report ready, so "ready" means the whole group can run.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable

from aioprefill.config import EngineConfig
from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.engine.pool.slot import WorkerSlot
from aioprefill.parallel import ParallelLayout
from aioprefill.wire.protocol import Ready
from aioprefill.workers.group import free_port

__all__ = ["launch_group"]


async def launch_group(
    slots: list[WorkerSlot], layout: ParallelLayout, config: EngineConfig
) -> None:
    """Fill `slot.ranks` of every slot with started, ready ranks. On any failure (or
    cancellation) every rank started here is killed and closed, the slots are left empty, and
    the error propagates."""
    size = layout.tp_size * (len(slots) if layout.expert_parallel else 1)
    master = f"127.0.0.1:{free_port()}" if size > 1 else ""
    waits: list[asyncio.Future[Ready]] = []

    try:
        # On the loop, not in a thread: a worker's PR_SET_PDEATHSIG follows the *thread* that
        # started it, so a started worker must be the loop thread's child. (Pre-faulting the
        # rings and spawning cost ~10-30 ms per rank, once per start or restart.)
        for slot in slots:
            for r in range(layout.tp_size):
                index = slot.index * layout.tp_size + r
                handle = WorkerHandle(index, config, layout.info(index, master))
                slot.ranks.append(handle)
                handle.start()
        timeout = config.worker_start_timeout_s
        waits = [asyncio.ensure_future(h.wait_ready(timeout)) for s in slots for h in s.ranks]
        await asyncio.gather(*waits)
    except BaseException:
        for w in waits:
            w.cancel()
        await _finish(asyncio.gather(*waits, return_exceptions=True))
        started = [h for s in slots for h in s.ranks]
        for slot in slots:
            slot.ranks = []
        for handle in started:
            handle.kill()
        exiting = [h for h in started if not h.close()]  # channels gone at once
        # reaped without blocking the loop (SIGKILL: they are gone within moments)
        await _finish(asyncio.gather(*(h.wait_exit(5.0) for h in exiting)))
        for handle in exiting:
            handle.reap()
        raise


async def _finish(aw: Awaitable[object]) -> None:
    """Await `aw` to its end even if this task is cancelled meanwhile: clean-up that must not
    be cut short (the caller re-raises its own error, or the cancellation, right after)."""
    task = asyncio.ensure_future(aw)
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
    if not task.cancelled():
        task.exception()  # retrieved: a failed clean-up step is not "never retrieved"
