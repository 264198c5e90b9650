"""What a server embedding an `Engine` uses besides `prefill()`: its state, `is_running`,
`health()`, `drain()`, `submit_threadsafe()` and `tokenizer`.

A mixin of `Engine` (`loop.py`, which owns the fields declared here), kept apart so the engine
file stays about scheduling. Like everything in the engine these run on the event loop that
started it; `submit_threadsafe()` is the one door in from other threads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from aioprefill.affinity import LoopAffinity
from aioprefill.errors import AioprefillError
from aioprefill.health import EngineHealth, health_of
from aioprefill.tokenizer import Tokenizer

if TYPE_CHECKING:
    from aioprefill.config import EngineConfig
    from aioprefill.result import PrefillResult
    from aioprefill.scheduler import Scheduler
    from aioprefill.workers.pool import WorkerPool

__all__ = ["SERVING", "EngineControls", "State"]


class State(enum.Enum):
    NEW = "new"
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"  # drain(): admits nothing new, finishes what it accepted
    CLOSING = "closing"
    CLOSED = "closed"


SERVING = (State.RUNNING, State.DRAINING, State.CLOSING)  # workers get batches


class EngineControls:
    config: EngineConfig
    _state: State
    _affinity: LoopAffinity
    _loop: asyncio.AbstractEventLoop | None
    _sched: Scheduler
    _pool: WorkerPool
    _broken: AioprefillError | None
    _idle_waiter: asyncio.Future[None] | None
    if TYPE_CHECKING:
        prefill: Callable[..., Coroutine[Any, Any, PrefillResult]]  # Engine's

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
        return self._state is State.RUNNING and self._broken is None

    def health(self) -> EngineHealth:
        """Each worker's state (ready, busy, restarting, given up...) and `is_running`."""
        state = "broken" if self._broken is not None else self._state.value
        return health_of(state, self.is_running, self._pool.slots)

    async def drain(self) -> None:
        """Stop admitting (`prefill()` raises `EngineClosed`) and wait until every accepted
        request finished; `close()` then has nothing left to wait for."""
        self._affinity.check("drain()")
        if self._state is State.RUNNING:
            self._state = State.DRAINING
        if self._state is State.DRAINING:
            await self._idle()

    async def _idle(self) -> None:
        """Wait until no accepted request is left (one waiter shared by drain and close; the
        engine resolves it when its last request ends)."""
        if self._sched.num_in_flight:
            if self._idle_waiter is None or self._idle_waiter.done():
                assert self._loop is not None
                self._idle_waiter = self._loop.create_future()
            await asyncio.shield(self._idle_waiter)

    def submit_threadsafe(self, tokens: Any, **options: Any) -> concurrent.futures.Future[Any]:
        """`prefill(tokens, **options)` from a thread other than the engine's: returns a
        `concurrent.futures.Future` (cancel it to cancel the request)."""
        return self._affinity.submit(self.prefill(tokens, **options))
