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
separate pass (MiniLM's four shapes), so it is not used for them.

Attention: a prompt of at most `SHORT_PROMPT` (128) tokens, on a worker of 1 thread, runs its
two products as ONE matmul primitive each, batched over the heads, with runtime M, N, K and
score strides (`DNNL_RUNTIME_DIM_VAL`: one primitive for every length, no per-length JIT
kernels; a primitive per length was ~340 KB each, +175 MiB a worker for lengths 1-256). oneDNN
runs it as `gemm:jit:f32`, the sgemm per head: bitwise the per-head path's context (checked for
every length 1-128 and five head layouts, tests/model/test_fused_ops.py; MiniLM against
sentence-transformers max |d| 2.2e-7 either way). Measured (benchmarks/results/encoder/
short_prompts.txt, lock, 1 thread, MiniLM, two runs): one layer's attention 2.2-2.7x faster at
1-16 tokens (per-head 69-87 us, batched 26-40), 1.45-1.97x at 24-48, 1.16-1.23x at 64-80 (one
run's 80 tokens 0.91x), 1.01-1.10x at 88-128, 0.96-1.03x at 160-256 (not routed); the forward on
1,000 prompts of 8-48 tokens 1.03-1.07x fewer CPU-s (medians 6.58 against 7.07, 6.53 against
6.72; attention 1.46-1.63x), on the 8-256 mix 0.99x and 1.004x (9.96 against 9.88, 10.04 against
10.08: within the rounds' spread), on 96-128 tokens 7.56 against 7.64. At 2 threads (the
primitive made at 2 threads) its bits differ from the per-head path's for some shapes (MiniLM's
layout at 101-199 tokens, 3 heads of 20 at every length): there every prompt keeps the per-head
path.

Nothing else on this machine computes it much cheaper (benchmarks/studies/encoder/
bench_attention.py, four runs under the measurement lock at load 1.0-3.1:
benchmarks/results/encoder/attention.txt; 300 prompts of 8-256 tokens x 6 layers, 1 thread).
This path: medians 1.34-1.56 CPU-s, against 0.62-0.66 for its products at the sgemm's rate; the
softmax alone costs 0.44-0.65 ns a score at 256 tokens, 0.73-1.07 at 64, 2.6-2.7 at 16. Against
it: MKL's `cblas_sgemm` per head (its AVX2 kernels, `MKL_DEBUG_CPU_TYPE=5` as a worker sets it)
0.90-1.00x the time (within float32 rounding, 1.2e-6; at most ~1% of a forward, so not taken);
MKL's group API `cblas_sgemm_batch` with every head of every prompt of a batch in one call (one
softmax a prompt between the two calls; each product's bits the same as alone) 1.09-1.23x: a
batch's scores, tens of MB, are all written before the first softmax reads them; one matmul
primitive per product batched over the heads with runtime M, N, K (one primitive for every
length; bitwise these sgemm calls) 0.94-1.00x: 1.8-3.4x faster on prompts of 8-32 tokens (26-57
against 72-131 us a layer), no faster from 192 tokens (now short prompts' path, above); each
head's scores, softmax and product in turn (one head's scores in cache at a time) 0.99-1.08x;
torch's fused CPU `scaled_dot_product_attention` on the same strided views 1.05-1.20x.

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
    ARG_ATTR_SCALES,
    ARG_DST,
    ARG_SRC,
    ARG_SRC_1,
    ARG_WEIGHTS,
    F32,
    FORWARD_INFERENCE,
    RUNTIME_DIM,
    Arguments,
    DnnlError,
    P,
    PostOps,
    Primitive,
    RuntimePrimitive,
    dnnl,
    matmul_primitive_desc,
    memory_desc,
    post_op_arg,
    primitive_desc,
)
from aioprefill.workers.paddle.gemm import Products
from aioprefill.workers.paddle.onednn import openmp_threads
from aioprefill.workers.paddle.softmax import softmax_at_, softmax_rows_

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


SHORT_PROMPT = 128  # prompts of at most this many tokens: `_attend_batched`


class _Batched:
    """Attention's two products for one layout (heads, head size, qkv row width, context row
    width, scale), each ONE matmul primitive batched over the heads with runtime M, N, K and
    score strides (one primitive, one set of kernels, for every prompt length): q k^T * scale
    reads q [heads, n, hd] and k^T [heads, hd, n] in place from the qkv rows, p v writes each
    head's columns of the context rows. A length's memory objects (`Arguments`: no JIT) are
    made once and kept."""

    def __init__(self, heads: int, hd: int, width: int, hidden: int, scale: float) -> None:
        rt = RUNTIME_DIM
        self.heads, self.hd, self.width, self.hidden = heads, hd, width, hidden
        self.scale = np.array([scale], np.float32)
        self.scale_at = self.scale.ctypes.data
        self._attr = PostOps().scale(ARG_WEIGHTS)
        q, kt, sc, v, c = self._descs(rt)
        pd = matmul_primitive_desc(q, kt, sc, self._attr)
        self.qk = RuntimePrimitive(pd, keep=[self._attr])
        self.pv = RuntimePrimitive(matmul_primitive_desc(sc, v, c))
        self._args: dict[int, tuple[Arguments, Arguments]] = {}

    def _descs(self, n: int) -> list:
        h, hd, w, hidden = self.heads, self.hd, self.width, self.hidden
        nn = RUNTIME_DIM if n == RUNTIME_DIM else n * n
        return [
            memory_desc([h, n, hd], F32, [hd, w, 1]),  # q (and v) in the qkv rows
            memory_desc([h, hd, n], F32, [hd, 1, w]),  # k^T
            memory_desc([h, n, n], F32, [nn, n, 1]),  # scores, dense
            memory_desc([h, n, hd], F32, [hd, w, 1]),  # v
            memory_desc([h, n, hd], F32, [hd, hidden, 1]),  # the context's columns
        ]

    def args(self, n: int) -> tuple[Arguments, Arguments]:
        a = self._args.get(n)
        if a is None:
            q, kt, sc, v, c = self._descs(n)
            one = memory_desc([1], F32)
            qk = [
                (ARG_SRC, q),
                (ARG_WEIGHTS, kt),
                (ARG_DST, sc),
                (ARG_ATTR_SCALES | ARG_WEIGHTS, one),
            ]
            a = self._args[n] = (
                Arguments(qk),
                Arguments([(ARG_SRC, sc), (ARG_WEIGHTS, v), (ARG_DST, c)]),
            )
        return a


@functools.lru_cache(maxsize=8)
def _batched(heads: int, hd: int, width: int, hidden: int, scale: float) -> _Batched | None:
    """The layout's batched products, or None where oneDNN cannot make them (the per-head
    path then serves every length)."""
    try:
        return _Batched(heads, hd, width, hidden, scale)
    except DnnlError:
        return None


def _attend_batched(b: _Batched, row: int, out: int, n: int, sp: int) -> None:
    """`attend_`'s three steps with each product in one call over every head (q, k, v from
    the prompt's qkv rows at `row`, scores at `sp`, context rows at `out`)."""
    qk, pv = b.args(n)
    b.qk(qk, row, row + b.hidden * _F32, sp, b.scale_at)
    softmax_at_(sp, b.heads * n, n)
    b.pv(pv, sp, row + 2 * b.hidden * _F32, out)


def attend_(
    mm: Products, qkv: np.ndarray, ctx: np.ndarray, s: int, e: int, heads: int, scale: float,
    scores: np.ndarray,
) -> None:  # fmt: skip
    """Bidirectional attention of the prompt in rows s:e of the packed qkv [rows, 3 * hidden]
    (q, k, v column blocks) into ctx's rows s:e [rows, hidden]: each head's scores
    q_h k_h^T * scale by oneDNN's sgemm with leading dimensions (q_h, k_h read in place) into
    `scores` (C-contiguous float32, at least heads * n * n), oneDNN's softmax over every row of
    every head in one call, each head's probabilities @ v_h written straight into its columns
    of ctx. No copies, no transposes, no primitive per prompt length. A prompt of at most
    `SHORT_PROMPT` tokens at 1 thread: the same with each product one runtime-shape matmul
    primitive over every head (`_attend_batched`; bitwise the same context, 1.01-2.7x faster
    at 1-128 tokens)."""
    n, hidden = e - s, ctx.shape[1]
    hd, width = hidden // heads, qkv.shape[1]
    row, sp = qkv.ctypes.data + s * width * _F32, scores.ctypes.data
    out = ctx.ctypes.data + s * hidden * _F32
    if n <= SHORT_PROMPT and openmp_threads() == 1:
        b = _batched(heads, hd, width, hidden, scale)
        if b is not None:
            _attend_batched(b, row, out, n, sp)
            return
    for h in range(heads):
        q, k, a = row + h * hd * _F32, row + (hidden + h * hd) * _F32, sp + h * n * n * _F32
        mm.strided(n, n, hd, scale, q, width, k, width, a, n, transpose_b=True)
    softmax_rows_(scores.reshape(-1)[: heads * n * n].reshape(heads * n, n))
    for h in range(heads):
        a, v = sp + h * n * n * _F32, row + (2 * hidden + h * hd) * _F32
        mm.strided(n, hd, n, 1.0, a, n, v, width, out + h * hd * _F32, hidden, transpose_b=False)
