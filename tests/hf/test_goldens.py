"""Hugging Face checkpoints through the real engine: every golden checkpoint (Llama with llama3 /
linear RoPE, theta and eps, explicit head_dim, tied with a stored lm_head, bf16, sharded; Mistral
with a sliding window; Qwen2 with q/k/v bias; Qwen3 with q/k norms; Mixtral's mixture of experts,
sharded) gives HF's greedy token on every prompt and its log-probability within 1e-4, batched
(and chunked) and solo."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, InvalidRequest, PaddleModel
from tests.hf.goldens import DATA, GOLDENS, expected

TOLERANCE = 1e-4


def test_every_setting_has_a_golden() -> None:
    assert set(GOLDENS) == {
        "llama3_rope",
        "llama_bf16",
        "llama_head_dim_tied",
        "llama_linear_sharded",
        "llama_theta_eps",
        "mistral_window",
        "mixtral_moe",
        "qwen2_bias",
        "qwen3_qk_norm",
    }


def check(name: str, results, exp: dict) -> None:
    tokens = [r.token for r in results]
    assert tokens == exp["tokens"], name
    worst = max(abs(r.logprob - lp) for r, lp in zip(results, exp["logprobs"], strict=True))
    assert worst <= TOLERANCE, f"{name}: |dlogprob| {worst:.2e}"


@pytest.mark.asyncio
@pytest.mark.parametrize("name", GOLDENS)
async def test_golden_through_the_engine(name: str) -> None:
    exp = expected(name)
    model = PaddleModel.from_pretrained(DATA / name, device="cpu", dtype="float32")
    # max_batch_tokens=64: the longer prompts ride in chunks, beside short ones.
    config = EngineConfig(model=model, max_batch_tokens=64)
    async with Engine(config) as engine:
        together = await asyncio.gather(*(engine.prefill(p) for p in exp["prompts"]))
        solo = [await engine.prefill(p) for p in exp["prompts"]]
    assert max(r.batch_size for r in together) > 1
    assert any(r.num_chunks > 1 for r in together)
    check(name, together, exp)
    check(name, solo, exp)


def _runner_logprobs(spec: PaddleModel, prompts: list[list[int]]) -> np.ndarray:
    from aioprefill.workers.paddle.runner import PaddleRunner
    from tests.model.batches import make_batch

    out = PaddleRunner(spec).forward(make_batch([np.asarray(p) for p in prompts]))
    return out.logprobs


@pytest.mark.parametrize(
    "name, wrong",
    [
        ("llama3_rope", {"rope_type": "default"}),
        ("llama_theta_eps", {"rope_theta": 10000.0}),
        ("llama_theta_eps", {"rms_norm_eps": 1e-6}),
        ("llama_linear_sharded", {"rope_type": "default"}),
        ("mixtral_moe", {"num_experts_per_tok": 1}),
        ("mixtral_moe", {"rms_norm_eps": 1e-6}),
        ("mixtral_moe", {"rope_theta": 10000.0}),
    ],
)
def test_goldens_notice_a_wrong_setting(name: str, wrong: dict) -> None:
    """The goldens are sharp: the setting config.json carries, dropped, moves the logprobs."""
    exp = expected(name)
    spec = msgspec.structs.replace(
        PaddleModel.from_pretrained(DATA / name, dtype="float32"), **wrong
    )
    logprobs = _runner_logprobs(spec, exp["prompts"])
    assert np.abs(logprobs - np.asarray(exp["logprobs"])).max() > 10 * TOLERANCE


@pytest.mark.asyncio
async def test_mistral_prompts_past_the_window_are_refused() -> None:
    model = PaddleModel.from_pretrained(DATA / "mistral_window")
    assert model.sliding_window == 128
    async with Engine(EngineConfig(model=model)) as engine:
        assert engine.config.max_prompt_tokens == 128
        with pytest.raises(InvalidRequest, match="128"):
            await engine.prefill(list(range(129)))
        r = await engine.prefill(list(range(128)))  # the window itself is fine
    assert 0 <= r.token < model.vocab_size


@pytest.mark.parametrize("name", ["qwen2_bias", "qwen3_qk_norm"])
def test_deterministic_mode_stays_bitwise_with_bias_and_qk_norm(name: str) -> None:
    from aioprefill.workers.paddle.runner import PaddleRunner
    from tests.model.batches import make_batch

    prompts = [np.asarray(p) for p in expected(name)["prompts"]]
    runner = PaddleRunner(
        PaddleModel.from_pretrained(DATA / name, deterministic=True, dtype="float32")
    )
    together = runner.forward(make_batch(prompts))
    for i, p in enumerate(prompts):
        alone = runner.forward(make_batch([p]))
        assert alone.tokens[0] == together.tokens[i]
        assert alone.logprobs[0] == together.logprobs[i]


def test_runner_refuses_positions_past_the_window() -> None:
    from aioprefill.workers.paddle.runner import PaddleRunner
    from tests.model.batches import make_batch

    runner = PaddleRunner(PaddleModel.from_pretrained(DATA / "mistral_window"))
    with pytest.raises(ValueError, match="position 129 past the model's 128"):
        runner.forward(make_batch([np.arange(129)]))
