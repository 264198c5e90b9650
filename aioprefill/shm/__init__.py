"""Shared-memory transport: SPSC byte rings, eventfd notifiers, and the channels built of both.

See `ring.py` for the byte layout and memory ordering, `channel.py` for the wake-up protocol.
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
