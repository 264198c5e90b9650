"""Verified by decoding: a real checkpoint's KV (tests/data/hf/llama_theta_eps, through
PaddleModel.from_pretrained) pulled by another process with `pull_kv(params)` alone equals the
local export bit for bit and the float64 reference's K/V, and one decode step that reads only
the pulled KV gives the next-token logits of a full prefill of prompt + token (the float64
reference's and the engine's own), whole and chunked prompts. transformers' own
`past_key_values` and decode-step logits for the same prompts (kv_golden.npz, made by
benchmarks/tools/make_kv_goldens.py) are checked too."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

from tests.transfer.util import ROOT, need_mooncake, registered

need_mooncake()

from safetensors.numpy import load_file  # noqa: E402

from aioprefill import Engine, EngineConfig, PaddleModel  # noqa: E402
from tests.hf.goldens import DATA, expected  # noqa: E402
from tests.model.reference import as64, decode_logits, full  # noqa: E402

NAME = "llama_theta_eps"
TOLERANCE = 1e-4


async def _pull_elsewhere(params: dict, out) -> np.ndarray:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.transfer.children",
        "pull",
        str(out),
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await proc.communicate(json.dumps(params).encode())
    assert proc.returncode == 0, stderr.decode()[-2000:]
    return np.load(out)


@pytest.mark.asyncio
async def test_pulled_kv_of_a_real_checkpoint_decodes_like_a_full_prefill(tmp_path):
    model = PaddleModel.from_pretrained(DATA / NAME, device="cpu")
    w64 = as64(load_file(str(DATA / NAME / "model.safetensors")))
    ps = expected(NAME)["prompts"]
    prompts = [ps[2], ps[5], max(ps, key=len)]  # as benchmarks/tools/make_kv_goldens.py
    hf = np.load(DATA / NAME / "kv_golden.npz")
    config = EngineConfig(model=model, kv_transfer="mooncake", max_batch_tokens=16)
    async with Engine(config) as engine:
        rs = await asyncio.gather(*(engine.prefill(p, return_kv=True) for p in prompts))
        assert any(r.num_chunks > 1 for r in rs)  # a chunked prompt's export too
        extended = await asyncio.gather(
            *(
                engine.prefill([*p, r.token], top_k=model.vocab_size)
                for p, r in zip(prompts, rs, strict=True)
            )
        )
        for i, (p, r, ext) in enumerate(zip(prompts, rs, extended, strict=True)):
            pulled = await _pull_elsewhere(r.kv.transfer_params(), tmp_path / f"{i}.npy")
            keys, values = pulled[0], pulled[1]
            assert np.array_equal(keys, r.kv.keys) and np.array_equal(values, r.kv.values)
            r.kv.close()  # the decode node has its copy
            ref = full(model, w64, np.asarray(p))
            assert r.token == int(hf[f"token_{i}"])
            for got, want in (
                (keys, ref.keys),
                (values, ref.values),
                (keys, hf[f"keys_{i}"]),
                (values, hf[f"values_{i}"]),
            ):
                scale = np.abs(want).max()
                assert np.abs(got - want).max() <= TOLERANCE * scale
            logits = decode_logits(
                model, w64, keys.astype(np.float64), values.astype(np.float64), r.token
            )
            for want in (full(model, w64, np.asarray([*p, r.token])).logits[-1], hf[f"logits_{i}"]):
                assert np.abs(logits - want).max() <= TOLERANCE * np.abs(want).max()
            m = logits.max()
            decoded = logits - m - np.log(np.exp(logits - m).sum())
            prefilled = np.empty(model.vocab_size)
            prefilled[ext.top_k_ids] = ext.top_k_logprobs
            assert np.abs(decoded - prefilled).max() <= TOLERANCE
        assert registered(engine) == 0
