"""A real ZMQ subscriber (SUB for the stream, DEALER for a replay) for the publisher's tests."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

from aioprefill.kv_events import KVEventPublisher
from tests.serve.util import free_port


def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


class Subscriber:
    """Connects like vllm-router: SUB on the stream (every topic), DEALER for replays."""

    def __init__(self, pub: KVEventPublisher) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub.endpoint)
        self.replay_endpoint = pub.replay_endpoint

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()

    def recv(self, timeout_ms: int = 5000) -> tuple[bytes, int, Any]:
        """One message: (topic, seq, payload decoded as plain msgpack: lists and dicts)."""
        if not self.sub.poll(timeout_ms):
            raise TimeoutError("no KV event batch arrived")
        topic, seq, payload = self.sub.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big", signed=True), msgspec.msgpack.decode(payload)

    def pending(self, expect: int = 0, timeout: float = 10.0) -> int:
        """How many messages arrive: those already here, waiting up to `timeout` s while fewer
        than `expect` came (ZMQ's I/O thread delivers what a PUB sent a moment later: a
        fresh-clone run once counted 1,131 of 2,058 without waiting)."""
        n, deadline = 0, time.monotonic() + timeout
        while True:
            wait = max(0.0, deadline - time.monotonic()) if n < expect else 0.0
            if not self.sub.poll(int(wait * 1000)):
                return n
            self.sub.recv_multipart()
            n += 1

    def join(self, pub: KVEventPublisher, flush: Any = None) -> int:
        """Wait until the SUB gets messages (a PUB drops what it sends before a subscriber
        has joined): publish `AllBlocksCleared` (worker 999 of an empty node) until one
        arrives; return the next seq."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pub.cleared(999)
            if flush is not None:
                flush()
            if self.sub.poll(20):
                last = -1
                while self.sub.poll(50):
                    _, last, _ = self.recv()
                return last + 1
        raise TimeoutError("the subscriber never joined")

    def replay(self, start: int, timeout_ms: int = 5000) -> list[tuple[int, Any]]:
        """Ask the replay socket for batches from `start`, as the router does."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            got = []
            while True:
                if not dealer.poll(timeout_ms):
                    raise TimeoutError("the replay did not end")
                empty, topic, seq_b, payload = dealer.recv_multipart()
                assert empty == b"" and topic == b""
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == -1:
                    return got
                got.append((seq, msgspec.msgpack.decode(payload)))
        finally:
            dealer.close()
