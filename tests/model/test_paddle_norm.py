"""RMSNorm kernels of the Paddle worker: the composed one (CPUs without AVX-512) against a
float64 reference and against itself batched, and the choice between it and Paddle's fused one."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from aioprefill.workers.paddle import norm as paddle_norm
from aioprefill.workers.paddle.env import cpu_has_avx512f


def reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (3, 5, 64), (33, 250)])
def test_composed_matches_float64_reference(shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(np.float32) * 3
    w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
    out = paddle_norm.composed_rms_norm(paddle.to_tensor(x), paddle.to_tensor(w), 1e-5)
    assert out.shape == list(shape) and out.dtype == paddle.float32
    np.testing.assert_allclose(out.numpy(), reference(x, w, 1e-5), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("heads", [None, 6])
def test_composed_rows_do_not_depend_on_their_batch(heads):
    # Every row range, so rows land in SIMD lanes and scalar tails (where paddle's vectorised
    # rsqrt gave other bits).
    rng = np.random.default_rng(1)
    x = rng.standard_normal((41, 128) if heads is None else (heads, 41, 128)).astype(np.float32)
    w = paddle.to_tensor(rng.uniform(0.5, 1.5, 128).astype(np.float32))
    whole = paddle_norm.composed_rms_norm(paddle.to_tensor(x), w, 1e-6).numpy()
    for a in range(0, 41, 3):
        for b in range(a + 1, 42, 5):
            rows = x[a:b] if heads is None else x[:, a:b]
            part = paddle_norm.composed_rms_norm(paddle.to_tensor(rows), w, 1e-6).numpy()
            assert np.array_equal(part, whole[a:b] if heads is None else whole[:, a:b]), (a, b)


def test_the_fused_kernel_only_where_the_cpu_can_run_it(monkeypatch):
    assert paddle_norm.rms_norm_for("gpu:0") is paddle_norm.fused_rms_norm_last_axis
    monkeypatch.setattr(paddle_norm, "cpu_has_avx512f", lambda: False)
    assert paddle_norm.rms_norm_for("cpu") is paddle_norm.composed_rms_norm
    monkeypatch.setattr(paddle_norm, "cpu_has_avx512f", lambda: True)
    assert paddle_norm.rms_norm_for("cpu") is paddle_norm.fused_rms_norm_last_axis


@pytest.mark.skipif(not cpu_has_avx512f(), reason="Paddle's fused CPU kernel needs AVX-512")
def test_fused_and_composed_agree():
    rng = np.random.default_rng(2)
    x = paddle.to_tensor(rng.standard_normal((9, 4, 64)).astype(np.float32))
    w = paddle.to_tensor(rng.uniform(0.5, 1.5, 64).astype(np.float32))
    fused = paddle_norm.fused_rms_norm_last_axis(x, w, 1e-6).numpy()
    composed = paddle_norm.composed_rms_norm(x, w, 1e-6).numpy()
    np.testing.assert_allclose(fused, composed, rtol=2e-6, atol=2e-6)
