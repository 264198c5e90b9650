"""Tensor parallelism through real gloo collectives: two spawned rank processes, each holding
half of the model (column/row-parallel layers, vocab-parallel head), give the single-rank
runner's tokens and log-probabilities (|d| <= 1e-5) — whole prompts and chunked ones."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from aioprefill import protocol
from aioprefill.config import PaddleModel
from tests.model.batches import SMALL, runner, small
from tests.model.parallel_jobs import JOB, Job, Out, Step, decode_outs, forward
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow

TOL = 1e-5


def steps_for(spec: PaddleModel, seed: int) -> list[Step]:
    rng = np.random.default_rng(seed)
    print("seed", seed)

    def p(n: int) -> list[int]:
        return rng.integers(0, spec.vocab_size, n).tolist()

    long = p(150)
    prompt_lp, embed = protocol.OPT_PROMPT_LOGPROBS, protocol.OPT_EMBED_MEAN
    return [
        Step([p(n) for n in (1, 2, 7, 33, 100)], [0, 1, 2, 3, 4]),
        # output options: top-k and prompt logprobs join the ranks' vocabulary slices
        Step(
            [p(n) for n in (9, 40, 3)],
            [20, 21, 22],
            options=[prompt_lp, prompt_lp | embed, 0],
            top_k=[5, 0, 3],
        ),
        # a chunked prompt: its KV cache lives across forwards on every rank
        Step([long[:90], p(5)], [10, 11], starts=[0, 0], last=[False, True]),
        Step([long[90:], p(3)], [10, 12], starts=[90, 0], last=[True, True]),
    ]


def check_same(got: list[Out], want: list[Out]) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.ids == w.ids, f"step {step}"
        assert g.tokens == w.tokens, f"step {step}"
        assert g.top_k_ids == w.top_k_ids, f"step {step}"
        for name in ("logprobs", "top_k_logprobs", "prompt_logprobs", "embeddings"):
            a, b = getattr(g, name), getattr(w, name)
            assert len(a) == len(b), f"step {step}: {name}"
            diff = np.abs(np.subtract(a, b)).max(initial=0.0)
            assert diff <= TOL, f"step {step}: |d {name}| = {diff:.2e}"


@pytest.mark.parametrize(
    "spec",
    [
        SMALL,  # GQA: each rank keeps 2 query heads and the 1 KV head they read
        small(num_kv_heads=4, tie_word_embeddings=True, seed=8),  # MHA, head = embedding slice
        small(deterministic=True, seed=9),  # fixed row tiles still line up across ranks
        small(attention_bias=True, qk_norm=True, seed=12),  # biases split, per-head norms whole
    ],
    ids=["gqa", "mha-tied", "deterministic", "bias-qknorm"],
)
def test_tp2_matches_single_rank(spec: PaddleModel) -> None:
    steps = steps_for(spec, seed=spec.seed)
    job = Job(spec=spec, mode="tp", steps=[steps, steps])
    ranks = [decode_outs(r) for r in run_ranks(JOB, 2, msgspec.msgpack.encode(job))]
    single = runner(spec)
    want = [forward(single, s) for s in steps]
    check_same(ranks[0], want)
    check_same(ranks[1], want)  # every rank sees the gathered head's answer


def test_tp2_moe_matches_single_rank() -> None:
    """TP over a mixture of experts: every expert's w1/w3 rows and w2 columns are split."""
    spec = small(num_experts=4, num_experts_per_tok=2, seed=10)
    steps = steps_for(spec, seed=10)
    job = Job(spec=spec, mode="tp", steps=[steps, steps])
    ranks = [decode_outs(r) for r in run_ranks(JOB, 2, msgspec.msgpack.encode(job))]
    want = [forward(runner(spec), s) for s in steps]
    check_same(ranks[0], want)
