"""Fused float32 CPU ops on oneDNN's primitives (`paddle.dnnl`), for the encoder forward:
`bias_` (a product's epilogue in one pass, in place: + bias, then exact GELU, or + residual +
bias), `layer_norm_` (the layer normalization primitive, scale and shift, in place) and
`attend_` (one prompt's bidirectional attention: two batched matmul primitives reading q, k and
v in place from the packed qkv rows, oneDNN's softmax between them).

Why: between an encoder's products, Paddle's eager CPU kernels took ~20% of a forward
(all-MiniLM-L6-v2, 1 thread, cProfile): its GELU runs a scalar erf (~1.6 ns an element), each
bias and residual add is a Paddle op of its own (~0.6 ns an element). Measured on Zen 4, 1
thread, 6,800 rows: the binary primitive's bias + gelu_erf pass 0.5 ns an element, bias +
residual 0.2 ns. The products stay on `dnnl_sgemm`: the matmul primitive with the same
epilogues as post-ops (`brg_matmul:avx512_core`) ran 1.04-1.14x the sgemm's time *plus* the
separate pass (MiniLM's four shapes), so it is not used for them. Attention's per-head sgemm
calls (24 a prompt a layer) become two batched primitives: 0.95x the time on MiniLM's lengths.

Batch invariance: the epilogues and LayerNorm act on each element or row alone; attention sees
one prompt, and its primitives depend on that prompt's length only. The enum values are oneDNN
3.x's (`dnnl_types.h`), checked against NumPy (max |d| within float32 rounding of the products).
A primitive is made once per shape (`_KEEP`, `_KEEP_ATTENTION` kept) and pointed at arrays.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from aioprefill.workers.paddle.dnnl import (
    ARG_DST,
    ARG_SRC,
    ARG_SRC_1,
    ARG_WEIGHTS,
    F32,
    FORWARD_INFERENCE,
    MemoryDesc,
    P,
    PostOps,
    Primitive,
    check,
    dnnl,
    memory_desc,
    post_op_arg,
)
from aioprefill.workers.paddle.softmax import softmax_rows_

__all__ = ["attend_", "bias_", "fused_available", "layer_norm_"]

GELU_ERF = 0x31  # dnnl_eltwise_gelu_erf (oneDNN 3.x dnnl_types.h)
BINARY_ADD = 0x1FFF0  # dnnl_binary_add
_ARG_SCALE, _ARG_SHIFT = 51, 52
_F32 = 4  # bytes
_USE_SCALE, _USE_SHIFT = 0x2, 0x4
_KEEP = 64  # shapes whose primitive is kept (a forward uses 4 matmul shapes and 1 norm shape)
_KEEP_ATTENTION = 1024  # attention's: two per prompt length
_LINEAR = 0x26  # dnnl_eltwise_linear: alpha * x + beta


def fused_available() -> bool:
    """Whether Paddle's wheel has a oneDNN these ops can call."""
    return dnnl() is not None


@functools.lru_cache(maxsize=_KEEP)
def _epilogue(rows: int, n: int, post: str) -> Primitive:
    """dst[rows, n] = src[rows, n] + bias[n], then GELU (`post="gelu"`); or, with
    `post="add"`, dst = src + other[rows, n] + bias[n]: one binary primitive (a binary or
    eltwise post-op), src and dst one memory."""
    d = dnnl()
    assert d is not None
    lib = d.lib
    lib.dnnl_binary_primitive_desc_create.argtypes = [P, P, ctypes.c_int, P, P, P, P]
    md, row = memory_desc([rows, n], F32), memory_desc([1, n], F32)
    ops = PostOps()
    if post == "add":
        args = [(ARG_SRC, md), (ARG_SRC_1, md), (ARG_DST, md), (post_op_arg(0), row)]
        ops.binary(BINARY_ADD, row)
        second = md
    else:
        args = [(ARG_SRC, md), (ARG_SRC_1, row), (ARG_DST, md)]
        if post == "gelu":
            ops.eltwise(GELU_ERF)
        second = row
    pd = P()
    check(
        lib.dnnl_binary_primitive_desc_create(
            ctypes.byref(pd), d.engine, BINARY_ADD, md.handle, second.handle, md.handle,
            ops.attr,
        ),
        "binary_primitive_desc_create",
    )  # fmt: skip
    prim = Primitive(pd, args)
    prim.keep = ops  # type: ignore[attr-defined]  # the attribute lives as long as the primitive
    return prim


def bias_(
    out: np.ndarray, b: np.ndarray, post: str = "", other: np.ndarray | None = None
) -> np.ndarray:
    """In place on a product's output (C-contiguous float32 [rows, n]): out += b, then GELU
    (`post="gelu"`), or out += other + b (`post="add"`: the residual). One pass."""
    rows, n = out.shape
    a = out.ctypes.data
    if post == "add":
        assert other is not None and other.shape == out.shape
        _epilogue(rows, n, post)(a, other.ctypes.data, a, b.ctypes.data)
    else:
        _epilogue(rows, n, post)(a, b.ctypes.data, a)
    return out


@functools.lru_cache(maxsize=_KEEP)
def _layer_norm(rows: int, cols: int, eps: float) -> Primitive:
    d = dnnl()
    assert d is not None
    lib = d.lib
    lib.dnnl_layer_normalization_forward_primitive_desc_create.argtypes = [
        *(P, P, ctypes.c_int, P, P, P, ctypes.c_float, ctypes.c_uint, P)
    ]
    md, stat = memory_desc([rows, cols], F32), memory_desc([rows], F32)
    param = memory_desc([cols], F32)
    pd = P()
    check(
        lib.dnnl_layer_normalization_forward_primitive_desc_create(
            ctypes.byref(pd), d.engine, FORWARD_INFERENCE, md.handle, md.handle, stat.handle,
            eps, _USE_SCALE | _USE_SHIFT, None,
        ),
        "layer_normalization_forward_primitive_desc_create",
    )  # fmt: skip
    prim = Primitive(pd, [(ARG_SRC, md), (ARG_DST, md), (_ARG_SCALE, param), (_ARG_SHIFT, param)])
    prim.keep = stat  # type: ignore[attr-defined]
    return prim


def layer_norm_(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis of x (C-contiguous float32 [rows, cols]), in place."""
    rows, cols = x.shape
    a = x.ctypes.data
    _layer_norm(rows, cols, float(eps))(a, a, weight.ctypes.data, bias.ctypes.data)
    return x


def _matmul(src: MemoryDesc, w: MemoryDesc, dst: MemoryDesc, ops: PostOps | None) -> Primitive:
    d = dnnl()
    assert d is not None
    d.lib.dnnl_matmul_primitive_desc_create.argtypes = [P] * 7
    pd = P()
    attr = None if ops is None else ops.attr
    check(
        d.lib.dnnl_matmul_primitive_desc_create(
            ctypes.byref(pd), d.engine, src.handle, w.handle, None, dst.handle, attr
        ),
        "matmul_primitive_desc_create",
    )
    prim = Primitive(pd, [(ARG_SRC, src), (ARG_WEIGHTS, w), (ARG_DST, dst)])
    prim.keep = ops  # type: ignore[attr-defined]
    return prim


@functools.lru_cache(maxsize=_KEEP_ATTENTION)
def _scores(n: int, heads: int, hd: int, scale: float) -> Primitive:
    """Every head's q_h k_h^T * scale of one n-token prompt, q and k read in place from its
    packed qkv rows (row stride 3 * heads * hd) -> dense [heads, n, n]."""
    width = 3 * heads * hd
    q = memory_desc([heads, n, hd], F32, [hd, width, 1])
    k_t = memory_desc([heads, hd, n], F32, [hd, 1, width])  # k_h transposed, in place
    return _matmul(q, k_t, memory_desc([heads, n, n], F32), PostOps().eltwise(_LINEAR, scale))


@functools.lru_cache(maxsize=_KEEP_ATTENTION)
def _context(n: int, heads: int, hd: int) -> Primitive:
    """Every head's probabilities [n, n] @ v_h (read in place from the qkv rows), written into
    the head's columns of the context rows (row stride heads * hd)."""
    hidden = heads * hd
    v = memory_desc([heads, n, hd], F32, [hd, 3 * hidden, 1])
    out = memory_desc([heads, n, hd], F32, [hd, hidden, 1])
    return _matmul(memory_desc([heads, n, n], F32), v, out, None)


def attend_(
    qkv: np.ndarray, ctx: np.ndarray, s: int, e: int, heads: int, scale: float,
    scores: np.ndarray,
) -> None:  # fmt: skip
    """Bidirectional attention of the prompt in rows s:e of the packed qkv [rows, 3 * hidden]
    (q, k, v column blocks) into ctx's rows s:e [rows, hidden]: one batched matmul primitive
    for every head's scores, oneDNN's softmax over all their rows, one for the context.
    `scores`: a C-contiguous float32 buffer of at least heads * n * n."""
    n, hidden = e - s, ctx.shape[1]
    hd = hidden // heads
    row = qkv.ctypes.data + s * qkv.shape[1] * _F32
    sp = scores.ctypes.data
    _scores(n, heads, hd, scale)(row, row + hidden * _F32, sp)
    softmax_rows_(scores.reshape(-1)[: heads * n * n].reshape(heads * n, n))
    _context(n, heads, hd)(sp, row + 2 * hidden * _F32, ctx.ctypes.data + s * hidden * _F32)
