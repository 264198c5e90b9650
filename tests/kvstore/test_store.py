"""The store tier against a real `mooncake_master` (from the wheel, on 127.0.0.1, stopped by
pid): blocks one worker puts are loaded by another worker process, checked before use; a
forged, short or foreign value, or a block evicted before the read, ends the chain there (the
worker computes the rest); the put budget drops instead of blocking; the cost rule skips the
store when computing is cheaper; blocks listed for a later copy are copied before their cache
slot is rewritten."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from aioprefill.kvstore.identity import StoreIdentity
from aioprefill.kvstore.master import LocalMaster
from aioprefill.kvstore.value import ValueCodec
from tests.kvstore.util import IDENT, PAYLOAD, Blocks, Gate, drain, need_store, tier

need_store()


@pytest.fixture(scope="module")
def master():
    m = LocalMaster().start()
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture(scope="module")
def reader(master):
    t = tier(master.address)
    try:
        yield t
    finally:
        t.close()


def test_another_process_reads_what_a_worker_put(master, reader):
    blocks = Blocks(6, seed=1)
    child = textwrap.dedent(f"""
        import sys
        from tests.kvstore.util import Blocks, tier, drain
        t = tier({master.address!r})
        blocks = Blocks(6, seed=1)
        assert blocks.offer_all(t) == 6
        drain(t)
        assert t.stats.puts == 6, t.stats
        print("put", flush=True)
        sys.stdin.read()  # the blocks live in this process's segment: stay until told
        t.close()
    """)
    p = subprocess.Popen(
        [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None
        lines = iter(p.stdout.readline, "")
        assert any(line.strip() == "put" for line in lines)
        k, _ = blocks.load(reader)  # checks every byte against the payloads
        assert k == 6
        assert blocks.load(reader, 4)[0] == 4
    finally:
        p.communicate("", timeout=60)
    assert p.returncode == 0


def test_a_chain_stops_at_the_first_block_the_store_lacks(master, reader):
    writer = tier(master.address)
    try:
        blocks = Blocks(5, seed=2)
        assert blocks.offer_all(writer) == 5
        drain(writer)
        # Evicted between the engine's plan and the read: removed by another client.
        assert writer.link.store.remove(IDENT.key(blocks.hashes[3]), True) == 0
        before = reader.stats.blocks_missing
        start = time.perf_counter()
        assert blocks.load(reader)[0] == 3
        took = time.perf_counter() - start
        assert reader.stats.blocks_missing == before + 1
        # The call's parts (handoffs, store call, checks, copies: AIOPREFILL_STORE_DIAG logs
        # them) are its own: five, none negative, within the call.
        parts = reader.loader.parts
        assert len(parts) == 5 and min(parts) >= 0 and sum(parts) <= took, parts
        never = Blocks(2, seed=3)
        assert never.load(reader)[0] == 0
    finally:
        writer.close()


def _tamper(writer, blocks: Blocks, i: int, value: bytes) -> None:
    store = writer.link.store
    key = IDENT.key(blocks.hashes[i])
    assert store.remove(key, True) == 0
    assert store.put(key, value) == 0


def test_forged_short_and_foreign_values_are_refused(master, reader):
    writer = tier(master.address)
    try:
        blocks = Blocks(4, seed=4)
        assert blocks.offer_all(writer) == 4
        drain(writer)
        good = bytes(writer.link.store.get(IDENT.key(blocks.hashes[2])))
        assert len(good) == reader.value_bytes
        payload_at = len(good) - PAYLOAD
        cases = {
            "short": good[:-1],
            "garbage": bytes(len(good)),
            "flipped": good[:payload_at] + bytes([good[payload_at] ^ 1]) + good[payload_at + 1 :],
        }
        other = StoreIdentity("another-model", "float32", IDENT.layout, IDENT.block_tokens)
        foreign = bytearray(reader.value_bytes)
        codec = ValueCodec(other.digest, IDENT.block_tokens, PAYLOAD)
        view = memoryview(foreign)
        codec.write_header(view, blocks.hashes[2], blocks.tokens[2])[:] = blocks.payloads[
            2
        ].tobytes()
        codec.seal(view)
        cases["foreign model"] = bytes(foreign)
        for name, value in cases.items():
            _tamper(writer, blocks, 2, value)
            refused = reader.stats.blocks_refused + reader.stats.blocks_missing
            assert blocks.load(reader)[0] == 2, name  # blocks 0, 1 good; 2 refused
            assert reader.stats.blocks_refused + reader.stats.blocks_missing == refused + 1
        _tamper(writer, blocks, 2, good)
        assert blocks.load(reader)[0] == 4
    finally:
        writer.close()


def test_a_full_put_budget_drops_blocks_and_never_waits(master, reader):
    writer = tier(master.address, put_buffer_bytes=3 * 90 * 1024)  # room for 3 values
    try:
        assert writer.puts.slots.__len__() == 3
        gate = Gate(writer, "batch_put_from")
        blocks = Blocks(5, seed=5)
        h, t, p = blocks.hashes, blocks.tokens, blocks.payloads
        assert writer.offer(h[0], t[0], [p[0]])
        assert gate.entered.wait(30)  # the put thread holds block 0, stuck in its put
        accepted = [writer.offer(h[i], t[i], [p[i]]) for i in range(1, 5)]
        assert accepted == [True, True, False, False]  # offer returned while the put waits
        assert writer.stats.puts_dropped_full == 2
        gate.open()
        drain(writer)
        assert writer.stats.puts == 3
        assert blocks.load(reader)[0] == 3
        assert not writer.offer(h[0], t[0], [p[0]])  # put already: not again
        assert writer.stats.puts_skipped_recent == 1
    finally:
        writer.close()


def test_the_cost_rule_skips_the_store_when_computing_is_cheaper(master, reader):
    blocks = Blocks(2, seed=6)
    writer = tier(master.address)
    try:
        blocks.offer_all(writer)
        drain(writer)
        fast = tier(master.address, read_latency_s=1.0)  # a 1 s read never pays
        try:
            loads = fast.stats.loads
            assert blocks.load(fast)[0] == 0
            assert fast.stats.loads == loads and fast.stats.loads_skipped == 1
        finally:
            fast.close()
        assert blocks.load(reader)[0] == 2
    finally:
        writer.close()


def test_a_chain_longer_than_the_load_buffer_loads_its_head(master):
    small = tier(master.address, load_buffer_bytes=2 * 90 * 1024)
    try:
        assert small.loader.capacity == 2
        blocks = Blocks(4, seed=7)
        assert blocks.offer_all(small) == 4
        drain(small)
        assert blocks.load(small)[0] == 2
    finally:
        small.close()


def test_parts_must_fill_the_payload(reader):
    with pytest.raises(ValueError, match="payload"):
        reader.offer(99, np.zeros(16, np.int32), [np.zeros(10, np.uint8)])
    assert len(reader.puts.free) == reader.puts.slots.__len__()  # the slot came back


def test_one_load_answers_every_chain_of_a_batch(master, reader):
    writer = tier(master.address)
    try:
        full, partial, absent = Blocks(3, seed=21), Blocks(4, seed=22), Blocks(2, seed=23)
        assert full.offer_all(writer) == 3
        assert partial.offer_all(writer) == 4
        drain(writer)
        assert writer.link.store.remove(IDENT.key(partial.hashes[2]), True) == 0
        got: dict[tuple[int, int], bytes] = {}

        def sink(c: int, i: int, payload: memoryview) -> None:
            got[c, i] = bytes(payload)

        loads = reader.stats.loads
        chains = [full.chain(), absent.chain(), partial.chain()]
        assert reader.load(chains, sink) == [3, 0, 2]
        assert reader.stats.loads == loads + 1  # one call for the whole batch
        for c, blocks in ((0, full), (2, partial)):
            for i in range(3 if c == 0 else 2):
                assert got[c, i] == blocks.payloads[i].tobytes()
        assert len(got) == 5
    finally:
        writer.close()


def test_a_deferred_block_is_copied_before_its_cache_slot_is_rewritten(master, reader):
    """`defer` lists blocks (views of the cache slots) for the put thread to copy later;
    `settle(slots)`, which the worker calls before its next batch writes those slots, copies
    them first: what the store gets is what the forward wrote, never what came after."""
    blocks = Blocks(4, seed=7)
    cache = np.stack(blocks.payloads)  # four cache slots holding the blocks' payloads
    t = tier(master.address)
    try:
        listed = [
            (i, h, blocks.tokens[i], [cache[i]]) for i, h in enumerate(blocks.hashes)
        ]  # fmt: skip
        with t.puts.cond:  # (the put thread cannot copy a listed block meanwhile)
            t.defer(listed)
            assert len(t.puts.deferred) == 4
            t.settle([1, 0, 99])  # the next batch writes slots 0 and 1 (99: nothing listed)
            assert sorted(t.puts.deferred) == [2, 3]
            cache[:2] = 0  # ... and rewrites them
        drain(t)  # the put thread copies 2 and 3
        assert t.stats.puts == 4, t.stats
        k, _ = blocks.load(reader)  # every byte checked against the payloads as written
        assert k == 4
    finally:
        t.close()


def test_blocks_put_or_loaded_are_known_to_be_stored_without_a_call(master, reader):
    writer = tier(master.address)
    try:
        blocks = Blocks(4, seed=31)
        assert writer.puts.known_prefix(blocks.hashes) == 0
        assert blocks.offer_all(writer) == 4
        drain(writer)
        assert writer.puts.known_prefix([*blocks.hashes[:2], 12345, blocks.hashes[2]]) == 2
        assert reader.puts.known_prefix(blocks.hashes) == 0  # another worker's puts
        assert blocks.load(reader)[0] == 4
        assert reader.puts.known_prefix(blocks.hashes) == 4  # loaded: known, and not put again
        assert not reader.offer(blocks.hashes[0], blocks.tokens[0], [blocks.payloads[0]])
    finally:
        writer.close()
