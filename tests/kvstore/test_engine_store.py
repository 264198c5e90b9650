"""The store tier through whole engines (SimModel workers, real processes, a real master):
what one node computed, another node reads instead of computing it, with the whole prompt's
outputs; blocks a node's local cache evicted come back from the store; killing the master
mid-run fails no request and changes no answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, PaddleModel, SimModel
from aioprefill.kvstore.backend import load_store
from aioprefill.kvstore.master import LocalMaster
from aioprefill.sched.prefix.hashing import block_hashes
from aioprefill.sched.scheduler import Scheduler
from aioprefill.workers.prefix_blocks import BlockStore
from aioprefill.workers.sim import expected_token, sim_embedding, sim_prompt_logprobs
from aioprefill.workers.sim_cache import SimBlocks
from aioprefill.workers.store_hook import identity_for
from tests.kvstore.util import need_store, options

need_store()
pytestmark = pytest.mark.asyncio

B = 16
KV = 64  # SimModel.kv_bytes_per_token: a block's value is 1 KiB plus its header
# 1 ms per computed token: a 16-token block costs 16 ms to compute, so the cost rule (on the
# worker's measured read and forward costs) loads whatever the store holds, even on a busy VM.
MODEL = SimModel(fixed_ms=1.0, per_token_us=1000.0, kv_bytes_per_token=KV)


@pytest.fixture(autouse=True)
def _check_invariants(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(Scheduler, "checking", True)


@pytest.fixture
def master():
    """A fresh master per test: the same test runs on two event loops with the same prompts,
    and blocks the first run left (in a segment not yet unmounted) must not serve the second."""
    with running_master() as m:
        yield m


@contextlib.contextmanager
def running_master() -> Iterator[LocalMaster]:
    """A master whose raw client (`wait_stored`'s) is closed before it stops: left to the
    process's exit, a client's destructor retries its unmount against the stopped master
    for 10-45 s (pytest's exit waited a minute for them)."""
    with LocalMaster() as m:
        try:
            yield m
        finally:
            close_client(m)


def config(master: LocalMaster, cache_blocks: int = 64, model: object = MODEL) -> EngineConfig:
    return EngineConfig(
        model=model,  # type: ignore[arg-type]
        prefix_cache_bytes=cache_blocks * B * KV if model is MODEL else 64 << 20,
        kv_store="mooncake",
        # (a SmolLM2 block is 759 KiB: room for a 130-token prompt's blocks)
        kv_store_options=options(
            master.address, put_buffer_bytes=16 << 20, load_buffer_bytes=16 << 20
        ),
    )


def ids(start: int, n: int) -> list[int]:
    return [(start + 7 * i) % 30000 for i in range(n)]


def wait_stored(
    master: LocalMaster, tokens: list[int], model: SimModel | PaddleModel = MODEL
) -> None:
    """Wait until the store holds every full block of `tokens` (puts are asynchronous)."""
    if isinstance(model, SimModel):
        layout = f"{SimBlocks(1, B).layout()} P{B * model.kv_bytes_per_token}"
    else:
        dims = (model.num_layers, model.num_kv_heads, model.head_dim, model.hidden_size)
        store = BlockStore(1, **dict(zip(DIMS, dims, strict=True)), block_tokens=B)
        payload = sum(a.nbytes for a in store.slot_arrays(0))
        layout = f"{store.layout()} P{payload}"
    identity = identity_for(model, options(master.address), B, layout)
    hashes = block_hashes(np.asarray(tokens, dtype="<i4").tobytes(), B, None)
    keys = [identity.key(h) for h in hashes]
    client = _client(master.address)
    deadline = time.monotonic() + 60
    while not all(x == 1 for x in client.batch_is_exist(keys)):
        assert time.monotonic() < deadline, "the blocks never reached the store"
        time.sleep(0.05)  # waiting on another process's background puts


_clients: dict[str, Any] = {}


def _client(address: str) -> Any:
    """One raw client per master (Mooncake's setup and close hold the GIL for a while: not
    once per wait), closed by `running_master`."""
    if address not in _clients:
        client = load_store()()
        rc = client.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", address)
        assert rc == 0
        _clients[address] = client
    return _clients[address]


def close_client(master: LocalMaster) -> None:
    """Close `master`'s raw client, if it has one (before the master stops: see
    `running_master`)."""
    client = _clients.pop(master.address, None)
    if client is not None:
        client.close()


DIMS = ("num_layers", "kv_heads", "head_dim", "hidden_size")


async def test_a_second_node_reads_what_the_first_computed(master):
    cfg = config(master)
    cfg.max_batch_tokens = 128  # prompts longer than this run in chunks
    async with Engine(cfg) as a, Engine(cfg) as b:
        prompt = ids(1, 100)  # 6 full blocks; 96 tokens are cacheable, 99 at most read
        opts = dict(prompt_logprobs=True, embed="mean")
        first = await a.prefill(prompt, **opts)
        assert first.cached_tokens == 0
        await asyncio.to_thread(wait_stored, master, prompt)
        second = await b.prefill(prompt, **opts)
        assert second.cached_tokens == 96  # every full block loaded, the rest computed
        assert second.token == first.token == expected_token(prompt)
        assert second.logprob == first.logprob
        np.testing.assert_array_equal(second.prompt_logprobs, sim_prompt_logprobs(prompt))
        np.testing.assert_allclose(second.embedding, sim_embedding(prompt, "mean"), rtol=1e-6)
        stats = b.stats().prefix_cache
        assert stats.store_hit_tokens == 96 and stats.hit_tokens == 0
        again = await b.prefill(prompt)  # now in b's own cache
        assert again.cached_tokens == 96 and b.stats().prefix_cache.hit_tokens == 96
        salted = await b.prefill(prompt, cache_salt="tenant-x")  # another salt: other keys
        assert salted.cached_tokens == 0 and salted.token == first.token

        # A chunked prompt loads in its first chunk: 7 of that chunk's 8 blocks (one token of
        # every chunk is computed); the later chunks compute.
        long = ids(3, 300)
        first = await a.prefill(long, prompt_logprobs=True)
        await asyncio.to_thread(wait_stored, master, long)
        second = await b.prefill(long, prompt_logprobs=True)
        assert second.cached_tokens == 112 and second.num_chunks == first.num_chunks
        assert second.token == first.token
        np.testing.assert_array_equal(second.prompt_logprobs, first.prompt_logprobs)

        # Two prompts sharing a prefix in one batch: the first loads it, the other reads the
        # slots it fills (piggyback), the same forward.
        shared = ids(5, 64)
        await a.prefill([*shared, 1, 2, 3])
        await asyncio.to_thread(wait_stored, master, shared)
        busy = asyncio.ensure_future(b.prefill(ids(9, 120)))  # x and y gather meanwhile
        await asyncio.sleep(0)
        x, y = await asyncio.gather(b.prefill([*shared, 4, 5]), b.prefill([*shared, 6, 7, 8]))
        await busy
        assert x.batch_id == y.batch_id
        assert (x.cached_tokens, y.cached_tokens) == (64, 64)
        assert (x.token, y.token) == (
            expected_token([*shared, 4, 5]),
            expected_token([*shared, 6, 7, 8]),
        )


async def test_with_a_directory_a_node_loads_what_another_announced(master):
    """`KVStoreOptions.peer_events`: each worker follows both nodes' KV events and asks the
    store only for announced chains; a prompt the other node computed (and announced) loads,
    with the whole prompt's outputs."""
    from tests.kv_events.util import endpoints

    (ep_a, replay_a), (ep_b, replay_b) = endpoints(), endpoints()

    def node(ep: str, replay: str) -> EngineConfig:
        cfg = config(master)
        cfg.kv_store_options = dataclasses.replace(cfg.kv_store_options, peer_events=(ep_a, ep_b))
        cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint = ep, replay
        return cfg

    async with Engine(node(ep_a, replay_a)) as a, Engine(node(ep_b, replay_b)) as b:
        deadline = time.monotonic() + 30
        # Both workers subscribed to both nodes (a late one would get a snapshot anyway).
        while min(a._events.num_subscribers, b._events.num_subscribers) < 2:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the workers never subscribed"
            await asyncio.sleep(0.02)
        prompt = ids(21, 100)
        first = await a.prefill(prompt, prompt_logprobs=True)
        await asyncio.to_thread(wait_stored, master, prompt)
        second = await b.prefill(prompt, prompt_logprobs=True)
        assert second.cached_tokens == 96  # announced by a, so asked for, and loaded
        assert second.token == first.token == expected_token(prompt)
        np.testing.assert_array_equal(second.prompt_logprobs, sim_prompt_logprobs(prompt))
        fresh = await b.prefill(ids(23, 50))  # nobody announced it: computed
        assert fresh.cached_tokens == 0 and fresh.token == expected_token(ids(23, 50))


async def test_blocks_past_the_local_slots_load_into_scratch_slots(master):
    cfg = config(master)

    def small(scratch: int) -> EngineConfig:
        store = dataclasses.replace(cfg.kv_store_options, scratch_blocks=scratch)
        return dataclasses.replace(config(master, cache_blocks=4), kv_store_options=store)

    async with Engine(cfg) as a, Engine(small(16)) as b, Engine(small(0)) as c:
        prompt = ids(11, 200)  # 12 full blocks, 192 tokens cacheable
        first = await a.prefill(prompt, prompt_logprobs=True)
        await asyncio.to_thread(wait_stored, master, prompt)
        second = await b.prefill(prompt, prompt_logprobs=True)
        assert second.cached_tokens == 192  # 4 blocks into its slots, 8 into scratch ones
        assert second.token == first.token == expected_token(prompt)
        np.testing.assert_array_equal(second.prompt_logprobs, first.prompt_logprobs)
        without = await c.prefill(prompt)  # no scratch slots: only what its slots hold
        assert without.cached_tokens == 64 and without.token == first.token
        # B's cache now holds the prompt's first 4 blocks: a longer prompt reads them, then
        # loads the next ones past the slots it is given (their hashes: the batch's tail).
        longer = [*prompt, *ids(13, 40)]
        await a.prefill(longer)
        await asyncio.to_thread(wait_stored, master, longer)
        third = await b.prefill(longer)
        assert third.cached_tokens == 224 and third.token == expected_token(longer)

        # What B computes past its 4 slots is written to scratch slots and put: A loads every
        # block of it. C, without scratch slots, puts only what its slots hold.
        fresh = ids(17, 200)
        assert (await b.prefill(fresh, prompt_logprobs=True)).cached_tokens == 0
        await asyncio.to_thread(wait_stored, master, fresh)
        fourth = await a.prefill(fresh, prompt_logprobs=True)
        assert fourth.cached_tokens == 192 and fourth.token == expected_token(fresh)
        np.testing.assert_array_equal(fourth.prompt_logprobs, sim_prompt_logprobs(fresh))
        other = ids(19, 200)
        await c.prefill(other)
        await asyncio.to_thread(wait_stored, master, other[:64])
        assert (await a.prefill(other)).cached_tokens == 64


async def test_killing_the_master_mid_run_fails_no_request(master):
    m = master
    async with Engine(config(m, cache_blocks=8)) as a, Engine(config(m, cache_blocks=8)) as b:
        prompts = [ids(100 + i, 40 + 5 * i) for i in range(12)]
        for p in prompts[:6]:
            await a.prefill(p)
            await asyncio.to_thread(wait_stored, m, p)
        close_client(m)  # (a client of a dead master takes ~10 s to close)
        results = []
        for round_ in range(4):
            if round_ == 2:
                m.kill()
            got = await asyncio.gather(*(e.prefill(p) for p in prompts for e in (a, b)))
            results.extend(zip([p for p in prompts for _ in (a, b)], got, strict=True))
        for p, r in results:
            assert r.token == expected_token(p)
        assert b.stats().prefix_cache.store_hit_tokens > 0  # before the kill


async def test_an_engine_whose_master_is_absent_starts_and_serves():
    nobody = LocalMaster()  # its port, with nothing listening on it
    async with Engine(config(nobody)) as engine:
        prompt = ids(11, 40)
        for _ in range(2):
            r = await engine.prefill(prompt)
            assert r.token == expected_token(prompt)
        assert r.cached_tokens == 32  # the local cache works as without a store
        assert engine.stats().prefix_cache.store_hit_tokens == 0


async def test_blocks_a_node_evicts_stay_announced_as_store_backed():
    """KV events with a store: blocks evicted from the local cache are announced "CPU"
    (still loadable from the store: vllm-router's host tier), parents first, after their
    "GPU" withdrawal (tests/kv_events/test_router.py: how the router credits them)."""
    from types import SimpleNamespace

    from tests.kv_events.test_engine_events import batches
    from tests.kv_events.util import Subscriber, endpoints

    ep, replay = endpoints()
    nobody = LocalMaster()  # the events are the engine's decisions: no master needed
    cfg = config(nobody, cache_blocks=4)
    cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint = ep, replay
    async with Engine(cfg) as engine:
        s = Subscriber(SimpleNamespace(endpoint=ep, replay_endpoint=replay))
        try:
            assert await batches(s) == [[{"type": "AllBlocksCleared"}]]
            first, second = ids(1, 65), ids(2, 65)  # 4 full blocks each: the whole cache
            h1 = block_hashes(np.asarray(first, "<i4").tobytes(), B)
            h2 = block_hashes(np.asarray(second, "<i4").tobytes(), B)
            await engine.prefill(first)
            (([gpu],),) = [await batches(s)]
            assert (gpu["medium"], gpu["block_hashes"]) == ("GPU", h1)
            await engine.prefill(second)  # evicts all of first's blocks
            ((removed, backed, stored),) = await batches(s)
            assert removed == {"type": "BlockRemoved", "block_hashes": h1[::-1], "medium": "GPU"}
            assert (backed["type"], backed["medium"]) == ("BlockStored", "CPU")
            assert backed["block_hashes"] == h1 and backed["parent_block_hash"] is None
            assert backed["token_ids"] == first[:64]
            assert (stored["medium"], stored["block_hashes"]) == ("GPU", h2)
            again = await engine.prefill(first)  # computed again (no master): GPU again
            assert again.cached_tokens == 0
            # second's blocks go to the store tier; first's were there already: GPU only
            ((removed, backed, stored),) = await batches(s)
            assert (removed["medium"], removed["block_hashes"]) == ("GPU", h2[::-1])
            assert (backed["medium"], backed["block_hashes"]) == ("CPU", h2)
            assert (stored["medium"], stored["block_hashes"]) == ("GPU", h1)
        finally:
            s.close()
