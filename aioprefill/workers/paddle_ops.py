"""The element-wise work of a forward: RoPE, SwiGLU and attention's masked softmax. On a CPU
NumPy runs them on the tensors' memory (zero-copy through DLPack) and oneDNN the softmax
(`paddle_softmax`); on a GPU they stay Paddle ops.

Why, measured on the project's 2-vCPU Zen 4 (SmolLM2-135M, 8 x 280 ids, 1 thread, py-spy):
Paddle's CPU kernels for these ops were ~20% of a forward. Its `swiglu` calls the scalar `exp`
of libm per element (9.1 ms for 2,240 x 1,536: NumPy's vectorised passes in row chunks that stay
in cache take 5 ms); RoPE as `x * cos + roll(x) * sin` ran four passes over `[heads, rows, dim]`
plus full-size cos/sin tables copied out per forward (Paddle broadcasts ~10x slower than it adds
equal shapes; 5.5 ms per layer at 2,240 rows), where NumPy broadcasts `[rows, dim / 2]` tables
over the heads in place (2.7 ms); the causal mask was a `[heads, rows, rows]` tensor added
out of place and the scores of a query block's earlier keys a second product joined by a concat.

Numbers: RoPE computes the same float32 operations in the same order (bitwise the same); SwiGLU
and the softmax round differently from Paddle's kernels (a few float32 ulps). Every operation is
per element or per row, computed alike wherever the row sits, so batch invariance holds (the
tests check it bitwise with `deterministic=True`).
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
import paddle.nn.functional as F

from aioprefill.workers.paddle_softmax import onednn_softmax_available, softmax_rows_

__all__ = ["Rope", "causal_softmax_", "swiglu"]

# SwiGLU runs this many rows at a time: a chunk's gate, up and scratch stay in L2 (32 x 1,536
# floats are 192 KiB); 16 to 128 measured within 10% of each other, 2,240 at once 1.3x slower.
_SWIGLU_ROWS = 32


def _on_cpu(t: paddle.Tensor) -> bool:
    return bool(t.place.is_cpu_place())


class Rope:
    """Rotary embeddings for one forward's positions, from `paddle_weights.rope_tables`' cos and
    sign-folded sin ([positions, dim]): x * cos + rotate_half(x) * sin for `[heads, rows, dim]`."""

    def __init__(self, cos: paddle.Tensor, sin: paddle.Tensor, positions: np.ndarray) -> None:
        self._cpu = _on_cpu(cos)
        half = cos.shape[-1] // 2
        if self._cpu:
            # cos = [c, c] and sin = [-s, s] per row: the halves are all it needs
            self._cos_half: np.ndarray = np.from_dlpack(cos)[positions, :half][None]
            self._sin_half: np.ndarray = np.from_dlpack(sin)[positions, half:][None]
        else:
            pos = paddle.to_tensor(positions)
            self._cos = paddle.gather(cos, pos).unsqueeze(0)
            self._sin = paddle.gather(sin, pos).unsqueeze(0)

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        """`x` rotated; on a CPU in place (x's memory is overwritten and x returned)."""
        if not self._cpu:
            half = x.shape[-1] // 2
            return x * self._cos + paddle.roll(x, half, axis=-1) * self._sin
        a: np.ndarray = np.from_dlpack(x)
        half = a.shape[-1] // 2
        x1, x2, c, s = a[..., :half], a[..., half:], self._cos_half, self._sin_half
        # x1 * c + x2 * (-s) and x2 * c + x1 * s: the roll form's operations, bit for bit
        x2s, x1s = np.multiply(x2, s), np.multiply(x1, s)
        np.subtract(np.multiply(x1, c, out=x1), x2s, out=x1)
        np.add(np.multiply(x2, c, out=x2), x1s, out=x2)
        return x


def swiglu(x: paddle.Tensor) -> paddle.Tensor:
    """silu(gate) * up for `x` = [rows, 2 * n] = [gate | up] (Paddle's `swiglu` split)."""
    if not _on_cpu(x):
        return F.swiglu(x)
    rows, n = x.shape[0], x.shape[1] // 2
    out = paddle.empty([rows, n], dtype=x.dtype)
    a, o = np.from_dlpack(x), np.from_dlpack(out)
    scratch = np.empty((min(rows, _SWIGLU_ROWS), n), dtype=a.dtype)
    for lo in range(0, rows, _SWIGLU_ROWS):
        hi = min(rows, lo + _SWIGLU_ROWS)
        gate, t, dst = a[lo:hi, :n], scratch[: hi - lo], o[lo:hi]
        np.negative(gate, out=t)
        np.add(np.exp(t, out=t), 1, out=t)
        np.multiply(np.divide(gate, t, out=dst), a[lo:hi, n:], out=dst)
    return out


@functools.lru_cache(maxsize=256)
def _upper(rows: int) -> np.ndarray:
    """[rows, rows] float32: -inf above the diagonal, 0 elsewhere."""
    return np.triu(np.full((rows, rows), -np.inf, dtype=np.float32), 1)


@functools.lru_cache(maxsize=256)
def _mask(rows: int, keys: int, dtype: paddle.dtype) -> paddle.Tensor:
    mask = np.zeros((rows, keys), dtype=np.float32)
    mask[:, keys - rows :] = _upper(rows)
    return paddle.to_tensor(mask, dtype=dtype)


def causal_softmax_(scores: paddle.Tensor, heads: int, rows: int) -> paddle.Tensor:
    """Softmax over the keys of `scores` (contiguous, `heads * rows` rows of `keys` each) whose
    last `rows` keys are the query rows' own positions, masked causally (row i sees the first
    keys - rows + i + 1). On a CPU in place: `scores` itself is returned."""
    keys = scores.shape[-1]
    if not _on_cpu(scores):
        shaped = scores.reshape([heads, rows, keys])
        if rows > 1:
            shaped = shaped + _mask(rows, keys, scores.dtype)
        return F.softmax(shaped, axis=-1).reshape(scores.shape)
    s = np.from_dlpack(scores).reshape(heads, rows, keys)
    if rows > 1:
        own = s[:, :, keys - rows :]
        np.add(own, _upper(rows), out=own)
    if s.dtype == np.float32 and onednn_softmax_available():
        softmax_rows_(s)
        return scores
    return F.softmax(scores, axis=-1)
