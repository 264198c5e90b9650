"""The engine's state and what a server embedding an `Engine` uses besides `prefill()`.

`Lifecycle` holds the state (new, starting, running, draining, closing, closed; broken) and
the callers waiting on it (for room under `max_pending`, for the last request to end): the only
writer of both, moved by the engine's calls. `EngineControls`, a mixin of `Engine`, is
`is_running`, `health()`, `drain()`, `submit_threadsafe()` and `tokenizer`, kept apart so the
engine file stays about scheduling. Like everything in the engine these run on the event loop
that started it; `submit_threadsafe()` is the one door in from other threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Self

from aioprefill.engine.affinity import LoopAffinity
from aioprefill.engine.health import EngineHealth, health_of
from aioprefill.errors import AioprefillError, EngineClosed
from aioprefill.sched.prefix.hashing import check_salt
from aioprefill.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from aioprefill.config import EngineConfig
    from aioprefill.engine.pool.pool import WorkerPool
    from aioprefill.result import PrefillResult
    from aioprefill.sched.prefix.cache import PrefixCache
    from aioprefill.sched.scheduler import Scheduler

__all__ = ["SERVING", "EngineControls", "Lifecycle", "State"]


class State(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"  # drain(): admits nothing new, finishes what it accepted
    CLOSING = "closing"
    CLOSED = "closed"


SERVING = (State.RUNNING, State.DRAINING, State.CLOSING)  # workers get batches


class Lifecycle:
    """The engine's state and the callers waiting on it; each field has this one writer."""

    def __init__(self, sched: Scheduler, max_pending: int) -> None:
        self.state = State.NEW
        self.broken: AioprefillError | None = None  # every worker given up: refuse everything
        self.loop: asyncio.AbstractEventLoop | None = None
        self._sched = sched
        self._max_pending = max_pending
        self._room_waiters: deque[asyncio.Future[None]] = deque()
        self._idle_waiter: asyncio.Future[None] | None = None

    @property
    def serving(self) -> bool:
        """Workers get batches (running, draining, or closing with work left)."""
        return self.state in SERVING

    @property
    def may_retry(self) -> bool:
        return self.state in (State.RUNNING, State.DRAINING)

    def starting(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.state is not State.NEW:
            raise EngineClosed(f"engine cannot start: it is {self.state.value}")
        self.state = State.STARTING
        self.loop = loop

    def started(self, ok: bool) -> None:
        self.state = State.RUNNING if ok else State.CLOSED

    def closing(self) -> bool:
        """Begin closing; False when it is closing or closed already."""
        if self.state in (State.CLOSING, State.CLOSED):
            return False
        self.state = State.CLOSING
        return True

    def closed(self) -> None:
        self.state = State.CLOSED

    def draining(self) -> bool:
        """Admit nothing new; True while there is something to wait for (`idle()`)."""
        if self.state is State.RUNNING:
            self.state = State.DRAINING
        return self.state is State.DRAINING

    def broke(self, error: AioprefillError) -> None:
        """Every worker was given up: from now on every call raises `error`."""
        self.broken = error

    def check_open(self) -> None:
        if self.state is not State.RUNNING:
            new = self.state is State.NEW
            hint = " (use `async with Engine(config) as engine`)" if new else ""
            raise EngineClosed(f"engine is {self.state.value}{hint}")
        if self.broken is not None:
            raise self.broken

    async def wait_for_room(self) -> None:
        assert self.loop is not None
        while self._sched.num_pending >= self._max_pending:
            waiter: asyncio.Future[None] = self.loop.create_future()
            self._room_waiters.append(waiter)
            await waiter
            self.check_open()

    async def idle(self) -> None:
        """Wait until no accepted request is left (one waiter shared by drain and close)."""
        if self._sched.num_in_flight:
            if self._idle_waiter is None or self._idle_waiter.done():
                assert self.loop is not None
                self._idle_waiter = self.loop.create_future()
            await asyncio.shield(self._idle_waiter)

    def wake(self) -> None:
        """After every event: wake callers waiting for room, and the idle waiter."""
        if self._room_waiters:
            room = self._max_pending - self._sched.num_pending
            while room > 0 and self._room_waiters:
                waiter = self._room_waiters.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    room -= 1
        idle = self._idle_waiter
        if idle is not None and self._sched.num_in_flight == 0 and not idle.done():
            idle.set_result(None)

    def wake_all(self) -> None:
        """Everything failed (closed, or broken): every room waiter rechecks and leaves."""
        for waiter in self._room_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._room_waiters.clear()


class EngineControls:
    config: EngineConfig
    _affinity: LoopAffinity
    _life: Lifecycle
    _pool: WorkerPool
    _sched: Scheduler
    if TYPE_CHECKING:  # Engine's
        prefill: Callable[..., Coroutine[Any, Any, PrefillResult]]
        start: Callable[[], Coroutine[Any, Any, None]]
        close: Callable[..., Coroutine[Any, Any, None]]

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: object, exc: object, tb: object) -> None:
        await self.close(drain=exc_type is None)

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer `prefill(str)` uses: `EngineConfig(tokenizer=)`, or the model's own
        (a checkpoint with tokenizer.json, a .gguf file); None when there is none."""
        tokenizer = self.config.tokenizer
        return tokenizer if isinstance(tokenizer, Tokenizer) else None

    @property
    def is_running(self) -> bool:
        """True while the engine admits and can serve requests: False once it drains, closes,
        or every worker was given up."""
        return self._life.state is State.RUNNING and self._life.broken is None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """What every worker's prefix cache holds (None when `prefix_cache_bytes` is 0). Set
        its `observer` (`aioprefill.sched.prefix.CacheObserver`) to be told of every block stored,
        evicted or lost, e.g. to publish vLLM-style KV events."""
        return self._sched.cache

    def health(self) -> EngineHealth:
        """Each worker's state (ready, busy, restarting, given up...) and `is_running`."""
        life = self._life
        state = "broken" if life.broken is not None else life.state.value
        return health_of(state, self.is_running, self._pool.slots)

    async def drain(self) -> None:
        """Stop admitting (`prefill()` raises `EngineClosed`) and wait until every accepted
        request finished; `close()` then has nothing left to wait for."""
        self._affinity.check("drain()")
        if self._life.draining():
            await self._life.idle()

    def submit_threadsafe(self, tokens: Any, **options: Any) -> concurrent.futures.Future[Any]:
        """`prefill(tokens, **options)` from a thread other than the engine's: returns a
        `concurrent.futures.Future` (cancel it to cancel the request). A bad `cache_salt`
        raises `InvalidRequest` here, in the caller's thread."""
        check_salt(options.get("cache_salt"))
        return self._affinity.submit(self.prefill(tokens, **options))
