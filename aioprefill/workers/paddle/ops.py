"""The element-wise work of a forward: RoPE, SwiGLU and attention's masked softmax. On a CPU
NumPy runs them on the tensors' memory (zero-copy through DLPack) and oneDNN the softmax
(`paddle.softmax`); on a GPU they stay Paddle ops.

Why, measured on a 2-vCPU Intel Xeon build host (SmolLM2-135M, 8 x 280 ids, 1 thread; py-spy, and
each op timed inside real forwards): Paddle's CPU kernels for these ops were ~20% of a forward.
RoPE as `x * cos + roll(x) * sin` over full-size `[heads, rows, dim]` cos/sin tables copied out
per forward (Paddle broadcasts ~10x slower than it adds equal shapes) took 7.4 ms per layer at
2,240 rows; NumPy broadcasting `[rows, dim]` tables over the heads, in place, 3.6 ms. The
causal mask was a `[heads, rows, rows]` tensor added out of place, the scores of a query
block's earlier keys a second product joined by a concat, and Paddle's softmax kernel scalar
(`paddle.softmax`). Paddle's `swiglu` calls libm's scalar `exp` per element: 8.9 ms per layer
at 2,240 x 1,536, NumPy's vectorised passes in row chunks that stay in cache 7.4 ms (oneDNN's
eltwise kernels did no better here: 9.6 ms, and its fused swish-times-up is not JIT-compiled).

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

from aioprefill.workers.paddle.dnnl import (
    BINARY_MUL,
    ELTWISE_SWISH,
    F32,
    binary_primitive,
    eltwise_primitive,
    memory_desc,
)
from aioprefill.workers.paddle.softmax import onednn_softmax_available, softmax_rows_

__all__ = [
    "Rope",
    "causal_softmax_",
    "causal_softmax_rows_",
    "round_bf16_",
    "swiglu",
    "swiglu_planes",
]

# SwiGLU runs this many rows at a time: a chunk's gate, up and scratch stay in L2 (32 x 1,536
# floats are 192 KiB); 16 to 128 rows measured within 10% of each other (outside a forward).
_SWIGLU_ROWS = 32


def _on_cpu(t: paddle.Tensor) -> bool:
    return bool(t.place.is_cpu_place())


class Rope:
    """Rotary embeddings for one forward's positions, from `paddle.weights.rope_tables`' cos and
    sign-folded sin ([positions, dim]): x * cos + rotate_half(x) * sin for `[heads, rows, dim]`."""

    def __init__(self, cos: paddle.Tensor, sin: paddle.Tensor, positions: np.ndarray) -> None:
        self._cpu = _on_cpu(cos)
        if self._cpu:  # [1, rows, dim], broadcast over the heads by NumPy
            self._cos_rows: np.ndarray = np.from_dlpack(cos)[positions][None]
            self._sin_rows: np.ndarray = np.from_dlpack(sin)[positions][None]
        else:
            pos = paddle.to_tensor(positions)
            self._cos = paddle.gather(cos, pos).unsqueeze(0)
            self._sin = paddle.gather(sin, pos).unsqueeze(0)

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        """`x` rotated; on a CPU in place (x's memory is overwritten and x returned)."""
        half = x.shape[-1] // 2
        if not self._cpu:
            return x * self._cos + paddle.roll(x, half, axis=-1) * self._sin
        a: np.ndarray = np.from_dlpack(x)
        # The same float32 operations as on a GPU (bitwise), each pass over whole rows: NumPy
        # runs a [heads, rows, dim / 2] half in inner loops of dim / 2 (4.9 against 3.6 ms
        # per SmolLM2 layer at 2,240 rows).
        rolled = np.empty_like(a)
        np.copyto(rolled[..., :half], a[..., half:])
        np.copyto(rolled[..., half:], a[..., :half])
        np.multiply(rolled, self._sin_rows, out=rolled)
        np.add(np.multiply(a, self._cos_rows, out=a), rolled, out=a)
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


class _SwigluPlanes:
    """silu(gate) * up for `n` elements held as two planes (gate's n floats, then up's n), by
    two oneDNN primitives: swish over the gate plane in place, then gate * up into `out`."""

    def __init__(self, n: int) -> None:
        md = memory_desc([n], F32)
        self._swish = eltwise_primitive(ELTWISE_SWISH, md, md, 1.0)
        self._mul = binary_primitive(BINARY_MUL, md, md, md)
        self._n = n

    def __call__(self, planes: int, out: int) -> None:
        self._swish(planes, planes)
        self._mul(planes, planes + 4 * self._n, out)


@functools.lru_cache(maxsize=64)
def swiglu_planes(n: int) -> _SwigluPlanes:
    """SwiGLU on planes of `n` float32 elements (`paddle.gemm.Products.swiglu_linear` on a
    bfloat16 CPU): two JIT-compiled passes, where `swiglu`'s NumPy takes five and the bf16
    product's input rounding a sixth (2,240 x 1,536: ~3 against ~10 ms, 1 thread, AMD Zen 4).
    oneDNN's swish in one fused pass (a binary post-op, or a bf16 or strided dst) runs its
    reference loops in 3.6, so the gate and up products are made into separate planes."""
    return _SwigluPlanes(n)


class _Upper:
    """Rows of a [diag, diag] float32 triangle, -inf above the diagonal and 0 elsewhere: views
    of one triangle, grown to the largest tile seen (its top-left corner is a smaller tile's)."""

    def __init__(self) -> None:
        self._full = np.zeros((0, 0), dtype=np.float32)

    def __call__(self, first: int, rows: int, diag: int) -> np.ndarray:
        if self._full.shape[0] < diag:
            self._full = np.triu(np.full((diag, diag), -np.inf, dtype=np.float32), 1)
        return self._full[first : first + rows, :diag]


_upper = _Upper()


@functools.lru_cache(maxsize=8)
def _triangle(diag: int, dtype: paddle.dtype) -> paddle.Tensor:
    return paddle.to_tensor(_upper(0, diag, diag), dtype=dtype)


def causal_softmax_(
    scores: paddle.Tensor, heads: int, rows: int, diag: int, first: int = 0
) -> paddle.Tensor:
    """Softmax over the keys of `scores` (contiguous, `heads * rows` rows of `keys` each) whose
    last `diag` keys are the query tile's positions, query row i at position `first + i` of
    them: masked causally (row i sees the first keys - diag + first + i + 1). On a CPU in place:
    `scores` itself is returned."""
    keys = scores.shape[-1]
    if not _on_cpu(scores):
        shaped = scores.reshape([heads, rows, keys])
        before = paddle.zeros([rows, keys - diag], dtype=scores.dtype)
        tri = _triangle(diag, scores.dtype)[first : first + rows]
        shaped = shaped + paddle.concat([before, tri], axis=1)
        return F.softmax(shaped, axis=-1).reshape(scores.shape)
    s = np.from_dlpack(scores).reshape(heads, rows, keys)
    if s.dtype == np.float32 and onednn_softmax_available():
        causal_softmax_rows_(s, diag, first)
        return scores
    own = s[:, :, keys - diag :]
    np.add(own, _upper(first, rows, diag), out=own)
    return F.softmax(scores, axis=-1)


def causal_softmax_rows_(
    s: np.ndarray, diag: int, first: int = 0, at: int = 0, count: int | None = None
) -> None:
    """`causal_softmax_` on a C-contiguous float32 NumPy array [heads, rows, keys], in place,
    by oneDNN's softmax (CPU only: `onednn_softmax_available`). Only rows `at : at + count`
    (all by default) are masked, as the tile's rows `first ...`: the rest are padding."""
    keys = s.shape[-1]
    count = s.shape[-2] - at if count is None else count
    own = s[:, at : at + count, keys - diag :]
    np.add(own, _upper(first, count, diag), out=own)
    softmax_rows_(s)


def round_bf16_(t: paddle.Tensor) -> paddle.Tensor:
    """A float32 tensor's values rounded to bfloat16 (round to nearest even, as Paddle's cast),
    kept float32: on a CPU in place on its bits when it is contiguous (`t` itself is returned),
    else a rounded copy. A bfloat16 tensor (a GPU's) is returned as it is. NaNs stay NaN."""
    if t.dtype != paddle.float32:
        return t
    if not (_on_cpu(t) and t.is_contiguous()):
        return t.astype("bfloat16").astype("float32")
    u = np.from_dlpack(t).reshape(-1).view(np.uint32)
    nan = np.isnan(u.view(np.float32))
    low = (u >> 16) & 1
    low += 0x7FFF
    u += low
    u &= np.uint32(0xFFFF0000)
    if nan.any():  # a payload in the low half would have carried into the exponent
        u[nan] = np.uint32(0x7FC00000)
    return t
