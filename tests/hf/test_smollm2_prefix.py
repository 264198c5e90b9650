"""The prefix cache on the real SmolLM2-135M (runner level): a hit on a real prompt's cached
blocks answers what the whole prompt computed from scratch answers (every output: the token
and its logprob, top-k, prompt logprobs and prompt top-k at every position, mean embedding and
the returned KV): within 1e-5 by default (every product has >= 64 rows and attention runs on
tiles of absolute positions: bitwise on the machines measured,
benchmarks/results/prefix/hit_exact.txt),
bitwise with deterministic=True; and the next token and prompt logprobs match transformers'
goldens. The same holds for the prompt computed in chunks with the cache off."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import numpy as np
import pytest

from aioprefill import PaddleModel
from aioprefill.shm.segments import SHM_DIR, attach_segment, segment_name
from aioprefill.wire import protocol
from aioprefill.wire.kv import kv_layout
from tests.hf.smollm2 import gguf_path, goldens
from tests.model.batches import make_batch
from tests.model.prefix import ALL, check_same, concat_outputs, planned, with_options

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_smollm2_hit_equals_miss(deterministic: bool) -> None:
    from aioprefill.workers.paddle.runner import PaddleRunner

    spec = PaddleModel.from_pretrained(gguf_path(), device="cpu", deterministic=deterministic)
    runner = PaddleRunner(spec, prefix_cache_bytes=16 * 776_834, block_tokens=16)
    assert (runner.cache_blocks, runner.block_bytes) == (16, 776_834)
    case = max(goldens()["cases"], key=lambda c: len(c["ids"]))  # 126 tokens: 7 full blocks
    ids = np.asarray(case["ids"], dtype=np.int32)
    n = len(ids)
    layout = kv_layout(spec)
    rid = itertools.count(1)
    names: list[str] = []
    labels = [case["token"], *case["top_k_ids"][1:], 0, 49151]  # the greedy token first

    def run(chunks, plans=None):
        """One request in chunks ((tokens, start)) with plans (reads, writes, first): the joined
        outputs (request id 0) and the KV it returned [layers, kv_heads, tokens, dim] x 2."""
        r, outs = next(rid), []
        names.append(segment_name("kv.smollm2-hit"))
        for j, (tokens, start) in enumerate(chunks):
            last = j == len(chunks) - 1
            opts = ALL | (protocol.OPT_RETURN_KV if last else 0)
            batch = make_batch([tokens], ids=[r], starts=[start], last=[last])
            batch = with_options(batch, [opts], [5], names[-1:] if last else (), labels=labels)
            if plans is not None:
                batch = planned(batch, [plans[j][0]], [plans[j][1]], [plans[j][2]])
            outs.append(runner.forward(batch))
        out = concat_outputs(outs)
        mm = attach_segment(names[-1])
        kv = [a.copy() for a in layout.views(mm, chunks[-1][1] + len(chunks[-1][0]))]
        mm.close()
        return dataclasses.replace(out, request_ids=out.request_ids * 0), kv

    def same(got, want, what: str) -> None:
        # Default mode: |d| <= 1e-5 (absolute) for every output, prompt logprobs of magnitude
        # up to ~15 included. deterministic=True is bitwise.
        check_same(got[0], want[0], bitwise=deterministic, what=what, tol=1e-5)
        for x, y in zip(got[1], want[1], strict=True):
            if deterministic:
                assert np.array_equal(x, y), f"{what} kv"
            else:
                assert np.abs(x - y).max() <= 1e-5, f"{what} kv"

    try:
        miss = run([(ids, 0)])
        seven = list(range(7))
        hits = {
            "writer": run([(ids, 0)], [([], seven, 0)]),
            "1 block": run([(ids[16:], 16)], [([0], [], 0)]),
            "7 blocks": run([(ids[112:], 112)], [(seven, [], 0)]),
            "cache off, chunks": run([(ids[:40], 0), (ids[40:47], 40), (ids[47:], 47)]),
        }
        for what, out in hits.items():
            same(out, miss, what)
            assert int(out[0].tokens[0]) == case["token"]
            assert len(out[0].prompt_logprobs) == n - 1
            np.testing.assert_allclose(out[0].prompt_logprobs, case["prompt_logprobs"], atol=1e-4)
            # label logprobs: the greedy token's is its logprob; the top-k's are transformers'
            assert out[0].label_logprobs[0] == np.float32(out[0].logprobs[0])
            k = len(case["top_k_ids"])
            got = out[0].label_logprobs[:k]
            np.testing.assert_allclose(got, case["top_k_logprobs"], atol=1e-4)
        # All but the last token: a 113-token prompt reads its 7 blocks and computes one token.
        same(run([(ids[112:113], 112)], [(seven, [], 0)]), run([(ids[:113], 0)]), "all but 1")
    finally:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()
