"""The store directory (`KVStoreOptions.peer_events`): a worker learns from the nodes' KV events
which chains the store holds and asks it only for those; a chain nobody announced costs no
call; the directory is bounded and skips what is not an event batch. Against real ZMQ sockets
(a node's `KVEventPublisher`) and a real `mooncake_master`."""

from __future__ import annotations

import time

import pytest

from aioprefill.kv_events import KVEventPublisher
from aioprefill.kv_events.wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
)
from aioprefill.kvstore.directory import StoreDirectory
from aioprefill.kvstore.master import LocalMaster
from tests.kv_events.util import endpoints
from tests.kvstore.util import B, Blocks, drain, need_store, tier


def test_known_prefix_counts_the_announced_head_of_a_chain():
    d = StoreDirectory((), capacity=10)
    d.add([1, 2, 3])
    assert d.known_prefix([1, 2, 3, 4]) == 3
    assert d.known_prefix([2, 1]) == 2
    assert d.known_prefix([9, 1, 2]) == 0  # a chain whose head nobody announced
    assert d.known_prefix([]) == 0
    d.add([-1])  # the engine's hashes as signed ints: the events' unsigned 64-bit
    assert d.known_prefix([(1 << 64) - 1]) == 1


def test_the_directory_keeps_the_most_recently_announced():
    d = StoreDirectory((), capacity=3)
    d.add([1, 2, 3])
    d.add([1])  # announced again: the most recent now
    d.add([4])  # 2 is the oldest: dropped
    assert len(d) == 3
    assert d.known_prefix([2]) == 0 and d.known_prefix([1]) == 1 and d.known_prefix([4]) == 1


def test_event_batches_are_applied_and_anything_else_refused():
    d = StoreDirectory((), capacity=100)
    stored = BlockStored([11, 12], None, list(range(2 * B)), B, medium="GPU")
    backed = BlockStored([13], 12, list(range(B)), B, medium="CPU")
    batch = EventBatch(0.0, [AllBlocksCleared(), stored, BlockRemoved([11]), backed], 0)
    assert d.apply(encode_batch(batch))
    # Removals are not applied: a node's caches dropping a block leave it in the store.
    assert d.known_prefix([11, 12, 13]) == 3
    assert not d.apply(b"\x93not a batch")
    assert not d.apply(encode_batch(EventBatch(0.0, [], 0))[:-1] + b"\xc1")
    assert (d.num_batches, d.num_refused) == (1, 2)


def test_the_directory_learns_what_a_node_publishes():
    ep, replay = endpoints()
    pub = KVEventPublisher(ep, replay_endpoint=replay, block_tokens=B)
    pub.start()  # outside a loop: every call sends at once
    d = StoreDirectory((ep,), capacity=100)
    d.start()
    try:
        # A PUB drops what it sends before a subscriber joined: announce until one arrives.
        deadline = time.monotonic() + 10
        while d.num_batches == 0:
            assert time.monotonic() < deadline, "the directory never got a batch"
            pub.cleared(999)
            time.sleep(0.02)  # (a test waiting on another thread's socket, not a hot path)
        pub.stored(0, [21, 22], None, list(range(2 * B)))
        while d.known_prefix([21, 22]) < 2:
            assert time.monotonic() < deadline, "the announced blocks never arrived"
            time.sleep(0.01)
    finally:
        d.close()
        pub.close()
    assert d.num_refused == 0


@pytest.fixture(scope="module")
def master():
    need_store()
    m = LocalMaster().start()
    try:
        yield m
    finally:
        m.stop()


def test_a_worker_asks_the_store_only_for_announced_chains(master):
    nowhere, _ = endpoints()  # a peer that never comes up: the directory stays as added
    writer = tier(master.address)
    reader = tier(master.address, peer_events=(nowhere,))
    try:
        blocks = Blocks(5, seed=7)
        assert blocks.offer_all(writer) == 5
        drain(writer)
        assert reader.directory is not None
        calls = reader.stats.loads
        assert blocks.load(reader)[0] == 0  # in the store, but nobody said so: no call
        assert reader.stats.loads == calls and reader.stats.loads_unlisted == 1
        reader.directory.add(blocks.hashes[:3])  # the head announced: asked, whole chain
        assert blocks.load(reader)[0] == 5
        assert reader.stats.loads == calls + 1
    finally:
        reader.close()
        writer.close()
