"""Loop affinity: an engine belongs to the event loop (and so the thread) that started it.

Every piece of scheduling state is touched only from that loop's callbacks, which is why the
engine needs no locks. A coroutine awaited on another loop (a second `asyncio.run()`, a thread
running its own loop) would queue a request from the wrong thread, and resolve futures of a
loop that may be closed: `check()` refuses it with `WrongLoop` before anything is queued.
Sync threads hand their request to the engine's loop with `submit()`
(`engine.submit_threadsafe()`), which returns a `concurrent.futures.Future`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from aioprefill.errors import EngineClosed, WrongLoop

__all__ = ["LoopAffinity"]

T = TypeVar("T")


class LoopAffinity:
    """The loop and thread an engine was started on, and the checks against them."""

    __slots__ = ("loop", "thread_id")

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread_id = 0

    def bind(self) -> asyncio.AbstractEventLoop:
        """Called from `start()`: this running loop, in this thread, owns the engine."""
        self.loop = asyncio.get_running_loop()
        self.thread_id = threading.get_ident()
        return self.loop

    def check(self, what: str) -> None:
        """Raise `WrongLoop` unless the caller runs on the engine's loop, in its thread."""
        loop = self.loop
        if loop is None:
            return  # not started yet: the state check says so
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop and threading.get_ident() == self.thread_id:
            return
        if loop.is_closed():
            why = "that loop is closed (was the engine started in another asyncio.run()?)"
        elif threading.get_ident() != self.thread_id:
            why = "it was called from another thread"
        else:
            why = "it was called from another event loop"
        raise WrongLoop(
            f"{what}: the engine belongs to the event loop that started it, and {why}; "
            "await it on that loop, or use engine.submit_threadsafe() from other threads"
        )

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the engine's loop from another thread; return its future."""
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running():
            coro.close()
            raise EngineClosed("engine is not running: start it before submitting")
        if threading.get_ident() == self.thread_id:
            coro.close()  # blocking on the future here would deadlock the loop
            raise WrongLoop(
                "submit_threadsafe() was called on the engine's own loop thread: "
                "await engine.prefill() there instead"
            )
        return asyncio.run_coroutine_threadsafe(coro, loop)
