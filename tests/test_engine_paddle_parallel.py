"""PaddleModel through the whole engine with rank groups: a tensor-parallel group of 2 and an
expert-parallel MoE over 2 ranks answer like one unsharded worker (tokens equal, |dlogprob|
<= 1e-5), including a chunked prompt; a Mixtral checkpoint, expert-parallel, answers like
Hugging Face (its golden); and KV exports from rank groups equal a lone worker's."""

from __future__ import annotations

import asyncio
import random

import msgspec
import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, PaddleModel
from tests.hf.goldens import DATA, expected
from tests.model.batches import SMALL

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


def prompts(seed: int) -> list[list[int]]:
    print("seed", seed)
    rng = random.Random(seed)
    short = [[rng.randrange(512) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    return [*short, [rng.randrange(512) for _ in range(150)]]  # chunked at 64 tokens


async def answers(model: PaddleModel, batch: list[list[int]], **cfg) -> list[tuple[int, float]]:
    config = EngineConfig(model=model, max_batch_tokens=64, **cfg)
    async with Engine(config) as engine:
        results = await asyncio.gather(*(engine.prefill(p) for p in batch))
    return [(r.token, r.logprob) for r in results]


def same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) <= 1e-5


async def test_tp2_group_answers_like_one_worker(capfd: pytest.CaptureFixture[str]):
    batch = prompts(random.randrange(1 << 20))
    same(await answers(SMALL, batch, tp_size=2), await answers(SMALL, batch))
    # The ranks' TCP store says nothing on the host's stderr (Paddle's glog INFO lines).
    assert "tcp_store" not in capfd.readouterr().err


async def test_ep2_moe_answers_like_the_unsharded_moe():
    model = msgspec.structs.replace(SMALL, num_experts=4, num_experts_per_tok=2, seed=5)
    batch = prompts(random.randrange(1 << 20))
    got = await answers(model, batch, num_workers=2, expert_parallel=True)
    same(got, await answers(model, batch))


async def test_ep2_mixtral_checkpoint_answers_like_hugging_face():
    """Each rank loads half of the checkpoint's experts (the shards split a layer's experts
    across files); the golden's prompts, chunked at 64 tokens, get HF's tokens and logprobs."""
    exp = expected("mixtral_moe")
    model = PaddleModel.from_pretrained(DATA / "mixtral_moe", device="cpu")
    config = EngineConfig(model=model, max_batch_tokens=64, num_workers=2, expert_parallel=True)
    async with Engine(config) as engine:
        results = await asyncio.gather(*(engine.prefill(p) for p in exp["prompts"]))
    assert any(r.num_chunks > 1 for r in results)
    assert {r.worker for r in results} == {0, 1}  # both ranks computed some prompts
    assert [r.token for r in results] == exp["tokens"]
    worst = max(abs(r.logprob - lp) for r, lp in zip(results, exp["logprobs"], strict=True))
    assert worst <= 1e-4, f"|dlogprob| {worst:.2e}"


# ---------------------------------------------------------------- KV export from rank groups


async def exports(model: PaddleModel, batch: list[list[int]], **cfg) -> list[tuple]:
    """(token, logprob, keys, values) per prompt; every other prompt asks for its KV (the rest
    pay no KV collective), chunked at 24 tokens so a long prompt's past comes from the cache."""
    config = EngineConfig(model=model, max_batch_tokens=24, **cfg)
    async with Engine(config) as engine:
        rs = await asyncio.gather(
            *(engine.prefill(p, return_kv=i % 2 == 0) for i, p in enumerate(batch))
        )
        assert max(r.num_chunks for r in rs) > 1
        out = []
        for r in rs:
            if r.kv is None:
                out.append((r.token, r.logprob, None, None))
                continue
            with r.kv as kv:
                out.append((r.token, r.logprob, kv.keys.copy(), kv.values.copy()))
    return out


def same_kv(got: list[tuple], want: list[tuple], model: PaddleModel) -> None:
    same([(t, lp) for t, lp, _, _ in got], [(t, lp) for t, lp, _, _ in want])
    for i, ((_, _, gk, gv), (_, _, wk, wv)) in enumerate(zip(got, want, strict=True)):
        if wk is None:
            assert gk is None
            continue
        assert gk.shape == wk.shape == (model.num_layers, model.num_kv_heads, wk.shape[2], 16)
        for name, a, b in (("keys", gk, wk), ("values", gv, wv)):
            # every layer and every KV head: a rank's slice, not its one head broadcast
            diff = np.abs(a - b).max(axis=(2, 3))
            assert diff.max() <= 1e-5, f"prompt {i} {name}: |d| per [layer, head] {diff}"


def kv_prompts(seed: int) -> list[list[int]]:
    print("seed", seed)
    rng = random.Random(seed)
    short = [[rng.randrange(512) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    return [[rng.randrange(512) for _ in range(61)], *short]  # 3 chunks of <= 24 tokens


@pytest.mark.parametrize(
    "model",
    [SMALL, msgspec.structs.replace(SMALL, num_kv_heads=4, seed=8)],
    ids=["1-kv-head-per-rank", "2-kv-heads-per-rank"],
)
async def test_tp2_kv_export_matches_one_worker(model: PaddleModel):
    batch = kv_prompts(random.randrange(1 << 20))
    same_kv(await exports(model, batch, tp_size=2), await exports(model, batch), model)


async def test_ep2_kv_export_matches_the_unsharded_moe():
    """Under expert parallelism each rank runs its own requests with every KV head."""
    model = msgspec.structs.replace(SMALL, num_experts=4, num_experts_per_tok=2, seed=5)
    batch = kv_prompts(random.randrange(1 << 20))
    got = await exports(model, batch, num_workers=2, expert_parallel=True)
    same_kv(got, await exports(model, batch), model)
