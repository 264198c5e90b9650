"""The encoder's fused CPU ops on oneDNN's primitives (`paddle.fused`): the products' epilogues
(bias, bias + exact GELU, residual + bias), LayerNorm and one prompt's attention against float64
NumPy, and each row's bits independent of the other rows (what batch invariance needs)."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

from aioprefill.workers.paddle.fused import attend_, bias_, fused_available, layer_norm_
from aioprefill.workers.paddle.gemm import Products

paddle.set_device("cpu")
_erf = np.vectorize(math.erf)


def test_the_wheel_has_the_primitives():
    assert fused_available()


@pytest.mark.parametrize("post", ["", "gelu", "add"])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_epilogues_match_float64_and_each_row_alone(post: str, rows: int) -> None:
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 96)) * 2).astype(np.float32)
    other = rng.standard_normal((rows, 96)).astype(np.float32)
    b = rng.standard_normal(96).astype(np.float32)
    want = x.astype(np.float64) + b
    if post == "gelu":
        want = 0.5 * want * (1 + _erf(want / math.sqrt(2)))
    elif post == "add":
        want = want + other
    got = bias_(x.copy(), b, post, other if post == "add" else None)
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-6)
    for i in (0, rows - 1):
        alone = bias_(x[i : i + 1].copy(), b, post, other[i : i + 1] if post == "add" else None)
        np.testing.assert_array_equal(alone[0], got[i])


@pytest.mark.parametrize("rows", [1, 16, 257])
def test_layer_norm_matches_float64_and_each_row_alone(rows: int) -> None:
    rng = np.random.default_rng(rows)
    x = (rng.standard_normal((rows, 384)) * 3 + 1).astype(np.float32)
    g, b = rng.standard_normal(384).astype(np.float32), rng.standard_normal(384).astype(np.float32)
    x64 = x.astype(np.float64)
    mean, var = x64.mean(1, keepdims=True), x64.var(1, keepdims=True)
    want = (x64 - mean) / np.sqrt(var + 1e-12) * g + b
    got = layer_norm_(x.copy(), g, b, 1e-12)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-6)
    np.testing.assert_array_equal(layer_norm_(x[-1:].copy(), g, b, 1e-12)[0], got[-1])


@pytest.mark.parametrize("n", [1, 7, 64, 130])
def test_attention_of_one_prompt_matches_float64(n: int) -> None:
    heads, hd = 4, 16
    hidden = heads * hd
    rng = np.random.default_rng(n)
    before = 3  # the prompt's rows start after another prompt's, in the packed matrix
    qkv = rng.standard_normal((before + n + 2, 3 * hidden)).astype(np.float32)
    ctx = np.full((before + n + 2, hidden), 7.0, np.float32)
    scores = np.empty(heads * n * n + 5, np.float32)
    scale = 1 / math.sqrt(hd)
    mm = Products("cpu", 1, None, gemm="onednn", in_out=True)
    attend_(mm, qkv, ctx, before, before + n, heads, scale, scores)
    rows = qkv[before : before + n].astype(np.float64).reshape(n, 3, heads, hd)
    q, k, v = (rows[:, i].transpose(1, 0, 2) for i in range(3))
    s = q @ k.transpose(0, 2, 1) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(n, hidden)
    np.testing.assert_allclose(ctx[before : before + n], want, atol=2e-6, rtol=1e-5)
    assert (ctx[:before] == 7.0).all() and (ctx[before + n :] == 7.0).all()  # nothing else written
