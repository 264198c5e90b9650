"""PaddleRunner against the independent float64 NumPy forward of the same Llama
(`tests/model/reference.py`: it shares nothing with the runner but the weights)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aioprefill.config import PaddleModel
from aioprefill.hf.weights import random_weights
from aioprefill.workers.paddle import runner as paddle_runner
from aioprefill.workers.paddle.runner import PaddleRunner
from tests.model.batches import SMALL, make_batch, prompts, runner, small
from tests.model.reference import greedy


def check_against_reference(spec: PaddleModel, lengths: list[int], seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    ps = prompts(rng, lengths, spec.vocab_size)
    out = runner(spec).forward(make_batch(ps))
    weights = random_weights(spec, spec.seed)
    assert out.request_ids.tolist() == list(range(len(ps)))
    for i, p in enumerate(ps):
        token, logprob = greedy(spec, weights, p)
        assert int(out.tokens[i]) == token, f"prompt {i} (length {len(p)})"
        assert abs(float(out.logprobs[i]) - logprob) < 1e-4, f"prompt {i} (length {len(p)})"


@pytest.mark.parametrize(
    "spec",
    [
        SMALL,
        small(num_kv_heads=4, seed=4),  # plain multi-head attention
        small(num_kv_heads=1, seed=5),  # multi-query
        small(tie_word_embeddings=True, rope_theta=500000.0, seed=6),
    ],
    ids=["gqa", "mha", "mqa", "tied"],
)
def test_small_models_match_reference(spec: PaddleModel) -> None:
    check_against_reference(spec, [1, 2, 7, 33, 100])


def test_default_tiny_model_matches_reference() -> None:
    check_against_reference(PaddleModel(seed=0), [3, 40], seed=1)


def test_long_prompt_in_query_blocks_matches_reference(monkeypatch) -> None:
    # Force attention into tiles of a few query rows, each reading only the keys it can see.
    monkeypatch.setattr(paddle_runner, "_ATTN_TILE", 7)
    spec = small(seed=7)
    check_against_reference(spec, [300, 5], seed=2)


def test_reference_imports_nothing_from_aioprefill() -> None:
    """The reference stays independent: importing it loads no aioprefill module at all."""
    code = (
        "import sys, tests.model.reference\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'aioprefill'])"
    )
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_result_fields_and_dtypes() -> None:
    out = runner(SMALL).forward(make_batch([np.array([1, 2, 3])], ids=[41]))
    assert out.request_ids.dtype == np.int64 and out.request_ids.tolist() == [41]
    assert out.tokens.dtype == np.int32 and 0 <= int(out.tokens[0]) < SMALL.vocab_size
    assert out.logprobs.dtype == np.float64 and -np.log(SMALL.vocab_size) - 5 < out.logprobs[0] < 0


def test_cpu_runner_reports_its_device() -> None:
    assert PaddleRunner(small(device="cpu")).device == "cpu"
