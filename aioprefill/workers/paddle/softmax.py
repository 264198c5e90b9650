"""`softmax_rows_`: softmax over the last axis of a contiguous float32 CPU array, in place, by
oneDNN's softmax primitive from Paddle's wheel.

Attention's softmax was 6% of a CPU forward's time (SmolLM2-135M, 8 x 280 ids, 1 thread,
py-spy): Paddle's CPU `softmax` kernel runs its passes in scalar loops (~1.7 ns per score on
a 2-vCPU Intel Xeon build host; NumPy's vectorised passes are no faster). oneDNN's JIT
kernel (`jit:avx512_core` or `jit:avx2` by the CPU) takes the row in one read, ~4-5x faster on
attention's shapes (9 x 128 x 256 scores: 0.11 against 0.55 ms), within a few float32 ulps of
Paddle's. The wheel ships the library for its static-graph kernels (`paddle.gemm` calls its
`dnnl_sgemm` the same way); Paddle's eager `softmax` never reaches it, with `FLAGS_use_mkldnn`
or without (checked with `ONEDNN_VERBOSE=1`).

The primitive for a `[rows, cols]` shape is made once and kept (an LRU of `_KEEP` shapes; the
kernel depends on `cols`, the row count only splits the work over threads), and each call points
it at the array's memory (`paddle.dnnl.Primitive`). A row's result depends only on its own
values and `cols` (the primitive handles every row alike, whichever thread runs it), so
batch-mates cannot change it. oneDNN runs on the wheel's OpenMP runtime, whose thread count
`PaddleRunner` sets.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from aioprefill.workers.paddle.dnnl import (
    ARG_DST,
    ARG_SRC,
    F32,
    FORWARD_INFERENCE,
    SOFTMAX_ACCURATE,
    P,
    Primitive,
    dnnl,
    memory_desc,
    primitive_desc,
)

__all__ = ["onednn_softmax_available", "softmax_at_", "softmax_rows_"]

_KEEP = 256  # shapes whose primitive is kept


def onednn_softmax_available() -> bool:
    """Whether Paddle's wheel has a oneDNN this module can call."""
    return dnnl() is not None


@functools.lru_cache(maxsize=_KEEP)
def _primitive(rows: int, cols: int) -> Primitive:
    """Softmax over each row of a [rows, cols] float32 array, in place (src and dst one
    memory: the same argument descriptor, pointed at the same address)."""
    d = dnnl()
    assert d is not None
    md = memory_desc([rows, cols], F32)
    i = ctypes.c_int
    pd = primitive_desc(
        "dnnl_softmax_forward_primitive_desc_create", [P, i, i, P, P, i, P],
        d.engine, FORWARD_INFERENCE, SOFTMAX_ACCURATE, md.handle, md.handle, 1, None,
    )  # fmt: skip
    return Primitive(pd, [(ARG_SRC, md), (ARG_DST, md)])


def softmax_rows_(x: np.ndarray) -> None:
    """Softmax over the last axis of `x` (C-contiguous float32), written over `x`."""
    if not x.size:
        return
    assert x.dtype == np.float32 and x.flags.c_contiguous
    cols = x.shape[-1]
    a = x.ctypes.data
    _primitive(x.size // cols, cols)(a, a)


def softmax_at_(address: int, rows: int, cols: int) -> None:
    """`softmax_rows_` on a C-contiguous float32 [rows, cols] at a raw address (no NumPy view
    made: a few us saved on a short prompt's attention)."""
    _primitive(rows, cols)(address, address)
