"""`KVEventPublisher` against a real ZMQ SUB and DEALER: the frames vllm-router reads (topic,
8-byte big-endian seq, msgpack `[ts, events, 0]` with exactly the router's keys), a snapshot of
the node for a subscriber that joins, one batch per loop turn (split past `MAX_EVENTS`),
replay from a bounded ring, and sockets that close and never block."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aioprefill.errors import InvalidConfig
from aioprefill.kv_events import KVEventPublisher, default_replay_endpoint
from aioprefill.kv_events.publisher import MAX_EVENTS
from tests.kv_events.util import Subscriber, endpoints

B = 16
STORED_KEYS = [
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name",
]  # fmt: skip


def tokens(n_blocks: int, first: int = 1) -> list[int]:
    return list(range(first, first + n_blocks * B))


@pytest.fixture
def pub():
    ep, replay = endpoints()
    p = KVEventPublisher(ep, replay_endpoint=replay, block_tokens=B, ring_batches=8)
    p.start()
    yield p
    p.close()


@pytest.fixture
def sub(pub):
    s = Subscriber(pub)
    yield s
    s.close()


def test_frames_are_what_the_router_decodes(pub, sub):
    seq = sub.join(pub)
    pub.stored(0, [11, 12], None, tokens(2))
    pub.stored(0, [13], 12, tokens(1, 100))
    pub.removed(0, [13])
    pub.cleared(0)
    got = [sub.recv() for _ in range(4)]
    assert [s for _, s, _ in got] == [seq, seq + 1, seq + 2, seq + 3]
    assert all(topic == b"" for topic, _, _ in got)
    payloads = [p for _, _, p in got]
    for p in payloads:
        ts, events, rank = p
        assert isinstance(ts, float) and rank == 0 and len(events) == 1
    first = payloads[0][1][0]
    assert list(first) == STORED_KEYS
    assert first == {
        "type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
        "token_ids": tokens(2), "block_size": B, "lora_id": None, "medium": "GPU",
        "lora_name": None,
    }  # fmt: skip
    assert payloads[1][1][0]["parent_block_hash"] == 12
    assert payloads[2][1][0] == {"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"}
    assert payloads[3][1][0] == {"type": "AllBlocksCleared"}


def test_replay_serves_the_kept_batches_from_the_asked_seq(pub, sub):
    seq = sub.join(pub)
    for i in range(12):  # the ring keeps 8
        pub.stored(0, [100 + i], None if i == 0 else 99 + i, tokens(1, i))
    last = seq + 11
    got = sub.replay(last - 2)
    assert [s for s, _ in got] == [last - 2, last - 1, last]
    assert got[-1][1][1][0]["block_hashes"] == [111]
    assert [s for s, _ in sub.replay(0)] == list(range(last - 7, last + 1))  # the ring's 8
    assert sub.replay(last + 1) == []  # nothing newer: just the end marker
    assert pub.num_replays == 3


async def next_message(s: Subscriber) -> None:
    """Let the loop run (the relay hands it work) until the subscriber has a message."""
    deadline = time.monotonic() + 10
    while not s.sub.poll(0):
        assert time.monotonic() < deadline, "nothing published"
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_joining_subscriber_gets_the_node_then_one_batch_per_turn():
    ep, replay = endpoints()
    p = KVEventPublisher(ep, replay_endpoint=replay, block_tokens=B)
    p.start()
    p.stored(0, [1, 2], None, tokens(2))
    p.stored(1, [3], 2, tokens(1, 50))
    p.stored(0, [9], None, tokens(1, 90))
    await asyncio.sleep(0)  # flushed while nobody listens: a PUB drops it
    before = p.seq
    s = Subscriber(p)
    try:
        # the relay sees the subscription, the loop sends a snapshot (the first batch may
        # also reach the subscriber if it joined before the relay forwarded it)
        deadline = time.monotonic() + 10
        while p.seq == before:
            assert time.monotonic() < deadline, "no snapshot"
            await asyncio.sleep(0.01)
        got = []
        while s.sub.poll(300):
            got.append(s.recv())
        _, seq, (_, events, _) = got[-1]
        assert seq == p.seq - 1 and p.num_snapshots == 1 and p.num_subscribers == 1
        assert events[0] == {"type": "AllBlocksCleared"}
        chains = {tuple(e["block_hashes"]): e for e in events[1:]}
        assert set(chains) == {(1, 2, 3), (9,)}  # one event per unbranched stretch
        assert chains[(1, 2, 3)]["token_ids"] == tokens(2) + tokens(1, 50)
        assert chains[(1, 2, 3)]["parent_block_hash"] is None

        p.stored(0, [4], 3, tokens(1, 60))
        p.stored(1, [5], None, tokens(1, 70))
        p.removed(0, [9])  # only worker 0 held block 9: it leaves the node
        assert s.pending() == 0  # nothing sent yet: the turn has not ended
        await next_message(s)
        _, got_seq, (_, events, _) = s.recv()
        assert got_seq == seq + 1 and p.seq == seq + 2
        assert [e["type"] for e in events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    finally:
        s.close()
        p.close()


def test_a_large_flush_is_split_into_batches_the_router_takes(pub, sub):
    seq = sub.join(pub)
    for i in range(2 * MAX_EVENTS + 10):  # disjoint one-block chains
        pub.stored(0, [i + 1], None, tokens(1, i))
    assert sub.pending(expect=2 * MAX_EVENTS + 10) == 2 * MAX_EVENTS + 10
    pub.snapshot()  # AllBlocksCleared + every chain: 3 batches
    sizes = [len(sub.recv()[2][1]) for _ in range(3)]
    assert sizes == [MAX_EVENTS, MAX_EVENTS, 11] and pub.seq == seq + 2 * MAX_EVENTS + 13


def test_a_subscriber_that_never_reads_does_not_block_the_publisher(pub, sub):
    sub.join(pub)
    for i in range(20_000):  # far past both high-water marks; PUB drops, never waits
        pub.stored(0, [i + 1000], None, tokens(1, i))
    assert pub.seq > 20_000 and pub.num_dropped == 0


def test_closing_tells_subscribers_the_node_holds_nothing():
    ep, replay = endpoints()
    p = KVEventPublisher(ep, replay_endpoint=replay, block_tokens=B)
    p.start()
    s = Subscriber(p)
    try:
        s.join(p)
        p.stored(0, [1], None, tokens(1))
        p.close()
        _, _, (_, events, _) = s.recv()
        assert events[0]["type"] == "BlockStored"
        _, _, (_, events, _) = s.recv()
        assert events == [{"type": "AllBlocksCleared"}]
    finally:
        p.close()
        s.close()


def test_close_unbinds_and_stops_the_replay_thread():
    ep, replay = endpoints()
    before = threading.active_count()
    for _ in range(2):  # the same endpoints bind again after close
        p = KVEventPublisher(ep, replay_endpoint=replay)
        p.start()
        assert threading.active_count() == before + 1
        p.close()
        p.close()  # idempotent
        assert threading.active_count() == before


def test_a_taken_endpoint_is_a_config_error_naming_it():
    ep, replay = endpoints()
    first = KVEventPublisher(ep, replay_endpoint=replay)
    first.start()
    try:
        second = KVEventPublisher(ep, replay_endpoint=endpoints()[1])
        with pytest.raises(InvalidConfig, match="kv_events_endpoint: cannot bind tcp://127"):
            second.start()
        second.close()
    finally:
        first.close()


def test_replay_endpoint_rule():
    assert default_replay_endpoint("tcp://127.0.0.1:5557") == "tcp://127.0.0.1:5558"
    assert KVEventPublisher("tcp://h:7000").replay_endpoint == "tcp://h:7001"
