"""A store hit on the Paddle model is bitwise the answer of a miss with deterministic=True:
node A computes a prompt (its blocks go to a real master), node B, whose own cache is empty,
loads them and answers every output (token, logprobs, prompt logprobs and top-k at every
position, embeddings, the KV export) exactly as an engine with the cache off; on the tiny
test model and on the real SmolLM2."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import uvloop

from aioprefill import Engine, EngineConfig, PaddleModel
from aioprefill.workers.prefix_blocks import BlockStore
from tests.kvstore.test_engine_store import DIMS, config, running_master, wait_stored
from tests.kvstore.util import need_store
from tests.model.batches import small
from tests.test_prefix_paddle import ALL, both, ids, same

need_store()


def _store_hit_is_a_miss(
    model: PaddleModel, prompt: list[int], cached: int, local_blocks: int = 0
) -> None:
    """`local_blocks`: node B's own cache holds only that many blocks (0: 64 MiB), and loads
    the rest of the prompt's blocks into scratch slots; then it computes another prompt, whose
    blocks past its slots it writes to scratch slots and puts, and A loads them all."""

    async def main() -> None:
        with running_master() as master:
            cfg = config(master, model=model)
            cfg_b = cfg
            if local_blocks:
                dims = (model.num_layers, model.num_kv_heads, model.head_dim, model.hidden_size)
                block = BlockStore.block_bytes(
                    **dict(zip(DIMS, dims, strict=True)), block_tokens=16
                )
                store = dataclasses.replace(cfg.kv_store_options, scratch_blocks=16)
                cfg_b = dataclasses.replace(
                    cfg, prefix_cache_bytes=local_blocks * block, kv_store_options=store
                )
            async with (
                Engine(cfg) as a,
                Engine(cfg_b) as b,
                Engine(EngineConfig(model=model, prefix_cache_bytes=0)) as off,
            ):
                first = await a.prefill(prompt, **ALL)
                assert first.cached_tokens == 0
                await asyncio.to_thread(wait_stored, master, prompt, model)
                hit, miss, kv_hit, kv_miss = await both(b, off, prompt, **ALL, return_kv=True)
                assert (hit.cached_tokens, miss.cached_tokens) == (cached, 0)
                assert b.stats().prefix_cache.store_hit_tokens == cached
                same(hit, miss, bitwise=True)
                assert kv_hit is not None and kv_miss is not None
                assert np.array_equal(kv_hit[0], kv_miss[0])
                assert np.array_equal(kv_hit[1], kv_miss[1])
                if local_blocks:  # B computes another: what its slots do not take goes to
                    other = ids(9, 170)  # scratch slots (7 of its 10 blocks), put from there
                    assert (await b.prefill(other)).cached_tokens == 0
                    await asyncio.to_thread(wait_stored, master, other, model)
                    hit, miss, kv_hit, kv_miss = await both(a, off, other, **ALL, return_kv=True)
                    assert hit.cached_tokens == 160  # every block of it, loaded by A
                    same(hit, miss, bitwise=True)
                    assert kv_hit is not None and kv_miss is not None
                    assert np.array_equal(kv_hit[0], kv_miss[0])
                    return
                last = await b.prefill(prompt[:97], embed="last", prompt_logprobs=True)
                want = await off.prefill(prompt[:97], embed="last", prompt_logprobs=True)
                same(last, want, bitwise=True)  # a hit from b's own cache now

    uvloop.run(main())


def test_a_store_hit_is_bitwise_a_miss() -> None:
    _store_hit_is_a_miss(small(deterministic=True, seed=52), ids(7, 150), 144)


def test_a_store_hit_past_the_local_slots_is_bitwise_a_miss() -> None:
    # B's cache gives the prompt 3 slots; the other 6 blocks land in scratch slots
    _store_hit_is_a_miss(small(deterministic=True, seed=52), ids(7, 150), 144, local_blocks=3)


@pytest.mark.slow
def test_a_smollm2_store_hit_is_bitwise_a_miss() -> None:
    from tests.hf.smollm2 import gguf_path

    model = PaddleModel.from_pretrained(gguf_path(), device="cpu", deterministic=True)
    _store_hit_is_a_miss(model, ids(8, 130, vocab=49152), 128)
