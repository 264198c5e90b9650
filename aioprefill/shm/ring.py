"""A single-producer single-consumer byte ring in a shared-memory segment.

One process writes frames (`try_write`), one other process reads them (`try_read`, then
`release`). Frames are variable-length and contiguous, so a reader gets a zero-copy
`memoryview` of each payload. The ring never blocks and never wakes anyone: `Channel` pairs
it with eventfds for that, and those syscalls are also what orders the stores (below).

Byte layout (all integers native little-endian; offsets in bytes from the segment start)::

    0    header, one 64-byte line, written once by the creator before anyone attaches
         +0   magic     8 bytes  b"AIOPRING"
         +8   version   u32      1
         +12  data_off  u32      256 (where the data region starts)
         +16  capacity  u64      size of the data region: a power of two, 64 .. 2**40
         +24  owner     u64      pid of the creating process (informational)
         +32  reserved, zero
    64   head  u64   total bytes ever published by the producer; written ONLY by the producer
    128  tail  u64   total bytes ever released by the consumer; written ONLY by the consumer
    192  unused line: keeps `tail` and the data start out of one 128-byte prefetch pair
    256  data region, `capacity` bytes; a byte counter `c` lives at data[c % capacity]

    head and tail are monotonic 64-bit byte counters (never reset, so the ring is empty iff
    head == tail and full iff head - tail == capacity; 2**64 bytes is ~58 years at 10 GB/s).
    Both are multiples of 8 and 0 <= head - tail <= capacity; they sit on separate cache
    lines so producer and consumer never write the same line.

    A frame at data offset `o` (8-aligned) is a u64 prefix then the payload:
        prefix = payload length n (n <= max_frame)      frame size 8 + round_up(n, 8)
        prefix = 0xFFFF_FFFF_FFFF_FFFF (WRAP)            skip to offset 0: the next frame did
                                                         not fit before the end
    A frame never straddles the end of the data region. The producer writes a WRAP marker and
    the frame after it in one `try_write`, publishing head once past both.

    max_frame = capacity / 2 - 8. Any frame that size or smaller fits, wrap marker included,
    in an empty ring whatever the offset, so a waiting producer always makes progress.

Ordering: the producer stores the frame, then head (one aligned 8-byte store), then writes
the consumer's eventfd (the release); the consumer reads its eventfd (the acquire), then head,
the frame, and stores tail. x86-64 only; the package docstring says why, and what is trusted.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any

from aioprefill.errors import AioprefillError, FrameTooLarge, ProtocolError
from aioprefill.shm.segments import attach_segment, create_segment, segment_name, unlink_segment

__all__ = ["DATA_OFFSET", "MAX_CAPACITY", "MIN_CAPACITY", "Ring", "RingClosed"]

MAGIC = b"AIOPRING"
VERSION = 1
DATA_OFFSET = 256
MIN_CAPACITY = 64
MAX_CAPACITY = 1 << 40
WRAP = 0xFFFF_FFFF_FFFF_FFFF
_CAPACITY = 2  # u64 word indexes into the control area
_OWNER = 3
_HEAD = 8
_TAIL = 16


class RingClosed(AioprefillError, ValueError):
    """The ring (or channel) was closed in this process; it cannot be used again."""


def _align8(n: int) -> int:
    return (n + 7) & ~7


class Ring:
    """Single-producer single-consumer frame ring in shared memory (layout: module docstring).

    Create with `Ring.create` (the owner, which alone unlinks) or `Ring.attach` (another
    process). Each process uses a ring in one role: producer (`try_write`) or consumer
    (`try_read` / `release`).
    """

    # Class-level defaults: close() and unlink() are safe after a failed __init__.
    _mmap: mmap.mmap | None = None
    _buf: memoryview | None = None
    _ctrl: memoryview | None = None
    _data: memoryview | None = None
    _words: memoryview | None = None
    _view: memoryview | None = None
    _name: str = ""
    _owner: bool = False
    _unlinked: bool = False
    capacity: int = 0
    max_frame: int = 0

    def __init__(self, name: str, mm: mmap.mmap, *, owner: bool) -> None:
        """Wrap a mapped segment; use `Ring.create` / `Ring.attach` instead."""
        self._name = name
        self._owner = owner
        self._mmap = mm
        try:
            self._setup(mm)
        except BaseException:
            self.close()
            raise

    def _setup(self, mm: mmap.mmap) -> None:
        name = self._name
        buf = self._buf = memoryview(mm)
        if len(buf) < DATA_OFFSET:
            raise ProtocolError(f"ring segment {name!r} is {len(buf)} bytes, too small")
        ctrl = self._ctrl = buf[:DATA_OFFSET].cast("Q")
        if bytes(buf[:8]) != MAGIC:
            raise ProtocolError(f"ring segment {name!r} has a bad magic {bytes(buf[:8])!r}")
        version, data_off = buf[8:16].cast("I")
        if version != VERSION or data_off != DATA_OFFSET:
            raise ProtocolError(f"ring {name!r}: version {version}, data offset {data_off}")
        cap = ctrl[_CAPACITY]
        if not MIN_CAPACITY <= cap <= MAX_CAPACITY or cap & (cap - 1):
            raise ProtocolError(f"ring {name!r}: capacity {cap} is not a power of two in range")
        if DATA_OFFSET + cap > len(buf):
            raise ProtocolError(f"ring {name!r}: capacity {cap} exceeds the segment")
        self.capacity = cap
        self.max_frame = cap // 2 - 8
        self._mask = cap - 1
        self._data = buf[DATA_OFFSET : DATA_OFFSET + cap]
        self._words = self._data.cast("Q")
        head, tail = ctrl[_HEAD], ctrl[_TAIL]
        if (head | tail) & 7 or tail > head or head - tail > cap:
            raise ProtocolError(f"ring {name!r}: corrupt counters head={head} tail={tail}")
        # Private copies: each side trusts only its own counter, checks the other's.
        self._head = head  # producer: next publish position
        self._tail = tail  # consumer: current read position
        self._seen_head = head  # consumer: last head loaded (and checked)
        self._seen_tail = tail  # producer: last tail loaded (and checked)
        self._next_tail = tail

    @classmethod
    def create(cls, capacity: int, tag: str = "ring") -> Ring:
        """Create a new ring with `capacity` data bytes (a power of two, 64 .. 2**40).

        The segment gets a random name with this pid inside, mode 0600, and every page is
        touched now. The creator is the owner: it alone unlinks.
        """
        if not isinstance(capacity, int) or isinstance(capacity, bool):
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}")
        if not MIN_CAPACITY <= capacity <= MAX_CAPACITY or capacity & (capacity - 1):
            raise ValueError(f"capacity must be a power of two in [64, 2**40], got {capacity}")
        name = segment_name(tag)
        mm = create_segment(name, DATA_OFFSET + capacity)
        try:
            buf = memoryview(mm)
            words = buf[:DATA_OFFSET].cast("Q")
            buf[0:8] = MAGIC
            words[1] = VERSION | (DATA_OFFSET << 32)  # u32 version at +8, u32 data_off at +12
            words[_CAPACITY] = capacity
            words[_OWNER] = os.getpid()
            words.release()
            buf.release()
            return cls(name, mm, owner=True)
        except BaseException:
            mm.close()
            unlink_segment(name)
            raise

    @classmethod
    def attach(cls, name: str) -> Ring:
        """Map an existing ring by name, validating its header; never registers it with the
        resource tracker, so the creator's registration (its cleanup if SIGKILLed) stands."""
        mm = attach_segment(name)
        try:
            return cls(name, mm, owner=False)
        except BaseException:
            mm.close()
            raise

    @property
    def name(self) -> str:
        """The segment name (without the leading slash), what `attach` takes."""
        return self._name

    @property
    def closed(self) -> bool:
        return self._data is None

    # ---- producer ------------------------------------------------------------------------

    def try_write(self, *parts: Any) -> bool:
        """Publish one frame, the concatenation of `parts` (bytes-like, C-contiguous).

        Returns False, writing nothing, when there is no room now. Raises `FrameTooLarge`
        (before writing anything) when the frame exceeds `max_frame` and can never fit.
        """
        data = self._data
        words = self._words
        if data is None or words is None:
            raise RingClosed(f"ring {self._name!r} is closed")
        views = [memoryview(p).cast("B") for p in parts]
        n = 0
        for v in views:
            n += v.nbytes
        if n > self.max_frame:
            raise FrameTooLarge(f"frame of {n} bytes exceeds max_frame {self.max_frame}")
        cap = self.capacity
        head = self._head
        off = head & self._mask
        size = 8 + _align8(n)
        need = size if off + size <= cap else cap - off + size
        if need > cap - (head - self._seen_tail):
            self._load_tail()
            if need > cap - (head - self._seen_tail):
                return False
        if off + size > cap:
            words[off >> 3] = WRAP
            off = 0
        words[off >> 3] = n
        pos = off + 8
        for v in views:
            end = pos + v.nbytes
            data[pos:end] = v
            pos = end
        head += need
        self._head = head
        self._ctrl[_HEAD] = head  # type: ignore[index]  # publish: one aligned 8-byte store
        return True

    def has_room(self, n: int) -> bool:
        """Whether a frame of `n` payload bytes would fit now (what `try_write` checks)."""
        cap = self.capacity
        off = self._head & self._mask
        size = 8 + _align8(n)
        need = size if off + size <= cap else cap - off + size
        if need > cap - (self._head - self._seen_tail):
            self._load_tail()
        return n <= self.max_frame and need <= cap - (self._head - self._seen_tail)

    def _load_tail(self) -> None:
        tail = self._ctrl[_TAIL]  # type: ignore[index]
        if tail & 7 or tail < self._seen_tail or tail > self._head:
            raise ProtocolError(
                f"ring {self._name!r}: tail {tail} outside [{self._seen_tail}, {self._head}]"
            )
        self._seen_tail = tail

    # ---- consumer ------------------------------------------------------------------------

    def try_read(self) -> memoryview | None:
        """The next frame's payload as a zero-copy view, or None when the ring is empty.

        The view stays valid until `release()`, which frees the frame and releases the view.
        Calling `try_read()` again before `release()` returns the same frame again. Raises
        `ProtocolError` when the ring's counters or the frame prefix are corrupt.
        """
        words = self._words
        data = self._data
        if data is None or words is None:
            raise RingClosed(f"ring {self._name!r} is closed")
        if self._view is not None:
            self._view.release()
            self._view = None
        tail = self._tail
        head = self._seen_head
        if head == tail:
            head = self._ctrl[_HEAD]  # type: ignore[index]
            if head == tail:
                return None
            if head & 7 or head < self._seen_head or head - tail > self.capacity:
                raise ProtocolError(
                    f"ring {self._name!r}: head {head} with tail {tail}, "
                    f"capacity {self.capacity}, last head {self._seen_head}"
                )
            self._seen_head = head
        avail = head - tail
        cap = self.capacity
        off = tail & self._mask
        n = words[off >> 3]
        skip = 0
        if n == WRAP:
            skip = cap - off
            if skip >= avail:
                raise ProtocolError(f"ring {self._name!r}: wrap marker with no frame after it")
            off = 0
            n = words[0]
        if n > self.max_frame:
            raise ProtocolError(f"ring {self._name!r}: frame length {n} > max {self.max_frame}")
        size = 8 + _align8(n)
        if skip + size > avail or off + size > cap:
            raise ProtocolError(
                f"ring {self._name!r}: frame of {n} bytes at {off} overruns the "
                f"{avail} published bytes"
            )
        view = self._view = data[off + 8 : off + 8 + n]
        self._next_tail = tail + skip + size
        return view

    def release(self) -> None:
        """Free the frame returned by `try_read()` and release its view."""
        view = self._view
        if view is None:
            raise RuntimeError("release() without a frame from try_read()")
        try:
            view.release()
        except BufferError as exc:
            raise BufferError(
                "a buffer exported from the frame view is still alive (np.frombuffer?): "
                "copy it out or drop it before release()"
            ) from exc
        self._view = None
        tail = self._tail = self._next_tail
        self._ctrl[_TAIL] = tail  # type: ignore[index]

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Unmap the segment in this process (idempotent). Does not unlink it.

        If the caller still holds a view derived from a frame, the mapping stays alive until
        that view is released or collected; nothing else in the ring is usable.
        """
        for attr in ("_view", "_words", "_data", "_ctrl", "_buf"):
            view = getattr(self, attr)
            if view is not None:
                setattr(self, attr, None)
                # An export of a frame view may be alive: the mapping then outlives it.
                with contextlib.suppress(BufferError):
                    view.release()
        mm = self._mmap
        if mm is not None:
            self._mmap = None
            # A caller's view may still point in: the mapping goes when that view goes.
            with contextlib.suppress(BufferError):
                mm.close()

    def unlink(self) -> None:
        """Remove the segment name (creator only; a no-op for attached rings, idempotent)."""
        if self._owner and not self._unlinked and self._name:
            self._unlinked = True
            unlink_segment(self._name)

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.unlink()

    def __repr__(self) -> str:
        role = "owner" if self._owner else "attached"
        state = "closed" if self.closed else f"capacity={self.capacity}"
        return f"<Ring {self._name!r} {role} {state}>"
