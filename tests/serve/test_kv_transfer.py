"""vllm-router's PD mode against the server: a completion that carries `kv_transfer_params`
answers with its KV export's transfer params, which a decode process (`pull_kv`, no Engine)
pulls through Mooncake; a completion without them answers without. Runs where the engine has
KV transfer (`aioprefill.transfer`, Mooncake installed)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.serve.util import HF, serve
from tests.transfer.util import needs_mooncake

pytestmark = [
    pytest.mark.slow,
    needs_mooncake,
]


def test_prefill_answers_with_kv_transfer_params_a_decode_side_can_pull():
    from aioprefill.transfer import pull_kv, release_kv

    flags = ["--model", str(HF / "llama_bf16"), "--kv-transfer", "mooncake", "--dtype", "float32"]
    with serve(*flags) as server:
        prompt = [5, 6, 7, 8, 9]
        body = {
            "prompt": prompt,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        assert isinstance(params, dict) and params
        kv = pull_kv(params)
        keys, values = np.asarray(kv.keys), np.asarray(kv.values)
        assert keys.shape == values.shape == (2, 2, len(prompt), 16)  # layers, kv heads, n, dim
        assert np.isfinite(keys).all() and np.abs(keys).sum() > 0
        release_kv(params)
        plain = httpx.post(server.url + "/v1/completions", json={"prompt": prompt}).json()
        assert "kv_transfer_params" not in plain
