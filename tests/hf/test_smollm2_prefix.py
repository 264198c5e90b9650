"""The prefix cache on the real SmolLM2-135M (runner level): a hit on a real prompt's cached
blocks answers what the whole prompt computed from scratch answers (every output: the token
and its logprob, top-k, prompt logprobs and prompt top-k at every position, mean embedding):
within float32 noise by default (5e-5 relative: what cache-off chunking moves them), bitwise
with deterministic=True; and the next token and prompt logprobs match transformers' goldens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from aioprefill import PaddleModel
from tests.hf.smollm2 import gguf_path, goldens
from tests.model.batches import make_batch
from tests.model.prefix import ALL, check_same, planned, with_options

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_smollm2_hit_equals_miss(deterministic: bool) -> None:
    from aioprefill.workers.paddle_runner import PaddleRunner

    spec = PaddleModel.from_pretrained(gguf_path(), device="cpu", deterministic=deterministic)
    runner = PaddleRunner(spec, prefix_cache_bytes=16 * 776_834, block_tokens=16)
    assert (runner.cache_blocks, runner.block_bytes) == (16, 776_834)
    case = max(goldens()["cases"], key=lambda c: len(c["ids"]))  # 126 tokens: 7 full blocks
    ids = np.asarray(case["ids"], dtype=np.int32)
    n = len(ids)

    def run(batch):
        out = runner.forward(with_options(batch, [ALL], [5]))
        return dataclasses.replace(out, request_ids=out.request_ids * 0)

    miss = run(make_batch([ids], ids=[1]))
    writer = run(planned(make_batch([ids], ids=[2]), [[]], [list(range(7))], [0]))
    hits = {
        "1 block": run(planned(make_batch([ids[16:]], ids=[3], starts=[16]), [[0]])),
        "7 blocks": run(planned(make_batch([ids[112:]], ids=[4], starts=[112]), [list(range(7))])),
    }
    for what, out in {"writer": writer, **hits}.items():
        # Default mode: |d| <= 5e-5 * max(1, |value|). The matrix products' row results move
        # with the number of rows (MKL): with the cache off, computing this prompt in two
        # chunks (cut at 16) moves its prompt logprobs (|value| up to ~15) by up to 2.4e-5
        # already. deterministic=True is bitwise.
        check_same(out, miss, bitwise=deterministic, what=what, relative=True, tol=5e-5)
        assert int(out.tokens[0]) == case["token"]
        assert len(out.prompt_logprobs) == n - 1
        np.testing.assert_allclose(out.prompt_logprobs, case["prompt_logprobs"], atol=1e-4)
