"""`WorkerSlot`: the engine's record of one worker position, and `InFlightBatch`.

A slot outlives the processes that fill it: when its worker dies, the engine recovers the
batches in flight on it and starts a new process in the same slot. The slot keeps what that
needs: the process handle and its fds on the event loop, the batches in flight (in ring order),
the forward timer, and the recent deaths that decide the restart backoff. Like all engine
state it is touched only from the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from aioprefill.policy import Chunk
from aioprefill.workers.process import WorkerHandle

__all__ = ["InFlightBatch", "WorkerSlot"]

# Restart backoff: 50 ms after the first death in the window, doubling, at most 5 s.
_BACKOFF_FIRST_S = 0.05
_BACKOFF_MAX_S = 5.0


@dataclass(slots=True, eq=False)
class InFlightBatch:
    batch_id: int
    chunks: list[Chunk]
    num_tokens: int
    dispatched_ns: int
    backlogged: bool  # work was waiting when it was sent: the gap before it is a bubble


@dataclass(slots=True, eq=False)
class WorkerSlot:
    index: int
    handle: WorkerHandle | None = None
    in_flight: deque[InFlightBatch] = field(default_factory=deque)
    free_ids: list[int] = field(default_factory=list)  # KV state to drop with the next batch
    ready: bool = False
    ring_full: bool = False  # the last send found no room: wait for its next result
    last_forward_end_ns: int = 0
    timer: asyncio.TimerHandle | None = None
    deaths: deque[float] = field(default_factory=deque)
    gave_up: bool = False  # died too often: no more restarts

    @property
    def usable(self) -> bool:
        return self.ready and not self.ring_full

    def __repr__(self) -> str:
        # Short on purpose: asyncio debug mode reprs the args of every timer it cancels, and
        # the generated repr walks every in-flight batch (quadratic in the backlog).
        return f"<worker {self.index} ready={self.ready} in_flight={len(self.in_flight)}>"

    def watch(
        self,
        loop: asyncio.AbstractEventLoop,
        on_forward_done: Callable[[WorkerSlot], None],
        on_exit: Callable[[WorkerSlot], None],
    ) -> None:
        """The worker reported ready: react to its forward-done eventfd and its sentinel."""
        handle = self.handle
        assert handle is not None and handle.outbox is not None
        loop.add_reader(handle.outbox.fds()[0], on_forward_done, self)
        loop.add_reader(handle.sentinel, on_exit, self)
        self.ready = True
        self.ring_full = False
        self.last_forward_end_ns = 0

    def unwatch(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Stop reacting to the worker's fds (its exit is then no longer a death)."""
        handle = self.handle
        if handle is None or loop is None or loop.is_closed():
            return
        if handle.outbox is not None:
            loop.remove_reader(handle.outbox.fds()[0])
        if handle.process is not None and handle.process.pid is not None:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(handle.sentinel)

    def discard(self, loop: asyncio.AbstractEventLoop | None, *, kill: bool) -> None:
        """Forget the process and its channels (its in-flight work must be handled first)."""
        self.ready = False
        self.cancel_timer()
        self.unwatch(loop)
        handle, self.handle = self.handle, None
        if handle is None:
            return
        if kill:
            handle.kill()
        if handle.pid > 0:  # never started (a failed launch): nothing to join
            handle.process.join(timeout=5.0)  # type: ignore[union-attr]
        handle.close()

    def arm_timer(
        self,
        loop: asyncio.AbstractEventLoop | None,
        timeout: float | None,
        on_timeout: Callable[[WorkerSlot], None],
    ) -> None:
        """Start the forward timer for the batch now running, if a timeout is configured."""
        if timeout is not None and loop is not None:
            self.timer = loop.call_later(timeout, on_timeout, self)

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def note_death(self, now: float, window_s: float, max_restarts: int) -> float | None:
        """Record a death; return the backoff before restarting, or None: give up on it."""
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > window_s:
            self.deaths.popleft()
        if len(self.deaths) > max_restarts:
            self.gave_up = True
            return None
        return min(_BACKOFF_MAX_S, _BACKOFF_FIRST_S * 2 ** (len(self.deaths) - 1))
