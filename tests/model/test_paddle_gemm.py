"""The worker's matrix products (`paddle.gemm.Products`): oneDNN's sgemm on the CPU against a
float64 reference and Paddle's matmul, in place into tiles (bitwise the same whatever a row's
tile), on inputs that are views, and the switch back to Paddle's matmul."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from aioprefill.workers.paddle import env as paddle_env
from aioprefill.workers.paddle.gemm import Products

paddle.set_device("cpu")


@pytest.fixture(autouse=True)
def _onednn_chosen(monkeypatch):
    """Every test here multiplies on oneDNN, whatever this CPU would get by default."""
    monkeypatch.setenv(paddle_env.CPU_GEMM_ENV, "onednn")


def _onednn(tile: int | None = None, *, in_out: bool = False) -> Products:
    products = Products("cpu", 1, tile, in_out=in_out)
    # The wheel the project pins ships libdnnl: a silent fallback would make every test below
    # compare Paddle's matmul with itself.
    assert products.uses_onednn
    return products


def _data(rows: int, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    return x, w


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 7, 5), (3, 960, 576), (130, 200, 96)])
def test_linear_and_product_match_float64(rows, n, k):
    x, w = _data(rows, n, k)
    want = x.astype(np.float64) @ w.T.astype(np.float64)
    products, in_out = _onednn(), _onednn(in_out=True)
    linear_in_out = lambda x, w: in_out.linear(x, paddle.to_tensor(w.numpy().T))  # noqa: E731
    for fn in (products.linear, linear_in_out, products.product):
        got = fn(paddle.to_tensor(x), paddle.to_tensor(w))
        assert got.shape == [rows, n] and got.dtype == paddle.float32
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [37, 256, 600])  # one block; exactly one; 256 + 344 (joined)
def test_project_matches_float64_heads_major(rows):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, 96)).astype(np.float32)
    w = (rng.standard_normal((5, 96, 16)) / 10).astype(np.float32)
    got = _onednn().project(paddle.to_tensor(x), paddle.to_tensor(w))
    want = np.einsum("rk,hkd->hrd", x.astype(np.float64), w.astype(np.float64))
    assert got.shape == [5, rows, 16]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["onednn", "paddle"])
def test_per_head_reads_the_first_n_rows_in_place(backend, monkeypatch):
    # Attention's products: scores against the first n keys of a longer (zero-padded) buffer,
    # then the probabilities times the same values, per KV head.
    if backend == "paddle":
        monkeypatch.setenv(paddle_env.CPU_GEMM_ENV, "mkl")
    products = _onednn() if backend == "onednn" else Products("cpu", 1, None)
    rng = np.random.default_rng(6)
    heads, m, total, n, d = 3, 24, 40, 29, 16
    q = rng.standard_normal((heads, m, d)).astype(np.float32)
    kv = rng.standard_normal((heads, total, d)).astype(np.float32)
    p = rng.random((heads, m, n)).astype(np.float32)
    scores = products.per_head(paddle.to_tensor(q), paddle.to_tensor(kv), n, transpose_b=True)
    want = np.einsum("hmd,hnd->hmn", q.astype(np.float64), kv[:, :n].astype(np.float64))
    assert scores.shape == [heads, m, n]
    np.testing.assert_allclose(scores.numpy(), want, rtol=1e-5, atol=1e-5)
    out = products.per_head(paddle.to_tensor(p), paddle.to_tensor(kv), n, transpose_b=False)
    want = np.einsum("hmn,hnd->hmd", p.astype(np.float64), kv[:, :n].astype(np.float64))
    assert out.shape == [heads, m, d]
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)


def test_tiles_give_every_row_the_same_bits_wherever_it_sits():
    # deterministic=True's promise: a row's result depends on its own values only.
    tile = 8
    x, w = _data(4 * tile, 300, 64, seed=2)
    wh = (np.random.default_rng(3).standard_normal((3, 64, 16)) / 8).astype(np.float32)
    products = _onednn(tile, in_out=True)
    wp = paddle.to_tensor(np.ascontiguousarray(w.T))  # [in, out]
    full = products.linear(paddle.to_tensor(x), wp).numpy()
    proj = products.project(paddle.to_tensor(x), paddle.to_tensor(wh)).numpy()
    row = x[5]
    for place in range(0, 4 * tile, 7):
        moved = np.roll(x, place - 5, axis=0)  # row 5 now sits at `place`
        assert np.array_equal(moved[place], row)
        got = products.linear(paddle.to_tensor(moved), wp).numpy()
        assert np.array_equal(got[place], full[5])
        got_p = products.project(paddle.to_tensor(moved), paddle.to_tensor(wh)).numpy()
        assert np.array_equal(got_p[:, place], proj[:, 5])


def test_views_are_read_where_they_point():
    x, w = _data(40, 24, 32, seed=4)
    big = paddle.to_tensor(x)
    sliced = big[10:30]  # a view at an offset
    for in_out in (False, True):  # each layout as a view that is not contiguous
        layout = w if in_out else np.ascontiguousarray(w.T)
        transposed = paddle.to_tensor(layout).transpose([1, 0])
        assert not transposed.is_contiguous()
        got = _onednn(in_out=in_out).linear(sliced, transposed).numpy()
        want = x[10:30].astype(np.float64) @ w.T
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mkl_setting_keeps_paddles_matmul(monkeypatch):
    monkeypatch.setenv(paddle_env.CPU_GEMM_ENV, "mkl")
    products = Products("cpu", 1, None)
    assert not products.uses_onednn
    x, w = _data(6, 10, 12, seed=5)
    got = products.linear(paddle.to_tensor(x), paddle.to_tensor(w)).numpy()
    want = paddle.matmul(paddle.to_tensor(x), paddle.to_tensor(w), transpose_y=True).numpy()
    assert np.array_equal(got, want)
    in_out = Products("cpu", 1, None, in_out=True)  # MKL with weights laid out [in, out]
    got = in_out.linear(paddle.to_tensor(x), paddle.to_tensor(np.ascontiguousarray(w.T))).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv(paddle_env.CPU_GEMM_ENV, "openblas")
    with pytest.raises(ValueError, match="AIOPREFILL_CPU_GEMM"):
        Products("cpu", 1, None)


def test_mkl_is_the_default_and_auto_takes_onednn_only_on_amd_with_avx512(monkeypatch):
    monkeypatch.delenv(paddle_env.CPU_GEMM_ENV)
    assert paddle_env.cpu_gemm() == "mkl"
    monkeypatch.setenv(paddle_env.CPU_GEMM_ENV, "auto")
    amd_avx512 = paddle_env.is_amd_cpu() and paddle_env.cpu_has_avx512f()
    assert paddle_env.cpu_gemm() == ("onednn" if amd_avx512 else "mkl")
    monkeypatch.setattr(paddle_env, "is_amd_cpu", lambda: False)
    assert paddle_env.cpu_gemm() == "mkl"
    monkeypatch.setattr(paddle_env, "is_amd_cpu", lambda: True)
    monkeypatch.setattr(paddle_env, "cpu_has_avx512f", lambda: True)
    assert paddle_env.cpu_gemm() == "onednn"
    assert Products("gpu:0", 1, None).uses_onednn is False


def test_library_versions_name_both_libraries():
    found = paddle_env.library_versions()
    assert found["cpu_gemm"] == "onednn"
    assert found["onednn"].startswith("3.")
    assert "Math Kernel Library" in found["mkl"]
