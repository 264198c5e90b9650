"""Shared-memory transport: SPSC byte rings, eventfd notifiers, and the channels built of both.

See `ring.py` for the byte layout, `channel.py` for the wake-up protocol.

Ordering. Producer: write the frame bytes, then store head (one aligned 8-byte store, via a
'Q'-cast memoryview: atomic on x86-64; `struct.pack_into("<Q")` writes byte by byte and
could be read torn), then `eventfd_write` to the consumer's data eventfd; that syscall is the
release. Consumer: `eventfd_read` (the acquire), then load head, then read the frame, then
store tail, then `eventfd_write` to the producer's space eventfd. Between syscalls a
consumer that re-reads head (draining several frames per wake-up) relies on x86-64 TSO: stores
become visible in program order and loads are not reordered with older loads, so a head it
sees implies the frame bytes before it are visible. A weakly ordered CPU (arm64) would need
explicit acquire/release fences there, which Python cannot issue; only x86-64 is supported.

Trust. Every offset and length read from shared memory is checked before use: a corrupt
header, a lying length, head < tail or head - tail > capacity raises `ProtocolError`, never an
out-of-bounds read, a hang or a crash. (A peer that shrinks the segment with ftruncate could
still SIGBUS us; peers are processes of the same user, so this is not defended against.)
"""

from aioprefill.shm.channel import Channel, ChannelSpec
from aioprefill.shm.notify import Notifier, NotifierClosed
from aioprefill.shm.ring import Ring, RingClosed
from aioprefill.shm.segments import cleanup_stale_segments

__all__ = [
    "Channel",
    "ChannelSpec",
    "Notifier",
    "NotifierClosed",
    "Ring",
    "RingClosed",
    "cleanup_stale_segments",
]
