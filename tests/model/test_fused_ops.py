"""The encoder's fused CPU ops on oneDNN's primitives (`paddle.fused`): the products' epilogues
(bias, bias + exact GELU, residual + bias), LayerNorm and one prompt's attention against float64
NumPy, and each row's bits independent of the other rows (what batch invariance needs)."""

from __future__ import annotations

import math

import numpy as np
import paddle
import pytest

import aioprefill.workers.paddle.fused as fused
from aioprefill.workers.paddle.fused import attend_, bias_, fused_available, layer_norm_
from aioprefill.workers.paddle.gemm import Products
from aioprefill.workers.paddle.onednn import openmp_threads

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


def _attention(mm: Products, p: np.ndarray, before: int, heads: int, hd: int) -> np.ndarray:
    """attend_ on prompt rows `p` packed after `before` other rows; the prompt's context."""
    n, hidden = len(p), heads * hd
    qkv = np.zeros((before + n + 2, 3 * hidden), np.float32)
    qkv[before : before + n] = p
    ctx = np.full((before + n + 2, hidden), 7.0, np.float32)
    scores = np.empty(heads * n * n + 5, np.float32)
    attend_(mm, qkv, ctx, before, before + n, heads, 1 / math.sqrt(hd), scores)
    assert (ctx[:before] == 7.0).all() and (ctx[before + n :] == 7.0).all()
    return ctx[before : before + n]


@pytest.mark.parametrize(("heads", "hd"), [(12, 32), (4, 16), (8, 48), (16, 64), (3, 20)])
def test_short_prompts_batched_products_give_the_per_head_bits(
    heads: int, hd: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every length `attend_` routes to the batched runtime-shape matmul primitives (1 to
    SHORT_PROMPT tokens, 1 thread) gives the per-head sgemm path's context bit for bit, at an
    offset inside a packed batch (what batch invariance and the accuracy figures rest on)."""
    mm = Products("cpu", 1, None, gemm="onednn", in_out=True)
    assert openmp_threads() == 1
    hidden = heads * hd
    assert fused._batched(heads, hd, 3 * hidden, hidden, 1 / math.sqrt(hd)) is not None
    rng = np.random.default_rng(heads * hd)
    for n in range(1, fused.SHORT_PROMPT + 1):
        p = (rng.standard_normal((n, 3 * hidden)) * 2).astype(np.float32)
        before = n % 5
        batched = _attention(mm, p, before, heads, hd)
        with monkeypatch.context() as m:
            m.setattr(fused, "SHORT_PROMPT", 0)  # every length on the per-head path
            per_head = _attention(mm, p, 3, heads, hd)
        np.testing.assert_array_equal(batched, per_head, err_msg=f"{n} tokens")


def test_more_threads_keep_the_per_head_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 2 threads the batched primitives' bits differ from the per-head path's for some
    shapes (MiniLM's layout at 101-199 tokens, 3 heads of 20 at every length: measured), so
    `attend_` keeps the per-head path there: the same bits as with no batched path at all."""
    mm = Products("cpu", 2, None, gemm="onednn", in_out=True)
    try:
        rng = np.random.default_rng(0)
        for heads, hd, n in ((12, 32, 120), (3, 20, 5)):
            p = (rng.standard_normal((n, 3 * heads * hd)) * 2).astype(np.float32)
            got = _attention(mm, p, 1, heads, hd)
            with monkeypatch.context() as m:
                m.setattr(fused, "SHORT_PROMPT", 0)
                np.testing.assert_array_equal(got, _attention(mm, p, 1, heads, hd))
    finally:
        Products("cpu", 1, None, gemm="onednn", in_out=True)  # back to the tests' 1 thread
