"""Top-k and prompt log-probabilities against Hugging Face, on every golden checkpoint of
tests/data/hf (Llama variants, Mistral, Qwen2, Qwen3, Mixtral), through the engine, chunked and
batched.

The goldens hold HF's greedy token t and its log-probability after each prompt p. So top-k's
first entry must be (t, that logprob), and the prompt log-probabilities of p + [t] must end with
that logprob: HF's value at a middle position of a longer prompt, through the chunked path."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, PaddleModel
from tests.hf.goldens import DATA, GOLDENS, expected

TOLERANCE = 1e-4


@pytest.mark.asyncio
@pytest.mark.parametrize("name", GOLDENS)
async def test_top_k_and_prompt_logprobs_match_hugging_face(name: str) -> None:
    exp = expected(name)
    # float32: the exact mode these goldens check (`auto` would compute llama_bf16 in bfloat16
    # on a CPU with bf16 units; tests/model/test_bf16.py checks that path)
    model = PaddleModel.from_pretrained(DATA / name, device="cpu", dtype="float32")
    prompts, tokens, logprobs = exp["prompts"], exp["tokens"], exp["logprobs"]
    # Prefix cache off: the scored prompts extend the ranked ones, so with the cache they would
    # read those blocks instead of running in chunks, which is what this test compares with HF
    # (a hit's exactness: tests/test_prefix_paddle.py).
    config = EngineConfig(model=model, max_batch_tokens=64, prefix_cache_bytes=0)
    async with Engine(config) as engine:
        ranked, scored = await asyncio.gather(
            asyncio.gather(*(engine.prefill(p, top_k=2) for p in prompts)),
            asyncio.gather(
                *(
                    engine.prefill([*p, t], prompt_logprobs=True)
                    for p, t in zip(prompts, tokens, strict=True)
                )
            ),
        )
    assert any(r.num_chunks > 1 for r in scored)
    for r, s, p, t, lp in zip(ranked, scored, prompts, tokens, logprobs, strict=True):
        assert r.top_k_ids[0] == t and r.token == t, name
        assert abs(float(r.top_k_logprobs[0]) - lp) <= TOLERANCE, name
        assert r.top_k_logprobs[1] < r.top_k_logprobs[0]
        assert s.prompt_logprobs.shape == (len(p),) and s.prompt_logprobs.dtype == np.float32
        assert abs(float(s.prompt_logprobs[-1]) - lp) <= TOLERANCE, name
