"""`Relay`: the thread that owns a publisher's network sockets.

The engine's loop never touches a TCP socket: it hands each encoded batch to this thread over
an inproc PAIR (a `NOBLOCK` send into a memory pipe). The thread sleeps in `zmq.Poller.poll`
until one of three sockets has something:

- the inbox (the loop's batches, or a one-frame stop): forwarded to the XPUB socket, `NOBLOCK`
  (a PUB drops for a slow subscriber rather than wait; the replay covers what it dropped);
- the XPUB socket: a subscriber joined (a subscription message, `XPUB_VERBOSE` so every
  subscriber's counts); the thread asks the loop (`on_subscriber`, thread-safe) to publish a
  snapshot, so a router that (re)starts learns every block the node already holds;
- the ROUTER socket: a replay request `[identity, b"", start_seq]`, answered from the
  `BatchRing` with every batch kept from `start_seq` on, then `seq` -1.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from aioprefill.kv_events.wire import END_SEQ, TOPIC, seq_bytes

__all__ = ["BatchRing", "Relay"]

STOP = b"stop"  # a one-frame inbox message; batches are two frames


class BatchRing:
    """The last `capacity` (seq, payload) batches: appended by the loop, read by the relay
    thread, under a lock held only to append or copy."""

    def __init__(self, capacity: int) -> None:
        self._items: deque[tuple[int, bytes]] = deque(maxlen=capacity)
        self._lock = threading.Lock()

    def append(self, seq: int, payload: bytes) -> None:
        with self._lock:
            self._items.append((seq, payload))

    def since(self, start: int) -> list[tuple[int, bytes]]:
        with self._lock:
            return [item for item in self._items if item[0] >= start]


class Relay(threading.Thread):
    """Owns `xpub`, `replay` and `inbox` (bound by the caller, then handed over: a thread's
    start is a full memory barrier, which ZMQ asks of a socket changing threads)."""

    def __init__(
        self,
        zmq: Any,
        xpub: Any,
        replay: Any,
        inbox: Any,
        ring: BatchRing,
        on_subscriber: Callable[[], None],
    ) -> None:
        super().__init__(name="kv-events-relay", daemon=True)
        self.zmq, self.xpub, self.replay, self.inbox = zmq, xpub, replay, inbox
        self.ring = ring
        self.on_subscriber = on_subscriber
        self.num_dropped = 0  # batches the XPUB refused (none expected: PUB drops itself)
        self.num_replays = 0
        self.num_subscribers = 0  # subscriptions seen

    def run(self) -> None:
        zmq = self.zmq
        poller = zmq.Poller()
        for sock in (self.inbox, self.xpub, self.replay):
            poller.register(sock, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self.inbox in ready and not self._forward():
                    return
                if self.xpub in ready:
                    self._subscriptions()
                if self.replay in ready:
                    self._replays()
        finally:
            self.xpub.setsockopt(zmq.LINGER, 100)  # the last batches may still leave
            for sock in (self.inbox, self.xpub, self.replay):
                sock.close()

    def _forward(self) -> bool:
        """Publish every batch waiting in the inbox; False on the stop message."""
        zmq = self.zmq
        while True:
            try:
                frames = self.inbox.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if len(frames) == 1:
                return False
            try:
                self.xpub.send_multipart([TOPIC, *frames], zmq.NOBLOCK)
            except zmq.Again:
                self.num_dropped += 1

    def _subscriptions(self) -> None:
        zmq = self.zmq
        joined = False
        while True:
            try:
                msg = self.xpub.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if msg[:1] == b"\x01":
                self.num_subscribers += 1
                joined = True
        if joined:
            self.on_subscriber()

    def _replays(self) -> None:
        zmq = self.zmq
        send = self.replay.send_multipart
        while True:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = frames[0]
            start = int.from_bytes(frames[-1], "big", signed=True) if len(frames) > 1 else 0
            self.num_replays += 1
            for seq, payload in self.ring.since(start):
                send([identity, b"", TOPIC, seq_bytes(seq), payload])
            send([identity, b"", TOPIC, seq_bytes(END_SEQ), b""])
