"""`Channel`: one ring plus its two eventfds, the one-way unit that crosses a process boundary.

The producer writes a frame into the ring, then writes the *data* eventfd ("frames
available"). The consumer reads and releases frames, and writes the *space* eventfd after
every `release()` ("space freed"); a producer that found the ring full awaits that. Writing
the space eventfd unconditionally is the simplest race-free choice: a "producer is waiting"
flag in shared memory would need a StoreLoad fence between storing the flag and re-checking
tail (store then load to different lines may reorder even on x86-64), which Python cannot
issue. It costs the consumer one write(2) per frame, and the producer wakes only when it
actually waits (its notifier is registered with the loop only while waiting).

`ChannelSpec` names the ring; the two eventfds travel separately (pass_fds / DupFd), and
`Channel.attach` takes ownership of them.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from aioprefill.errors import ProtocolError
from aioprefill.shm.notify import Notifier
from aioprefill.shm.ring import Ring

__all__ = ["Channel", "ChannelSpec"]


class ChannelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What another process needs, besides the two fds, to attach to a channel."""

    ring: str
    capacity: int


class Channel:
    """A one-way frame channel: producer side (`send*`) or consumer side (`recv*`, `release`)."""

    # Class-level defaults: close() and unlink() are safe after a failed __init__.
    ring: Ring | None = None
    data: Notifier | None = None
    space: Notifier | None = None

    def __init__(self, ring: Ring, data: Notifier, space: Notifier) -> None:
        """Assemble from parts (owned from now on); use `create` / `attach` instead."""
        self.ring = ring
        self.data = data
        self.space = space
        self.spec = ChannelSpec(ring=ring.name, capacity=ring.capacity)
        self.max_frame = ring.max_frame

    @classmethod
    def create(cls, capacity: int, tag: str = "ch") -> Channel:
        """Create a ring (see `Ring.create`) and its data and space eventfds."""
        ring = Ring.create(capacity, tag=tag)
        data = space = None
        try:
            data = Notifier()
            space = Notifier()
            return cls(ring, data, space)
        except BaseException:
            for n in (data, space):
                if n is not None:
                    n.close()
            ring.close()
            ring.unlink()
            raise

    @classmethod
    def attach(cls, spec: ChannelSpec, data_fd: int, space_fd: int) -> Channel:
        """Attach in another process; takes ownership of both fds (closed by `close()`)."""
        data = space = ring = None
        try:
            data = Notifier(fd=data_fd)
            space = Notifier(fd=space_fd)
            ring = Ring.attach(spec.ring)
            if ring.capacity != spec.capacity:
                raise ProtocolError(
                    f"ring {spec.ring!r} has capacity {ring.capacity}, spec says {spec.capacity}"
                )
            return cls(ring, data, space)
        except BaseException:
            for part in (ring, data, space):
                if part is not None:
                    part.close()
            raise

    def fds(self) -> tuple[int, int]:
        """(data_fd, space_fd), to hand to the other process (it gets duplicates)."""
        data, space = self._parts()[1:]
        return data.fileno(), space.fileno()

    def _parts(self) -> tuple[Ring, Notifier, Notifier]:
        ring, data, space = self.ring, self.data, self.space
        if ring is None or data is None or space is None:
            raise RuntimeError("channel was not initialised")
        return ring, data, space

    # ---- producer ------------------------------------------------------------------------

    def send_nowait(self, *parts: Any) -> bool:
        """Write one frame (the parts concatenated) and wake the consumer; False when full.

        Raises `FrameTooLarge` when the frame exceeds `max_frame` (nothing is written).
        """
        ring, data, _ = self._parts()
        if ring.try_write(*parts):
            data.notify()
            return True
        return False

    def has_room(self, nbytes: int) -> bool:
        """Whether `send_nowait` of a frame of `nbytes` would succeed now."""
        return self._parts()[0].has_room(nbytes)

    async def send(self, *parts: Any) -> None:
        """Write one frame, awaiting space if the ring is full (never spins)."""
        _, _, space = self._parts()
        while not self.send_nowait(*parts):
            await space.wait_async()

    def send_blocking(self, *parts: Any, timeout: float | None = None) -> bool:
        """Write one frame, blocking while the ring is full; False if `timeout` passed first."""
        _, _, space = self._parts()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.send_nowait(*parts):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            space.wait(left)
        return True

    # ---- consumer ------------------------------------------------------------------------

    def recv_nowait(self) -> memoryview | None:
        """The next frame as a zero-copy view (valid until `release()`), or None if empty."""
        return self._parts()[0].try_read()

    def release(self) -> None:
        """Free the frame from `recv_nowait()` and tell the producer space was freed."""
        ring, _, space = self._parts()
        ring.release()
        space.notify()

    async def wait_async(self) -> int:
        """Await the producer's next notification (frames may already be waiting: check first)."""
        return await self._parts()[1].wait_async()

    def wait_blocking(self, timeout: float | None = None) -> bool:
        """Block until the producer notifies or `timeout` passes (False)."""
        return self._parts()[1].wait(timeout)

    async def recv(self) -> memoryview:
        """The next frame, awaiting one if the ring is empty. Call `release()` when done."""
        while True:
            view = self.recv_nowait()
            if view is not None:
                return view
            await self.wait_async()

    def recv_blocking(self, timeout: float | None = None) -> memoryview | None:
        """The next frame, blocking up to `timeout` seconds for one; None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            view = self.recv_nowait()
            if view is not None:
                return view
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self.wait_blocking(left)

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Wake waiters (`NotifierClosed`), close both eventfds, unmap the ring. Idempotent."""
        for n in (self.data, self.space):
            if n is not None:
                n.close()
        if self.ring is not None:
            self.ring.close()

    def unlink(self) -> None:
        """Remove the ring's segment (creator only; a no-op when attached)."""
        if self.ring is not None:
            self.ring.unlink()

    @property
    def closed(self) -> bool:
        return self.ring is None or self.ring.closed

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        return f"<Channel {self.ring!r}>"
