"""The runner on a CUDA device (paddlepaddle-gpu); skipped where paddle has no CUDA."""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0,
        reason="needs paddlepaddle-gpu and a CUDA device",
    ),
]

from aioprefill.hf.weights import random_weights  # noqa: E402
from aioprefill.workers.paddle.runner import PaddleRunner  # noqa: E402
from tests.model.batches import SMALL, make_batch, prompts, small  # noqa: E402
from tests.model.reference import greedy  # noqa: E402
from tests.model.test_batch_invariance import compare_compositions  # noqa: E402


def test_auto_device_picks_the_gpu_per_worker() -> None:
    count = paddle.device.cuda.device_count()
    assert PaddleRunner(SMALL).device == "gpu:0"
    assert PaddleRunner(SMALL, worker_index=count + 1).device == f"gpu:{1 % count}"
    assert PaddleRunner(small(device="cpu")).device == "cpu"


def test_gpu_matches_reference() -> None:
    spec = small(device="gpu")
    ps = prompts(np.random.default_rng(0), [1, 9, 64], spec.vocab_size)
    out = PaddleRunner(spec).forward(make_batch(ps))
    weights = random_weights(spec, spec.seed)
    for i, p in enumerate(ps):
        token, logprob = greedy(spec, weights, p)
        assert int(out.tokens[i]) == token
        assert abs(float(out.logprobs[i]) - logprob) < 1e-4


def test_gpu_batch_invariance() -> None:
    runner = PaddleRunner(small(device="gpu"))
    compare_compositions(runner, SMALL.vocab_size, trials=20, max_len=120, bitwise=False)


def test_gpu_deterministic_is_bitwise() -> None:
    runner = PaddleRunner(small(device="gpu", deterministic=True))
    compare_compositions(runner, SMALL.vocab_size, trials=20, max_len=120, bitwise=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_half_precision_runs(dtype: str) -> None:
    ps = prompts(np.random.default_rng(1), [5, 40], SMALL.vocab_size)
    full = PaddleRunner(small(device="gpu")).forward(make_batch(ps))
    half = PaddleRunner(small(device="gpu", dtype=dtype)).forward(make_batch(ps))
    assert np.all(np.isfinite(half.logprobs))
    assert np.abs(half.logprobs - full.logprobs).max() < 0.1
