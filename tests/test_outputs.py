"""Output options end to end through the engine with SimModel workers (real processes, rings,
segments): every option's value, requests with different options sharing batches, chunked
prompts, options refused before anything is queued, and results too big for the ring."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, InvalidRequest, InvalidRequestType, SimModel
from aioprefill.workers.sim import (
    SIM_EMBED_DIM,
    expected_token,
    sim_embedding,
    sim_kv,
    sim_prompt_logprobs,
    sim_prompt_top_k,
    sim_top_k,
)
from aioprefill.workers.sim_labels import sim_label_logprobs

pytestmark = pytest.mark.asyncio


def sim(**kw) -> SimModel:
    return SimModel(fixed_ms=kw.pop("fixed_ms", 1.0), per_token_us=0.0, **kw)


OPTION_SETS = [
    {},
    {"prompt_logprobs": True},
    {"top_k": 5},
    {"embed": "last"},
    {"embed": "mean", "normalize": True},
    {"return_kv": True},
    {"prompt_logprobs": True, "top_k": 3, "embed": "mean", "return_kv": True},
    {"prompt_logprobs": True, "top_k": 4, "prompt_top_k": True},
    {"label_token_ids": [5, 31999, 5]},
    {"label_token_ids": [0], "top_k": 2, "embed": "last"},
]


def check(result, tokens: list[int], opts: dict) -> None:
    assert result.token == expected_token(tokens)
    if opts.get("prompt_logprobs"):
        assert result.prompt_logprobs.dtype == np.float32
        assert np.array_equal(result.prompt_logprobs, sim_prompt_logprobs(tokens))
    else:
        assert result.prompt_logprobs is None
    k = opts.get("top_k", 0)
    if k:
        ids, lps = sim_top_k(tokens, k)
        assert result.top_k_ids.dtype == np.int32 and np.array_equal(result.top_k_ids, ids)
        assert result.top_k_logprobs.dtype == np.float32
        assert np.array_equal(result.top_k_logprobs, lps)
        assert result.top_k_ids[0] == result.token
    else:
        assert result.top_k_ids is None and result.top_k_logprobs is None
    if opts.get("prompt_top_k"):
        ids, lps = sim_prompt_top_k(tokens, k)
        assert ids.shape == (len(tokens) - 1, k)
        assert result.prompt_top_k_ids.dtype == np.int32
        assert result.prompt_top_k_logprobs.dtype == np.float32
        assert np.array_equal(result.prompt_top_k_ids, ids)
        assert np.array_equal(result.prompt_top_k_logprobs, lps)
    else:
        assert result.prompt_top_k_ids is None and result.prompt_top_k_logprobs is None
    if opts.get("embed"):
        want = sim_embedding(tokens, opts["embed"], opts.get("normalize", False))
        assert result.embedding.shape == (SIM_EMBED_DIM,)
        np.testing.assert_allclose(result.embedding, want, rtol=0, atol=1e-6)
        if opts.get("normalize"):
            assert abs(float(np.linalg.norm(result.embedding)) - 1.0) < 1e-6
    else:
        assert result.embedding is None
    if "label_token_ids" in opts:
        ids = opts["label_token_ids"]
        want = sim_label_logprobs(result.token, result.logprob, ids, 32000)
        assert result.label_logprobs.dtype == np.float32
        assert result.label_logprobs.shape == (len(ids),)
        assert np.array_equal(result.label_logprobs, want)
    else:
        assert result.label_logprobs is None
    if opts.get("return_kv"):
        keys, values = sim_kv(tokens)
        with result.kv as kv:
            assert kv.keys.shape == (2, 2, len(tokens), 8)
            assert np.array_equal(kv.keys, keys) and np.array_equal(kv.values, values)
        assert result.kv.closed
    else:
        assert result.kv is None


@pytest.mark.parametrize("max_batch_tokens", [8192, 16], ids=["whole", "chunked"])
async def test_mixed_options_share_batches_and_each_gets_its_own(max_batch_tokens: int):
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    prompts = [[rng.randrange(32000) for _ in range(rng.randrange(1, 60))] for _ in range(200)]
    options = [OPTION_SETS[i % len(OPTION_SETS)] for i in range(len(prompts))]
    config = EngineConfig(model=sim(fixed_ms=3.0), max_batch_tokens=max_batch_tokens)
    async with Engine(config) as engine:
        results = await asyncio.gather(
            *(engine.prefill(p, **o) for p, o in zip(prompts, options, strict=True))
        )
        stats = engine.stats()
        for r, p, o in zip(results, prompts, options, strict=True):
            check(r, p, o)  # closes each KV export
        assert engine._kv.used_bytes == engine._kv.pooled_bytes  # closed, kept for reuse
    mixes: dict[int, set[int]] = {}
    for i, r in enumerate(results):
        mixes.setdefault(r.batch_id, set()).add(i % len(OPTION_SETS))
    assert max(len(m) for m in mixes.values()) >= 2, "different options shared a batch"
    assert stats.completed == len(prompts)
    if max_batch_tokens == 16:
        assert any(r.num_chunks > 1 for r in results)


async def test_one_token_prompt_has_no_prompt_logprobs():
    async with Engine(EngineConfig(model=sim())) as engine:
        r = await engine.prefill([7], prompt_logprobs=True, embed="last")
        t = await engine.prefill([7], prompt_logprobs=True, top_k=3, prompt_top_k=True)
    assert r.prompt_logprobs.shape == (0,) and r.prompt_logprobs.dtype == np.float32
    assert t.prompt_top_k_ids.shape == (0, 3) and t.prompt_top_k_ids.dtype == np.int32
    assert t.prompt_top_k_logprobs.shape == (0, 3)
    np.testing.assert_allclose(r.embedding, sim_embedding([7], "last"), atol=1e-6)


@pytest.mark.parametrize(
    ("opts", "error"),
    [
        ({"top_k": -1}, InvalidRequest),
        ({"top_k": 32001}, InvalidRequest),
        ({"top_k": 2.0}, InvalidRequestType),
        ({"top_k": True}, InvalidRequestType),
        ({"embed": "max"}, InvalidRequest),
        ({"embed": 1}, InvalidRequest),
        ({"normalize": True}, InvalidRequest),
        ({"prompt_logprobs": 1}, InvalidRequestType),
        ({"return_kv": "yes"}, InvalidRequestType),
        ({"prompt_top_k": True, "top_k": 2}, InvalidRequest),
        ({"prompt_top_k": True, "prompt_logprobs": True}, InvalidRequest),
        ({"prompt_top_k": 1, "prompt_logprobs": True, "top_k": 2}, InvalidRequestType),
    ],
)
async def test_bad_options_are_refused_before_anything_is_queued(opts, error):
    async with Engine(EngineConfig(model=sim())) as engine:
        with pytest.raises(error):
            await engine.prefill([1, 2, 3], **opts)
        assert engine.stats().submitted == 0
        assert engine._kv.used_bytes == engine._kv.pooled_bytes  # closed, kept for reuse
        r = await engine.prefill([1, 2, 3], top_k=32000)  # the whole vocabulary is allowed
    assert len(r.top_k_ids) == 32000 and len(set(r.top_k_ids.tolist())) == 32000


async def test_bad_label_token_ids_are_refused_naming_the_field():
    bad = [
        ([], InvalidRequest),
        (list(range(33)), InvalidRequest),
        ([32000], InvalidRequest),
        ([-1], InvalidRequest),
        ([1.0], InvalidRequestType),
        ([True], InvalidRequestType),
        (5, InvalidRequestType),
        (np.zeros((1, 2), np.int32), InvalidRequestType),
    ]
    async with Engine(EngineConfig(model=sim())) as engine:
        for labels, error in bad:
            with pytest.raises(error, match="label_token_ids"):
                await engine.prefill([1, 2, 3], label_token_ids=labels)
        assert engine.stats().submitted == 0
        r = await engine.prefill([1, 2, 3], label_token_ids=np.arange(32, dtype=np.int64))
    assert r.label_logprobs.shape == (32,)


async def test_results_too_big_for_the_ring_arrive_through_a_segment():
    """64 requests x the whole vocabulary of top-k is ~16 MB: far past a 1 MiB ring."""
    prompts = [[i + 1, 2, 3] for i in range(64)]
    config = EngineConfig(model=sim(fixed_ms=20.0), ring_capacity=1 << 20)
    async with Engine(config) as engine:
        results = await asyncio.gather(*(engine.prefill(p, top_k=32000) for p in prompts))
        small = await engine.prefill([5, 6], top_k=2)
        assert engine.stats().protocol_errors == 0
    for r, p in zip(results, prompts, strict=True):
        ids, lps = sim_top_k(p, 32000)
        assert np.array_equal(r.top_k_ids, ids) and np.array_equal(r.top_k_logprobs, lps)
    assert np.array_equal(small.top_k_ids, sim_top_k([5, 6], 2)[0])
