"""The forward's element-wise kernels on the CPU (`paddle.ops`, `paddle.softmax`): RoPE bitwise
equal to Paddle's `x * cos + roll(x) * sin`, SwiGLU and the masked softmax against float64
references, and each row's bits independent of the other rows (what batch invariance needs)."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from aioprefill.workers.paddle.ops import Rope, causal_softmax_, swiglu
from aioprefill.workers.paddle.softmax import onednn_softmax_available, softmax_rows_

paddle.set_device("cpu")


def _tables(positions: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / 10000 ** (np.arange(0, dim, 2) / dim)
    angles = np.outer(np.arange(positions), inv)
    cos = np.cos(np.concatenate([angles, angles], axis=1)).astype(np.float32)
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=1).astype(np.float32)
    return cos, sin


def test_the_wheel_has_onednn_softmax():
    # The pinned wheel ships libdnnl: without it every softmax test below would test Paddle's.
    assert onednn_softmax_available()


def test_rope_in_place_is_bitwise_paddles_roll_form():
    rng = np.random.default_rng(0)
    heads, rows, dim = 5, 37, 64
    cos, sin = _tables(100, dim)
    positions = rng.integers(0, 100, rows)
    x = paddle.to_tensor(rng.standard_normal((heads, rows, dim)).astype(np.float32))
    c = paddle.to_tensor(cos[positions][None])
    s = paddle.to_tensor(sin[positions][None])
    expected = (x * c + paddle.roll(x, dim // 2, axis=-1) * s).numpy()
    rope = Rope(paddle.to_tensor(cos), paddle.to_tensor(sin), positions)
    out = rope(x)
    np.testing.assert_array_equal(out.numpy(), expected)
    np.testing.assert_array_equal(x.numpy(), expected)  # in place


def test_rope_on_a_slice_writes_only_that_slice():
    rng = np.random.default_rng(1)
    cos, sin = _tables(16, 8)
    qkv = paddle.to_tensor(rng.standard_normal((6, 16, 8)).astype(np.float32))
    v_before = qkv.numpy()[4:].copy()
    out = Rope(paddle.to_tensor(cos), paddle.to_tensor(sin), np.arange(16))(qkv[:4])
    np.testing.assert_array_equal(qkv.numpy()[4:], v_before)
    assert out.shape == [4, 16, 8]


@pytest.mark.parametrize("rows", [1, 31, 70])
def test_swiglu_matches_float64_and_each_row_alone(rows):
    rng = np.random.default_rng(rows)
    n = 96
    x = (rng.standard_normal((rows, 2 * n)) * 4).astype(np.float32)
    out = swiglu(paddle.to_tensor(x)).numpy()
    g, u = x[:, :n].astype(np.float64), x[:, n:].astype(np.float64)
    expected = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(out, expected, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(out, F.swiglu(paddle.to_tensor(x)).numpy(), rtol=2e-6, atol=2e-6)
    for i in (0, rows // 2, rows - 1):
        alone = swiglu(paddle.to_tensor(x[i : i + 1])).numpy()
        np.testing.assert_array_equal(alone[0], out[i])


@pytest.mark.parametrize(
    ("kv_heads", "group", "rows", "keys", "diag", "first"),
    [(3, 3, 5, 9, 5, 0), (1, 2, 1, 4, 1, 0), (2, 2, 3, 12, 8, 2), (1, 3, 2, 8, 8, 6)],
)
def test_causal_softmax_matches_float64(kv_heads, group, rows, keys, diag, first):
    rng = np.random.default_rng(keys + first)
    heads = kv_heads * group
    scores = (rng.standard_normal((kv_heads, group * rows, keys)) * 6).astype(np.float32)
    t = paddle.to_tensor(scores)
    out = causal_softmax_(t, heads, rows, diag, first).numpy().reshape(heads, rows, keys)
    s = scores.reshape(heads, rows, keys).astype(np.float64)
    sees = keys - diag + first + np.arange(rows)  # the last key each query row sees
    visible = np.arange(keys)[None, :] <= sees[:, None]
    s = np.where(visible, s, -np.inf)
    expected = np.exp(s - s.max(-1, keepdims=True))
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(out, expected, rtol=3e-6, atol=1e-7)
    assert (out[:, ~visible] == 0).all()
    np.testing.assert_array_equal(t.numpy().reshape(heads, rows, keys), out)  # in place


def test_softmax_row_bits_do_not_depend_on_the_other_rows():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((300, 77)) * 5).astype(np.float32)
    whole = x.copy()
    softmax_rows_(whole)
    for i in (0, 150, 299):
        alone = x[i : i + 1].copy()
        softmax_rows_(alone)
        np.testing.assert_array_equal(alone[0], whole[i])
    part = x[100:103].copy()
    softmax_rows_(part)
    np.testing.assert_array_equal(part, whole[100:103])
