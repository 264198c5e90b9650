"""Output options with real Paddle workers through the whole engine: every option (prompt top-k
included) against the float64 NumPy reference, batched and chunked, and a decode step from the
exported KV alone."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig
from aioprefill.hf.weights import random_weights
from tests.model.batches import SMALL
from tests.model.reference import as64, decode_logits, full

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("max_batch_tokens", [4096, 24], ids=["whole", "chunked"])
async def test_every_option_through_the_engine_matches_the_reference(max_batch_tokens: int):
    seed = random.randrange(1 << 20)
    print("seed", seed)
    rng = random.Random(seed)
    ps = [[rng.randrange(512) for _ in range(rng.randrange(2, 70))] for _ in range(12)]
    ts = [rng.randrange(512) for _ in ps]
    w64 = as64(random_weights(SMALL, SMALL.seed))
    config = EngineConfig(model=SMALL, max_batch_tokens=max_batch_tokens)
    async with Engine(config) as engine:
        rs = await asyncio.gather(
            *(
                engine.prefill(
                    p,
                    prompt_logprobs=True,
                    top_k=4,
                    prompt_top_k=i % 4 == 1,
                    embed="mean" if i % 2 else "last",
                    normalize=i % 3 == 0,
                    return_kv=i % 2 == 0,
                )
                for i, p in enumerate(ps)
            ),
            *(engine.prefill([*p, t], top_k=SMALL.vocab_size) for p, t in zip(ps, ts, strict=True)),
        )
        # Chunked, every batch may be one 24-token chunk alone (it depends on the seed's prompt
        # lengths), so only the whole-prompt run is sure to batch.
        if max_batch_tokens == 24:
            assert max(r.num_chunks for r in rs) > 1
        else:
            assert max(r.batch_size for r in rs) > 1
        for i, (p, t) in enumerate(zip(ps, ts, strict=True)):
            r, extended = rs[i], rs[len(ps) + i]
            ref = full(SMALL, w64, np.asarray(p))
            np.testing.assert_allclose(
                r.prompt_logprobs, ref.prompt_logprobs(np.asarray(p)), atol=1e-4
            )
            top = np.sort(ref.log_probs[-1])[::-1][:4]
            np.testing.assert_allclose(r.top_k_logprobs, top, atol=1e-4)
            if i % 4 == 1:  # the top-4 at every prompt position too
                assert r.prompt_top_k_ids.shape == (len(p) - 1, 4)
                tops = np.sort(ref.log_probs[:-1], axis=-1)[:, ::-1][:, :4]
                np.testing.assert_allclose(r.prompt_top_k_logprobs, tops, atol=1e-4)
                picked = np.take_along_axis(ref.log_probs[:-1], r.prompt_top_k_ids, axis=-1)
                np.testing.assert_allclose(r.prompt_top_k_logprobs, picked, atol=1e-4)
            else:
                assert r.prompt_top_k_ids is None
            want = ref.hidden.mean(axis=0) if i % 2 else ref.hidden[-1]
            if i % 3 == 0:
                want = want / np.linalg.norm(want)
            np.testing.assert_allclose(r.embedding, want, atol=1e-4)
            if i % 2:
                assert r.kv is None
                continue
            with r.kv as kv:
                logits = decode_logits(
                    SMALL, w64, kv.keys.astype(np.float64), kv.values.astype(np.float64), t
                )
            m = logits.max()
            decoded = logits - m - np.log(np.exp(logits - m).sum())
            prefilled = np.empty(SMALL.vocab_size)
            prefilled[extended.top_k_ids] = extended.top_k_logprobs
            assert np.abs(decoded - prefilled).max() <= 1e-4
        assert engine._kv.used_bytes == engine._kv.pooled_bytes  # closed, kept for reuse
