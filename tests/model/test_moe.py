"""The mixture-of-experts model: alone against a NumPy reference, and expert-parallel over two
spawned ranks (real gloo collectives) against the unsharded runner (|dlogprob| <= 1e-5),
including steps where one rank has no work or refuses its batch."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from aioprefill.hf.weights import expected_shapes, random_weights
from tests.model.batches import make_batch, prompts, runner, small
from tests.model.parallel_jobs import JOB, Job, Out, Step, decode_outs, forward
from tests.model.reference import greedy, moe_mlp
from tests.ranks import run_ranks

MOE = small(num_experts=4, num_experts_per_tok=2, seed=11)
TOL = 1e-5


def test_moe_weights_have_mixtral_names() -> None:
    shapes = expected_shapes(MOE)
    m = "model.layers.1.block_sparse_moe."
    assert shapes[m + "gate.weight"] == (4, MOE.hidden_size)
    assert shapes[m + "experts.3.w1.weight"] == (MOE.intermediate_size, MOE.hidden_size)
    assert shapes[m + "experts.3.w2.weight"] == (MOE.hidden_size, MOE.intermediate_size)
    assert not any("mlp." in name for name in shapes)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_moe_runner_matches_numpy_reference(top_k: int) -> None:
    spec = small(num_experts=4, num_experts_per_tok=top_k, seed=12 + top_k)
    rng = np.random.default_rng(top_k)
    ps = prompts(rng, [1, 5, 40], spec.vocab_size)
    out = runner(spec).forward(make_batch(ps))
    weights = random_weights(spec, spec.seed)
    for i, p in enumerate(ps):
        token, logprob = greedy(spec, weights, p, mlp=moe_mlp)
        assert int(out.tokens[i]) == token, f"prompt {i}"
        assert abs(float(out.logprobs[i]) - logprob) < 1e-4, f"prompt {i}"


def p(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, MOE.vocab_size, n).tolist()


@pytest.mark.slow
def test_ep2_matches_unsharded_moe() -> None:
    rng = np.random.default_rng(21)
    long = p(rng, 120)
    rank0 = [
        Step([p(rng, n) for n in (3, 60)], [0, 1]),
        Step([p(rng, 17)], [2]),  # rank 1 has nothing this step: it runs an empty batch
        Step([long[:70]], [3], starts=[0], last=[False]),  # chunked across EP steps
        Step([long[70:]], [3], starts=[70], last=[True]),
        Step([[MOE.vocab_size]], [4]),  # refused (out of vocabulary), still in step
    ]
    rank1 = [
        Step([p(rng, n) for n in (1, 8, 31)], [100, 101, 102]),
        Step([], []),
        Step([p(rng, 90)], [103]),
        Step([], []),
        Step([p(rng, 6)], [104]),
    ]
    job = Job(spec=MOE, mode="ep", steps=[rank0, rank1])
    got = [decode_outs(r) for r in run_ranks(JOB, 2, msgspec.msgpack.encode(job))]
    for rank, steps in enumerate((rank0, rank1)):
        for i, step in enumerate(steps):
            g: Out = got[rank][i]
            if not step.prompts:
                assert (g.ids, g.error) == ([], ""), f"rank {rank} step {i}"
                continue
            want = forward(runner(MOE), step)
            assert g.error == want.error, f"rank {rank} step {i}"
            assert (g.ids, g.tokens) == (want.ids, want.tokens), f"rank {rank} step {i}"
            diff = np.abs(np.subtract(g.logprobs, want.logprobs)).max(initial=0.0)
            assert diff <= TOL, f"rank {rank} step {i}: |dlogprob| = {diff:.2e}"
    assert "out of range" in got[0][4].error


def test_router_ties_go_to_the_lower_expert_id() -> None:
    """An exact tie at the k-th place is broken by expert id (torch.topk leaves it to its
    kernel), the same for every row, and the kept weights are renormalised."""
    import paddle

    from aioprefill.workers.paddle.moe import MoE

    hidden = MOE.hidden_size
    router = np.ones((4, hidden), dtype=np.float32)
    router[2] *= 2.0  # expert 2 first; experts 0, 1 and 3 tie for second place
    moe = MoE({"router": router}, MOE, paddle.to_tensor)
    h = paddle.to_tensor(np.full((5, hidden), 0.01, dtype=np.float32))
    chosen, weights = moe.route(h)
    assert chosen.tolist() == [[2, 0]] * 5
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-6)
    assert (weights[:, 0] > weights[:, 1]).all()
