"""The prefix cache through the whole engine with SimModel workers (real processes, rings):
hits give the whole prompt's outputs, salts isolate, a shared prefix in one batch is computed
once, LRU eviction under a small budget, chunked prompts, routing across workers, stats. The
scheduler's invariants (prefix cache slots and pins included) are checked after every event."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, ForwardFailed, InvalidRequest, SimModel
from aioprefill.sched.scheduler import Scheduler
from aioprefill.workers.sim import (
    expected_logprob,
    expected_token,
    sim_embedding,
    sim_kv,
    sim_prompt_logprobs,
    sim_prompt_top_k,
    sim_top_k,
)
from tests.reliability.util import until_sent

pytestmark = pytest.mark.asyncio

KV = 16  # SimModel.kv_bytes_per_token here: a 16-token block is 256 bytes


@pytest.fixture(autouse=True)
def _check_invariants(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(Scheduler, "checking", True)


def sim(fixed_ms: float = 1.0) -> SimModel:
    return SimModel(fixed_ms=fixed_ms, per_token_us=0.0, kv_bytes_per_token=KV)


def ids(start: int, n: int) -> list[int]:
    return [(start + 7 * i) % 30000 for i in range(n)]


def check(r, tokens: list[int]) -> None:
    assert r.token == expected_token(tokens) and r.logprob == pytest.approx(
        expected_logprob(tokens)
    )


async def test_a_hit_answers_exactly_what_the_whole_prompt_does():
    async with Engine(EngineConfig(model=sim(), prefix_cache_bytes=1 << 20)) as engine:
        base = ids(1, 100)
        first = await engine.prefill(base)
        again = await engine.prefill(base)
        assert (first.cached_tokens, again.cached_tokens) == (0, 96)  # (100 - 1) // 16 blocks
        check(again, base)
        exact = ids(1, 96)  # six full blocks: the last token is computed, so five are read
        assert (await engine.prefill(exact)).cached_tokens == 80
        short = ids(1, 15)  # no full block: never looked up
        check(await engine.prefill(short), short)
        # base's blocks were written by next-token requests, which keep no hidden rows (the
        # worker may run the last layer on the last rows): a request asking for prompt logprobs
        # computes them, and writes them again with their rows
        assert (await engine.prefill(base, prompt_logprobs=True)).cached_tokens == 0
        longer = base[:70] + ids(5, 60)  # shares four blocks, then differs
        opts = dict(prompt_logprobs=True, top_k=3, prompt_top_k=True, embed="mean", normalize=True)
        r = await engine.prefill(longer, return_kv=True, **opts)
        assert r.cached_tokens == 64
        check(r, longer)
        np.testing.assert_array_equal(r.prompt_logprobs, sim_prompt_logprobs(longer))
        want_ids, want_lps = sim_prompt_top_k(longer, 3)
        np.testing.assert_array_equal(r.prompt_top_k_ids, want_ids)
        np.testing.assert_array_equal(r.prompt_top_k_logprobs, want_lps)
        np.testing.assert_array_equal(r.top_k_ids, sim_top_k(longer, 3)[0])
        np.testing.assert_allclose(r.embedding, sim_embedding(longer, "mean", True), rtol=1e-6)
        with r.kv as kv:  # the export holds the whole prompt's KV, cached positions included
            np.testing.assert_array_equal(kv.keys, sim_kv(longer)[0])
            np.testing.assert_array_equal(kv.values, sim_kv(longer)[1])
        last = await engine.prefill(longer, embed="last")
        np.testing.assert_allclose(last.embedding, sim_embedding(longer, "last"), rtol=1e-6)
        assert last.cached_tokens == 128
        stats = engine.stats().prefix_cache
    assert stats.queried_tokens == 100 + 100 + 96 + 100 + 130 + 130
    assert stats.hit_tokens == 96 + 80 + 0 + 64 + 128
    assert stats.blocks == 6 + 4 and stats.bytes == stats.blocks * 16 * KV
    assert stats.evictions == 0 and stats.capacity_blocks == (1 << 20) // (16 * KV)


async def test_salts_isolate_and_bad_salts_are_refused_before_queueing():
    async with Engine(EngineConfig(model=sim(), prefix_cache_bytes=1 << 20)) as engine:
        p = ids(3, 50)
        assert (await engine.prefill(p, cache_salt="a")).cached_tokens == 0
        assert (await engine.prefill(p, cache_salt="b")).cached_tokens == 0
        assert (await engine.prefill(p)).cached_tokens == 0
        for salt in ("a", "b", None):
            r = await engine.prefill(p, cache_salt=salt)
            assert r.cached_tokens == 48
            check(r, p)
        submitted = engine.stats().submitted
        for bad in ("", "x" * 257, 7):
            with pytest.raises(InvalidRequest):
                await engine.prefill(p, cache_salt=bad)
            with pytest.raises(InvalidRequest):
                engine.submit_threadsafe(p, cache_salt=bad)
        assert engine.stats().submitted == submitted  # nothing was queued


async def test_requests_sharing_an_uncached_prefix_in_one_batch_compute_it_once():
    async with Engine(EngineConfig(model=sim(300.0), prefix_cache_bytes=1 << 20)) as engine:
        blocker = asyncio.create_task(engine.prefill([5]))  # a forward to gather behind
        await until_sent(engine)
        shared = ids(11, 64)
        prompts = [shared + ids(100 + i, 5) for i in range(4)]
        results = await asyncio.gather(*(engine.prefill(p) for p in prompts))
        await blocker
    assert len({r.batch_id for r in results}) == 1  # one forward
    assert [r.cached_tokens for r in results] == [0, 64, 64, 64]  # the first writes, all read
    assert results[0].batch_tokens == 69 + 3 * 5  # the prefix computed once
    for p, r in zip(prompts, results, strict=True):
        check(r, p)


async def test_chunked_prompts_read_once_and_write_every_block_they_complete():
    cfg = EngineConfig(model=sim(), prefix_cache_bytes=1 << 20, max_batch_tokens=64)
    async with Engine(cfg) as engine:
        p = ids(9, 200)
        # (its blocks keep their hidden rows, which the reader's prompt logprobs need)
        assert (await engine.prefill(p, prompt_logprobs=True)).num_chunks == 4
        longer = p + ids(31, 150)
        r = await engine.prefill(longer, prompt_logprobs=True)
        assert r.cached_tokens == 192 and r.num_chunks == 3  # 158 computed in chunks of 64
        check(r, longer)
        np.testing.assert_array_equal(r.prompt_logprobs, sim_prompt_logprobs(longer))
        again = await engine.prefill(longer)
        assert again.cached_tokens == 336 and again.num_chunks == 1  # every chunk wrote
        check(again, longer)


async def test_lru_eviction_under_a_small_budget():
    # Eight blocks of 16 tokens in all.
    cfg = EngineConfig(model=sim(), prefix_cache_bytes=8 * 16 * KV)
    async with Engine(cfg) as engine:
        a, b, c = ids(1, 65), ids(2, 65), ids(3, 33)
        for p in (a, b):
            assert (await engine.prefill(p)).cached_tokens == 0
        assert (await engine.prefill(a)).cached_tokens == 64  # a is now the more recent
        assert engine.stats().prefix_cache.blocks == 8
        assert (await engine.prefill(c)).cached_tokens == 0  # two blocks: b's last two go
        stats = engine.stats().prefix_cache
        assert stats.evictions == 2 and stats.blocks == 8
        assert (await engine.prefill(a)).cached_tokens == 64
        r = await engine.prefill(b)  # its first two blocks are still there
        assert r.cached_tokens == 32
        check(r, b)


async def test_several_workers_route_a_request_to_the_one_holding_its_prefix():
    cfg = EngineConfig(model=sim(20.0), num_workers=2, prefix_cache_bytes=1 << 20)
    async with Engine(cfg) as engine:
        prefixes = [ids(1000 * k, 320) for k in range(4)]
        warm = await asyncio.gather(*(engine.prefill([*p, 1]) for p in prefixes))
        holder = [r.worker for r in warm]
        assert set(holder) == {0, 1}  # the burst used both workers
        for k, p in enumerate(prefixes):  # one at a time: both idle, each goes to its holder
            r = await engine.prefill([*p, 2, 3])
            assert (r.worker, r.cached_tokens) == (holder[k], 320)
        burst = [p + ids(7 * i, 8) for i in range(10) for p in prefixes]
        results = await asyncio.gather(*(engine.prefill(q) for q in burst))
        for q, r in zip(burst, results, strict=True):
            check(r, q)
        hit = sum(r.cached_tokens for r in results) / (320 * len(burst))
        print("burst hit ratio", hit)
        assert {r.worker for r in results} == {0, 1} and hit > 0.8, hit


async def test_a_failed_forward_leaves_nothing_cached_that_it_did_not_store():
    model = SimModel(fixed_ms=1.0, per_token_us=0.0, kv_bytes_per_token=KV, fail_token=29999)
    async with Engine(EngineConfig(model=model, prefix_cache_bytes=1 << 20)) as engine:
        p = ids(17, 64)
        with pytest.raises(ForwardFailed):
            await engine.prefill([*p, 29999])  # was to write p's four blocks
        assert engine.stats().prefix_cache.blocks == 0
        r = await engine.prefill([*p, 1])
        assert r.cached_tokens == 0
        check(r, [*p, 1])
        assert (await engine.prefill([*p, 2])).cached_tokens == 64


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"num_workers": 2, "expert_parallel": True}])
async def test_rank_groups_every_tp_rank_and_each_ep_rank_keeps_a_cache(layout):
    cfg = EngineConfig(model=sim(), prefix_cache_bytes=1 << 20, **layout)
    async with Engine(cfg) as engine:
        p = ids(21, 79)
        await engine.prefill(p)
        again = await engine.prefill(p)
        check(again, p)
        stats = engine.stats().prefix_cache
        prompts = [p[:64] + ids(300 + i, 20) for i in range(6)]
        for q, r in zip(prompts, await asyncio.gather(*map(engine.prefill, prompts)), strict=True):
            check(r, q)
    assert again.cached_tokens == 64
    if "tp_size" in layout:  # one slot per replica; every rank holds its own copy
        assert stats.bytes == stats.blocks * 16 * KV * 2 and stats.blocks == 4
