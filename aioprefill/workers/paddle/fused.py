"""Fused float32 CPU ops on oneDNN's primitives (`paddle.dnnl`), for the encoder forward:
`bias_` (a product's epilogue in one pass, in place: + bias, then exact GELU, or + residual +
bias), `layer_norm_` (the layer normalization primitive, scale and shift, in place) and
`attend_` (one prompt's bidirectional attention: each head's products on oneDNN's sgemm reading
q, k and v in place from the packed qkv rows, oneDNN's softmax primitive between them).

Why: between an encoder's products, Paddle's eager CPU kernels took ~20% of a forward
(all-MiniLM-L6-v2, 1 thread, cProfile): its GELU runs a scalar erf (~1.6 ns an element), each
bias and residual add is a Paddle op of its own (~0.6 ns an element). Measured on Zen 4, 1
thread, 6,800 rows: the binary primitive's bias + gelu_erf pass 0.5 ns an element, bias +
residual 0.2 ns. The products stay on `dnnl_sgemm`: the matmul primitive with the same
epilogues as post-ops (`brg_matmul:avx512_core`) ran 1.04-1.14x the sgemm's time *plus* the
separate pass (MiniLM's four shapes), so it is not used for them. Attention's 24 sgemm calls a
prompt a layer were also tried as two batched matmul primitives (all heads at once, q, k, v read
in place through strides): 0.95x the time on MiniLM's lengths, but a primitive per prompt length
(JIT kernels, ~340 KB each: +175 MiB a worker for lengths 1-256), so attention stays on sgemm.

Nothing else on this machine computes it much cheaper (benchmarks/studies/encoder/
bench_attention.py, four runs under the measurement lock at load 1.0-3.1:
benchmarks/results/encoder/attention.txt; 300 prompts of 8-256 tokens x 6 layers, 1 thread).
This path: medians 1.34-1.56 CPU-s, against 0.62-0.66 for its products at the sgemm's rate;
the softmax alone costs 0.44-0.65 ns a score at 256 tokens, 0.73-1.07 at 64, 2.6-2.7 at 16.
Against it: MKL's `cblas_sgemm` per head (its AVX2 kernels, `MKL_DEBUG_CPU_TYPE=5` as a worker
sets it) 0.90-1.00x the time (within float32 rounding, 1.2e-6; at most ~1% of a forward, so
not taken); MKL's group API `cblas_sgemm_batch` with every head of every prompt of a batch in
one call (one softmax a prompt between the two calls; each product's bits the same as alone)
1.09-1.23x: a batch's scores, tens of MB, are all written before the first softmax reads them;
one matmul primitive per product batched over the heads with runtime M, N, K (one primitive for
every length; bitwise these sgemm calls) 0.94-1.00x: 1.8-3.4x faster on prompts of 8-32 tokens
(26-57 against 72-131 us a layer), no faster from 192 tokens; each head's scores, softmax and
product in turn (one head's scores in cache at a time) 0.99-1.08x; torch's fused CPU
`scaled_dot_product_attention` on the same strided views 1.05-1.20x.

Batch invariance: the epilogues and LayerNorm act on each element or row alone; attention sees
one prompt, its softmax primitive depends on that prompt's length only. The enum values are oneDNN
3.x's (`dnnl_types.h`), checked against NumPy (max |d| within float32 rounding of the products).
A primitive is made once per shape (`_KEEP` kept) and pointed at arrays on each call.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from aioprefill.workers.paddle.dnnl import (
    ARG_DST,
    ARG_SRC,
    ARG_SRC_1,
    F32,
    FORWARD_INFERENCE,
    P,
    PostOps,
    Primitive,
    dnnl,
    memory_desc,
    post_op_arg,
    primitive_desc,
)
from aioprefill.workers.paddle.gemm import Products
from aioprefill.workers.paddle.softmax import softmax_rows_

__all__ = ["attend_", "bias_", "fused_available", "layer_norm_"]

GELU_ERF = 0x31  # dnnl_eltwise_gelu_erf (oneDNN 3.x dnnl_types.h)
BINARY_ADD = 0x1FFF0  # dnnl_binary_add
_ARG_SCALE, _ARG_SHIFT = 51, 52
_F32 = 4  # bytes
_USE_SCALE, _USE_SHIFT = 0x2, 0x4
_KEEP = 64  # shapes whose primitive is kept (a forward uses 4 matmul shapes and 1 norm shape)


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
    pd = primitive_desc(
        "dnnl_binary_primitive_desc_create", [P, ctypes.c_int, P, P, P, P],
        d.engine, BINARY_ADD, md.handle, second.handle, md.handle, ops.attr,
    )  # fmt: skip
    return Primitive(pd, args, keep=[ops])


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
    md, stat = memory_desc([rows, cols], F32), memory_desc([rows], F32)
    param = memory_desc([cols], F32)
    pd = primitive_desc(
        "dnnl_layer_normalization_forward_primitive_desc_create",
        [P, ctypes.c_int, P, P, P, ctypes.c_float, ctypes.c_uint, P],
        d.engine, FORWARD_INFERENCE, md.handle, md.handle, stat.handle,
        eps, _USE_SCALE | _USE_SHIFT, None,
    )  # fmt: skip
    args = [(ARG_SRC, md), (ARG_DST, md), (_ARG_SCALE, param), (_ARG_SHIFT, param)]
    return Primitive(pd, args, keep=[stat])


def layer_norm_(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis of x (C-contiguous float32 [rows, cols]), in place."""
    rows, cols = x.shape
    a = x.ctypes.data
    _layer_norm(rows, cols, float(eps))(a, a, weight.ctypes.data, bias.ctypes.data)
    return x


def attend_(
    mm: Products, qkv: np.ndarray, ctx: np.ndarray, s: int, e: int, heads: int, scale: float,
    scores: np.ndarray,
) -> None:  # fmt: skip
    """Bidirectional attention of the prompt in rows s:e of the packed qkv [rows, 3 * hidden]
    (q, k, v column blocks) into ctx's rows s:e [rows, hidden]: each head's scores
    q_h k_h^T * scale by oneDNN's sgemm with leading dimensions (q_h, k_h read in place) into
    `scores` (C-contiguous float32, at least heads * n * n), oneDNN's softmax over every row of
    every head in one call, each head's probabilities @ v_h written straight into its columns
    of ctx. No copies, no transposes, no primitive per prompt length."""
    n, hidden = e - s, ctx.shape[1]
    hd, width = hidden // heads, qkv.shape[1]
    row, sp = qkv.ctypes.data + s * width * _F32, scores.ctypes.data
    out = ctx.ctypes.data + s * hidden * _F32
    for h in range(heads):
        q, k, a = row + h * hd * _F32, row + (hidden + h * hd) * _F32, sp + h * n * n * _F32
        mm.strided(n, n, hd, scale, q, width, k, width, a, n, transpose_b=True)
    softmax_rows_(scores.reshape(-1)[: heads * n * n].reshape(heads * n, n))
    for h in range(heads):
        a, v = sp + h * n * n * _F32, row + (2 * hidden + h * hd) * _F32
        mm.strided(n, hd, n, 1.0, a, n, v, width, out + h * hd * _F32, hidden, transpose_b=False)
