"""An `Engine` with `kv_events_endpoint` publishes what its prefix cache holds (SimModel
worker, a real ZMQ subscriber): the blocks a prompt stores, with the engine's own hashes and
their tokens, a longer prompt's new blocks linked to the shared ones, a killed worker's blocks
withdrawn (`AllBlocksCleared`), and a taken address failing the start before any worker."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, InvalidConfig, SimModel
from aioprefill.sched.prefix.hashing import block_hashes
from tests.kv_events.util import Subscriber, endpoints
from tests.reliability.util import kill_worker, until

pytestmark = pytest.mark.asyncio
B = 16


def ids(start: int, n: int) -> list[int]:
    return [(start + 7 * i) % 30000 for i in range(n)]


async def batches(s: Subscriber, n: int = 1) -> list[list[dict]]:
    """The next `n` batches' events, letting the engine's loop run meanwhile."""
    got: list[list[dict]] = []
    deadline = time.monotonic() + 20
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} batches arrived"
        if s.sub.poll(0):
            got.append(s.recv()[2][1])
        else:
            await asyncio.sleep(0.01)
    return got


async def test_the_engine_publishes_what_its_cache_holds():
    ep, replay = endpoints()
    cfg = EngineConfig(
        model=SimModel(fixed_ms=1.0, kv_bytes_per_token=16),
        prefix_cache_bytes=1 << 20,
        kv_events_endpoint=ep,
        kv_events_replay_endpoint=replay,
    )
    async with Engine(cfg) as engine:
        s = Subscriber(SimpleNamespace(endpoint=ep, replay_endpoint=replay))
        try:
            (snapshot,) = await batches(s)  # joining: the node's (empty) state
            assert snapshot == [{"type": "AllBlocksCleared"}]

            first = ids(1, 49)
            hashes = block_hashes(np.asarray(first, np.int32).tobytes(), B)
            await engine.prefill(first)
            ((stored,),) = await batches(s)
            assert stored == {
                "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                "token_ids": first[:48], "block_size": B, "lora_id": None, "medium": "GPU",
                "lora_name": None,
            }  # fmt: skip

            longer = first[:48] + ids(5, 33)  # 3 shared blocks, 2 new
            more = block_hashes(np.asarray(longer, np.int32).tobytes(), B)
            assert more[:3] == hashes
            assert (await engine.prefill(longer)).cached_tokens == 48
            ((stored,),) = await batches(s)
            assert stored["block_hashes"] == more[3:5] and stored["parent_block_hash"] == hashes[2]
            assert stored["token_ids"] == longer[48:80]

            kill_worker(engine, 0)
            await until(lambda: engine.stats().prefix_cache.blocks == 0, what="index dropped")
            assert await batches(s) == [[{"type": "AllBlocksCleared"}]]
        finally:
            s.close()


async def test_a_taken_address_fails_the_start_before_any_worker():
    ep, replay = endpoints()
    cfg = EngineConfig(model=SimModel(), kv_events_endpoint=ep, kv_events_replay_endpoint=replay)
    first = Engine(cfg)
    await first.start()
    try:
        second = Engine(cfg)
        with pytest.raises(InvalidConfig, match="kv_events_endpoint: cannot bind"):
            await second.start()
        assert second.worker_pids() == []
    finally:
        await first.close()
