"""`Notifier`: an eventfd used as a wake-up counter between two processes.

`notify()` adds one to the counter; a waiter returns once the counter is non-zero and resets
it (`drain`). Because the counter is level-triggered and remembers notifications made while
nobody waited, a "check the ring, then wait" loop cannot miss a wake-up. The eventfd syscalls
are also the memory barriers that order the ring's stores (see `ring.py`).

Workers block in `wait()` (poll(2), no busy loop); the engine awaits `wait_async()` on its
event loop. The reader is registered with the loop only while a waiter awaits, so a notifier
nobody waits on never wakes the loop. `close()` wakes every awaiting waiter with
`NotifierClosed` before the fd is closed, so no waiter is left on a dead (or reused) fd.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import time

from aioprefill.errors import AioprefillError

__all__ = ["Notifier", "NotifierClosed"]


class NotifierClosed(AioprefillError):
    """The notifier was closed (in this process) while waiting or before use."""


class Notifier:
    """A non-blocking, close-on-exec eventfd: `notify`, `drain`, `wait`, `wait_async`.

    `Notifier()` creates one; `Notifier(fd=...)` takes ownership of an eventfd received from
    another process (made non-blocking and close-on-exec here) and closes it in `close()`.
    """

    _fd: int = -1  # class-level default: close() is safe after a failed __init__
    _poll: select.poll | None = None
    _waiters: set[asyncio.Future[None]] | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def __init__(self, fd: int | None = None) -> None:
        if fd is None:
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
                raise ValueError(f"fd must be a non-negative int, got {fd!r}")
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        self._fd = fd
        self._waiters = set()

    def fileno(self) -> int:
        """The eventfd's file descriptor (-1 once closed)."""
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def _check(self) -> int:
        fd = self._fd
        if fd < 0:
            raise NotifierClosed("notifier is closed")
        return fd

    def notify(self) -> None:
        """Add one to the counter, waking the peer if it waits."""
        os.eventfd_write(self._check(), 1)

    def drain(self) -> int:
        """Reset the counter without blocking; returns the notifications collected (0 if none)."""
        try:
            return os.eventfd_read(self._check())
        except BlockingIOError:
            return 0

    def wait(self, timeout: float | None = None) -> bool:
        """Block until notified (then drain) or `timeout` seconds pass; False on timeout.

        For worker processes. Sleeps in poll(2): no CPU is used while waiting.
        """
        fd = self._check()
        if timeout is not None and timeout <= 0:
            return self.drain() > 0
        # Straight to poll(2): it returns at once if the counter is already non-zero, and a
        # waiting worker saves the read(2) that would fail with EAGAIN.
        poller = self._poll
        if poller is None:
            poller = self._poll = select.poll()
            poller.register(fd, select.POLLIN)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is None:
                ms = -1
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                ms = max(1, int(left * 1000 + 0.999))  # round up: never wake early
            poller.poll(ms)
            if self.drain():
                return True

    async def wait_async(self) -> int:
        """Await a notification on the running loop, then drain; returns the count drained.

        Raises `NotifierClosed` if the notifier is, or gets, closed while waiting.
        """
        fd = self._check()
        n = self.drain()
        if n:
            return n
        loop = asyncio.get_running_loop()
        waiters = self._waiters
        if waiters is None:
            raise NotifierClosed("notifier is closed")
        while True:
            fut: asyncio.Future[None] = loop.create_future()
            if not waiters:
                loop.add_reader(fd, self._on_readable)
                self._loop = loop
            elif self._loop is not loop:
                raise RuntimeError("Notifier.wait_async() awaited from two event loops")
            waiters.add(fut)
            try:
                await fut
            finally:
                waiters.discard(fut)
                if not waiters and self._fd >= 0 and not loop.is_closed():
                    loop.remove_reader(fd)
                    self._loop = None
            n = self.drain()  # raises NotifierClosed if close() woke us
            if n:
                return n

    def _on_readable(self) -> None:
        for fut in self._waiters or ():
            if not fut.done():
                fut.set_result(None)

    def close(self) -> None:
        """Wake awaiting waiters with `NotifierClosed`, then close the fd (idempotent)."""
        fd = self._fd
        if fd < 0:
            return
        self._fd = -1  # woken waiters see this and raise NotifierClosed
        waiters = self._waiters or set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        loop = self._loop
        if loop is not None and waiters:
            with contextlib.suppress(RuntimeError):  # the loop is closed already
                if not loop.is_closed():
                    loop.remove_reader(fd)
        self._loop = None
        waiters.clear()
        if self._poll is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._poll.unregister(fd)
            self._poll = None
        os.close(fd)

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Notifier fd={self._fd}>"
