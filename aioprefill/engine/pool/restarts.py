"""`Restarts`: bringing a dead worker group back after its backoff, or giving it up.

A group (a lone worker, a tensor-parallel replica, or a whole expert-parallel group) restarts
as a whole: all its ranks were stopped together, and they only work together. Its
`RestartBackoff` (shared by the slots of an expert-parallel group) says how long to wait, or
that it died too often. The restart runs as a task off the hot path; a failed restart counts
as one more death.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from aioprefill.engine.pool.slot import PoolEvents, WorkerSlot

__all__ = ["Restarts"]

log = logging.getLogger("aioprefill")


def _names(group: list[WorkerSlot]) -> str:
    return ",".join(str(s.index) for s in group)


class Restarts:
    def __init__(
        self, start: Callable[[list[WorkerSlot]], Awaitable[None]], events: PoolEvents
    ) -> None:
        self.allowed = False  # the engine opens this while it starts and runs
        self._start = start
        self._events = events
        self.tasks: set[asyncio.Task[None]] = set()

    def schedule(self, group: list[WorkerSlot]) -> bool:
        """`group` just died: restart it after its backoff (True), or give it up (False; the
        caller, who knows of the death, acts on that: `on_gave_up` is for failed restarts)."""
        backoff = group[0].backoff
        delay = backoff.note_death(time.monotonic())
        if delay is None:
            log.error(
                "worker %s died %d times in %.0f s: not restarting",
                _names(group),
                len(backoff.deaths),
                backoff.window_s,
            )
            return False
        task = asyncio.get_running_loop().create_task(self._restart(group, delay))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return True

    async def _restart(self, group: list[WorkerSlot], delay: float) -> None:
        await asyncio.sleep(delay)  # backoff between restarts, off the hot path
        if not self.allowed:
            return
        try:
            await self._start(group)
        except Exception as exc:  # any failure (no fork, no shm, bad Ready) counts as a death
            log.error("worker %s could not be restarted: %r", _names(group), exc)
            if not self.schedule(group):
                for s in group:
                    self._events.on_gave_up(s)
            return
        for s in group:
            self._events.on_restarted(s)
