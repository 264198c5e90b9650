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
it at the array's memory: four ctypes calls. A row's result depends only on its own values and
`cols` (the primitive handles every row alike, whichever thread runs it), so batch-mates cannot
change it. oneDNN runs on the wheel's OpenMP runtime, whose thread count `PaddleRunner` sets.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from aioprefill.workers.paddle.env import onednn_library

__all__ = ["onednn_softmax_available", "softmax_rows_"]

# oneDNN 3.x's C enums (include/oneapi/dnnl/dnnl_types.h, dnnl_common_types.h)
_CPU, _IN_ORDER, _F32, _TAG_AB = 1, 1, 3, 3
_FORWARD_INFERENCE, _SOFTMAX_ACCURATE = 96, 0x30000
_ARG_SRC, _ARG_DST = 1, 17
_KEEP = 256  # shapes whose primitive is kept

_P = ctypes.c_void_p


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _P)]


def _ok(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"oneDNN call failed with status {status}")


class _Dnnl:
    """The library, one CPU engine and one in-order stream."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.dnnl_memory_set_data_handle.argtypes = [_P, _P]
        lib.dnnl_primitive_execute.argtypes = [_P, _P, ctypes.c_int, _P]
        lib.dnnl_softmax_forward_primitive_desc_create.argtypes = [
            *(_P, _P, ctypes.c_int, ctypes.c_int, _P, _P, ctypes.c_int, _P)
        ]
        self.engine, self.stream = _P(), _P()
        _ok(lib.dnnl_engine_create(ctypes.byref(self.engine), _CPU, 0))
        _ok(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, _IN_ORDER))


@functools.cache
def _dnnl() -> _Dnnl | None:
    lib = onednn_library()
    try:
        return None if lib is None else _Dnnl(lib)
    except (AttributeError, RuntimeError):
        return None


def onednn_softmax_available() -> bool:
    """Whether Paddle's wheel has a oneDNN this module can call."""
    return _dnnl() is not None


class _Softmax:
    """One shape's primitive and the memory object it reads and writes (in place)."""

    def __init__(self, dnnl: _Dnnl, rows: int, cols: int) -> None:
        lib = self._lib = dnnl.lib
        self._stream = dnnl.stream
        self._md, self._pd, self._prim, self._mem = _P(), _P(), _P(), _P()
        dims = (ctypes.c_int64 * 2)(rows, cols)
        _ok(lib.dnnl_memory_desc_create_with_tag(ctypes.byref(self._md), 2, dims, _F32, _TAG_AB))
        _ok(
            lib.dnnl_softmax_forward_primitive_desc_create(
                ctypes.byref(self._pd),
                dnnl.engine,
                _FORWARD_INFERENCE,
                _SOFTMAX_ACCURATE,
                self._md,
                self._md,
                1,
                None,
            )
        )
        _ok(lib.dnnl_primitive_create(ctypes.byref(self._prim), self._pd))
        _ok(lib.dnnl_memory_create(ctypes.byref(self._mem), self._md, dnnl.engine, None))
        self._args = (_Arg * 2)(_Arg(_ARG_SRC, self._mem), _Arg(_ARG_DST, self._mem))

    def __call__(self, address: int) -> None:
        lib = self._lib
        _ok(lib.dnnl_memory_set_data_handle(self._mem, address))
        _ok(lib.dnnl_primitive_execute(self._prim, self._stream, 2, self._args))
        _ok(lib.dnnl_stream_wait(self._stream))

    def __del__(self) -> None:
        lib = self._lib
        for handle, destroy in (
            (self._mem, lib.dnnl_memory_destroy),
            (self._prim, lib.dnnl_primitive_destroy),
            (self._pd, lib.dnnl_primitive_desc_destroy),
            (self._md, lib.dnnl_memory_desc_destroy),
        ):
            if handle:
                destroy(handle)


@functools.lru_cache(maxsize=_KEEP)
def _primitive(rows: int, cols: int) -> _Softmax:
    dnnl = _dnnl()
    assert dnnl is not None
    return _Softmax(dnnl, rows, cols)


def softmax_rows_(x: np.ndarray) -> None:
    """Softmax over the last axis of `x` (C-contiguous float32), written over `x`."""
    if not x.size:
        return
    assert x.dtype == np.float32 and x.flags.c_contiguous
    cols = x.shape[-1]
    _primitive(x.size // cols, cols)(x.ctypes.data)
