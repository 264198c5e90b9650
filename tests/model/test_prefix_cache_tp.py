"""The prefix cache under tensor parallelism: three spawned ranks (gloo), each caching its own
KV head of the same blocks, answer the same plan as one rank holding everything: blocks
written whole and across chunks, hits with every output option, piggyback in one batch."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from aioprefill.config import PaddleModel
from tests.model.batches import small
from tests.model.parallel_jobs import JOB, Job, Step, decode_outs, forward
from tests.model.prefix import ALL, LAST
from tests.model.test_tensor_parallel import check_same
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow

# 6 query heads and 3 KV heads of 16: one KV head per rank.
SPEC = small(
    hidden_size=96, num_heads=6, num_kv_heads=3, intermediate_size=192, vocab_size=513, seed=41
)
BUDGET = 32 * (4 * 16 * (2 * 2 * 3 * 16 + 96 + 42) + 2)  # 32 slots on one rank, more on each of 3


def steps(spec: PaddleModel) -> list[Step]:
    rng = np.random.default_rng(spec.seed)

    def p(n: int) -> list[int]:
        return rng.integers(0, spec.vocab_size, n).tolist()

    shared, long = p(48), p(70)
    a, b = shared + p(9), shared + p(5)
    opts = {"options": [ALL, LAST], "top_k": [4, 2]}
    return [
        # a writes its 3 blocks; b reads them in the same forward
        Step([a, b[48:]], [1, 2], starts=[0, 48], reads=[[], [0, 1, 2]],
             writes=[[0, 1, 2], []], first=[0, 0], **opts),
        # hits of one block and of all but the last token
        Step([a[16:], b[48:]], [3, 4], starts=[16, 48], reads=[[0], [0, 1, 2]],
             writes=[[], []], first=[0, 0], **opts),
        # a chunked prompt writes the blocks its chunks complete (block 1 straddles)
        Step([long[:20]], [5], last=[False], reads=[[]], writes=[[5]], first=[0],
             options=[ALL], top_k=[3]),
        Step([long[20:]], [5], starts=[20], reads=[[]], writes=[[6, 7, 8]], first=[1],
             options=[ALL], top_k=[3]),
        Step([long[64:] + p(3)], [9], starts=[64], reads=[[5, 6, 7, 8]], writes=[[]],
             first=[0], options=[ALL], top_k=[3]),
    ]  # fmt: skip


def test_tp3_cache_matches_single_rank() -> None:
    from aioprefill.workers.paddle.runner import PaddleRunner

    plan = steps(SPEC)
    job = Job(spec=SPEC, mode="tp", steps=[plan] * 3, prefix_cache_bytes=BUDGET)
    ranks = [decode_outs(r) for r in run_ranks(JOB, 3, msgspec.msgpack.encode(job))]
    single = PaddleRunner(SPEC, prefix_cache_bytes=BUDGET)
    assert single.cache_blocks == 32
    want = [forward(single, s) for s in plan]
    assert not any(w.error for w in want), [w.error for w in want]
    for got in ranks:
        check_same(got, want)
    # ... and the hit on chunk-written blocks equals the whole prompt computed from scratch
    prompt = plan[2].prompts[0] + plan[3].prompts[0][:44] + plan[4].prompts[0]
    assert len(prompt) == 73
    check_same(
        [want[4]], [forward(PaddleRunner(SPEC), Step([prompt], [9], options=[ALL], top_k=[3]))]
    )
