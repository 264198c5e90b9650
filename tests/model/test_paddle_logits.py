"""The LM head's per-row results computed a vocabulary slice at a time (`paddle.logits`): against a
float64 log-softmax of the whole row, the tie rules across slice boundaries, and each row's bits
independent of the other rows and of how many there are (what batch invariance needs)."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from aioprefill.workers.paddle.logits import VOCAB_CHUNK, HeadRows, head_rows, join

paddle.set_device("cpu")

VOCAB, HIDDEN = 20_000, 64  # 3 slices of 8192 (the last one 3616 wide)


def _matmul_t(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    return paddle.matmul(x, w, transpose_y=True)


def _case(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
    w = (rng.standard_normal((VOCAB, HIDDEN)) * 0.6).astype(np.float32)
    return h, w, rng.integers(0, VOCAB, rows)


def _row_by_row(x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
    """x @ w.T one row at a time: each row's logits the same bits whatever the batch (the worker
    gets that from a floor of rows, `paddle.rows`; here the reduction is under test)."""
    return paddle.concat([_matmul_t(x[i : i + 1], w) for i in range(x.shape[0])])


def _rows(
    h: np.ndarray, w: np.ndarray, kmax: int, targets: np.ndarray | None, product=_matmul_t
) -> HeadRows:
    return head_rows(paddle.to_tensor(h), paddle.to_tensor(w), product, kmax, targets)


@pytest.mark.parametrize("kmax", [0, 1, 5])
def test_slices_match_a_float64_log_softmax_of_the_whole_row(kmax: int) -> None:
    h, w, targets = _case(37)
    got = _rows(h, w, kmax, targets)
    logits = paddle.matmul(paddle.to_tensor(h), paddle.to_tensor(w), transpose_y=True).numpy()
    lg = logits.astype(np.float64)
    m = lg.max(axis=1)
    lse = m + np.log(np.exp(lg - m[:, None]).sum(axis=1))
    assert np.abs(got.lse - lse).max() < 1e-6 * np.abs(lse).max()
    assert np.array_equal(got.ids, np.argmax(logits, axis=1))
    assert np.array_equal(got.best, m)
    assert got.picked is not None
    assert np.array_equal(got.picked, lg[np.arange(37), targets])
    assert got.top_vals.shape == got.top_ids.shape == (37, kmax)
    if kmax:
        order = np.lexsort((np.broadcast_to(np.arange(VOCAB), lg.shape), -logits), axis=1)
        assert np.array_equal(got.top_ids, order[:, :kmax])
        assert np.array_equal(got.top_vals, np.take_along_axis(logits, order[:, :kmax], 1))


def test_join_ties_keep_the_lowest_id_and_sums_join_in_float64() -> None:
    # Two slices (ids 0.. and 100..) with the same maximum 3.0 in row 0; row 1's is in slice 2.
    def part(v0: int, best: list[float], lse: list[float], vals: list[list[float]]) -> HeadRows:
        ids = np.array([v0 + 7, v0 + 9])
        tops = np.array([[v0 + 7, v0 + 1], [v0 + 9, v0 + 2]], dtype=np.int32)
        picked = np.array([-np.inf, 0.5] if v0 == 0 else [100.5, -np.inf])  # target in 1 slice
        return HeadRows(
            ids, np.array(best), np.array(lse), np.array(vals, np.float32), tops, picked
        )

    got = join([part(0, [3.0, 1.0], [4.0, 2.0], [[3, 2], [1, 1]]),
                part(100, [3.0, 5.0], [3.5, 6.0], [[3, 3], [5, 4]])])  # fmt: skip
    assert got.ids.tolist() == [7, 109] and got.best.tolist() == [3.0, 5.0]
    assert np.allclose(
        got.lse, [np.logaddexp(4.0, 3.5), np.logaddexp(2.0, 6.0)], rtol=0, atol=1e-15
    )
    assert got.top_ids.tolist() == [[7, 101], [109, 102]]  # row 0: 3 at ids 7, 101 and 107
    assert got.top_vals.tolist() == [[3, 3], [5, 4]]
    assert got.picked is not None and got.picked.tolist() == [100.5, 0.5]


def test_a_row_is_bitwise_the_same_alone_or_among_others() -> None:
    h, w, targets = _case(300, seed=1)
    whole = _rows(h, w, 4, targets, _row_by_row)
    for lo, hi in ((0, 1), (17, 18), (150, 299), (299, 300)):
        part = _rows(h[lo:hi], w, 4, targets[lo:hi], _row_by_row)
        for a, b in zip(part, whole, strict=True):
            assert np.array_equal(a, b[lo:hi])


def test_join_of_one_slice_is_that_slice_and_targets_outside_are_minus_inf() -> None:
    h, w, targets = _case(5)
    targets[:] = [0, 8191, 8192, 19_999, 100]
    hn, wt = paddle.to_tensor(h), paddle.to_tensor(w[8192 : 2 * 8192])
    one = head_rows(hn, wt, _matmul_t, 2, targets, v0=8192)  # a rank's slice, one chunk
    assert join([one]) is one
    assert one.picked is not None
    assert np.isneginf(one.picked[[0, 1, 3, 4]]).all() and np.isfinite(one.picked[2])
    assert (one.ids >= 8192).all() and (one.ids < 2 * 8192).all()
    assert VOCAB_CHUNK == 8192


def test_label_targets_per_row_are_picked_across_slices_on_the_cpu_and_device_paths() -> None:
    """[rows, m] targets (label token ids, -1 padding) read each row's logits at m ids across
    the slices; the device path (run here on CPU tensors) picks the same values."""
    from aioprefill.workers.paddle.logits import _device_rows

    h, w, _ = _case(6)
    labels = np.array([[0, 8191, 8192, 19_999]] * 3 + [[5, 5, -1, -1]] * 3, dtype=np.int64)
    got = _rows(h, w, 0, labels)
    logits = paddle.matmul(paddle.to_tensor(h), paddle.to_tensor(w), transpose_y=True).numpy()
    want = np.where(labels >= 0, np.take_along_axis(logits, np.maximum(labels, 0), 1), -np.inf)
    assert got.picked is not None and got.picked.shape == (6, 4)
    assert np.array_equal(got.picked, want.astype(np.float64))
    inside = labels >= 0
    dev = _device_rows(paddle.to_tensor(logits), 0, np.where(inside, labels, 0), inside, 0)
    assert dev.picked is not None and np.array_equal(dev.picked, got.picked)
