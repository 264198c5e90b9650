"""`WorkerSlot`: the pool's record of one worker group position; `PoolEvents`, the engine's
handlers for what the pool watches.

A slot outlives the processes that fill it: when its group dies, the engine recovers the
batches in flight on it and the pool starts new processes in the same slot. A slot is a
*group of ranks* (one process, a tensor-parallel replica, or one rank of an expert-parallel
group): one batch goes to every rank of a replica, and it is done when every rank answered it.
Only the `aioprefill.engine.pool` package writes a slot's fields: `WorkerPool`, `launch_group` (the
ranks) and `answers` (the acknowledgements; a corrupt ring's `ready`). Like all engine state it
is touched only from the event loop's thread; the policies and `health()` only read it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from aioprefill.engine.pool.backoff import RestartBackoff
from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.sched.units import InFlightBatch

__all__ = ["InFlightBatch", "PoolEvents", "WorkerSlot"]


@dataclass(slots=True, eq=False)
class WorkerSlot:
    index: int
    backoff: RestartBackoff
    ranks: list[WorkerHandle] = field(default_factory=list)  # rank 0 first; empty when down
    # acked[r]: how many of the batches in flight (from the oldest) rank r answered
    acked: list[int] = field(default_factory=list)
    in_flight: deque[InFlightBatch] = field(default_factory=deque)
    free_ids: list[int] = field(default_factory=list)  # KV state to drop with the next batch
    ready: bool = False
    ring_full: bool = False  # the last send found no room: wait for its next answer
    last_forward_end_ns: int = 0
    timer: asyncio.TimerHandle | None = None
    # Prefix cache, from its ranks' Ready: slots (the fewest of any rank), bytes per block
    # (all ranks), and which start of the group they describe (counted up at every start).
    cache_blocks: int = 0
    block_bytes: int = 0
    generation: int = 0

    @property
    def usable(self) -> bool:
        return self.ready and not self.ring_full

    @property
    def handle(self) -> WorkerHandle | None:
        """Rank 0's process (the one that answers), or None while the group is down."""
        return self.ranks[0] if self.ranks else None

    def __repr__(self) -> str:
        # Short on purpose: asyncio debug mode reprs the args of every timer it cancels, and
        # the generated repr walks every in-flight batch (quadratic in the backlog).
        return f"<worker group {self.index} ready={self.ready} in_flight={len(self.in_flight)}>"


@dataclass(slots=True, frozen=True)
class PoolEvents:
    """The engine's handlers for what the pool watches, all called by the event loop (never by
    the pool from inside a call the engine made)."""

    # The group's forward-done eventfd fired (the engine then calls `read_answers`).
    on_forward_done: Callable[[WorkerSlot], None]
    # A rank's exit fd fired: it exited (the engine then calls `stop_group`).
    on_exit: Callable[[WorkerSlot, WorkerHandle], None]
    on_restarted: Callable[[WorkerSlot], None]  # a dead group is ready again
    on_gave_up: Callable[[WorkerSlot], None]  # a restart failed once too often: it stays down
