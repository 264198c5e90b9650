"""Starting the processes of one collective group: every rank of the given slots, meeting at
one fresh localhost port, all ready or none left running.

A lone worker is a group of one (no port). A tensor-parallel replica is `tp_size` ranks in one
slot; an expert-parallel group is one rank in each of the `num_workers` slots. The ranks form
their collectives before they report ready, so "ready" means the whole group can run.
"""

from __future__ import annotations

import asyncio
from typing import Literal

from aioprefill.config import EngineConfig
from aioprefill.parallel import ParallelLayout
from aioprefill.protocol import Ready
from aioprefill.workers.group import free_port
from aioprefill.workers.process import WorkerHandle
from aioprefill.workers.slot import WorkerSlot

__all__ = ["launch_group"]


async def launch_group(
    slots: list[WorkerSlot], layout: ParallelLayout, config: EngineConfig
) -> None:
    """Fill `slot.ranks` of every slot with started, ready ranks. On any failure (or
    cancellation) every rank started here is killed and closed, the slots are left empty, and
    the error propagates."""
    size = layout.tp_size * (len(slots) if layout.expert_parallel else 1)
    master = f"127.0.0.1:{free_port()}" if size > 1 else ""
    mode: Literal["", "tp", "ep"] = "" if size == 1 else layout.mode  # type: ignore[assignment]
    waits: list[asyncio.Future[Ready]] = []
    try:
        for slot in slots:
            for r in range(layout.tp_size):
                index = slot.index * layout.tp_size + r
                group, rank, _ = layout.place(index)
                place = {"rank": rank, "group_size": size, "group": group}
                handle = WorkerHandle(index, config, parallel=mode, master=master, **place)
                slot.ranks.append(handle)
                handle.start()
        timeout = config.worker_start_timeout_s
        waits = [asyncio.ensure_future(h.wait_ready(timeout)) for s in slots for h in s.ranks]
        await asyncio.gather(*waits)
    except BaseException:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        for slot in slots:
            ranks, slot.ranks = slot.ranks, []
            for handle in ranks:
                handle.kill()
                if handle.pid > 0:
                    handle.process.join(timeout=5.0)  # type: ignore[union-attr]
                handle.close()
        raise
