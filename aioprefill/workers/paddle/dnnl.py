"""oneDNN's primitive API through ctypes, on the library Paddle's wheel ships (`libdnnl.so.3`,
oneDNN 3.6 in Paddle 3.3): one CPU engine and in-order stream per process (`dnnl()`), memory
descriptors (`memory_desc`), post-op attributes (`PostOps`) and `Primitive`, a primitive made once
for its shapes and pointed at arrays' memory on each call.

Why by hand: Paddle's eager CPU kernels never reach oneDNN (`FLAGS_use_mkldnn` changes nothing
there: checked with `ONEDNN_VERBOSE=1`), and no PyPI package binds oneDNN's C API without
bringing its own copy and OpenMP runtime; the wheel's library runs on the OpenMP pool Paddle's
kernels use, whose size `PaddleRunner` sets. The enum values are oneDNN 3.x's
(`include/oneapi/dnnl/dnnl_types.h`, `dnnl_common_types.h`); a primitive the library cannot make
for a shape raises `DnnlError` with oneDNN's status, and callers keep their NumPy or Paddle path.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

from aioprefill.workers.paddle.env import onednn_library

__all__ = [
    "ARG_ATTR_SCALES",
    "ARG_DST",
    "ARG_SRC",
    "ARG_SRC_1",
    "ARG_WEIGHTS",
    "BF16",
    "BINARY_MUL",
    "ELTWISE_SWISH",
    "F32",
    "RUNTIME_DIM",
    "Arguments",
    "Dnnl",
    "DnnlError",
    "PostOps",
    "Primitive",
    "RuntimePrimitive",
    "binary_primitive",
    "check",
    "dnnl",
    "eltwise_primitive",
    "matmul_primitive_desc",
    "memory_desc",
    "post_op_arg",
    "primitive_desc",
    "reorder_primitive",
]

P = ctypes.c_void_p

# data types
BF16, F32 = 2, 3
# propagation kinds, algorithms
FORWARD_INFERENCE = 96
SOFTMAX_ACCURATE = 0x30000
ELTWISE_SWISH = 0x2C  # x * sigmoid(alpha * x); dnnl_eltwise_relu is 0x20, then tanh, elu, ...
BINARY_MUL = 0x1FFF1
# execution argument ids
ARG_SRC, ARG_SRC_1, ARG_DST = 1, 2, 17
ARG_WEIGHTS, ARG_BIAS = 33, 41
_POST_OP_BASE = 32768  # DNNL_ARG_ATTR_MULTIPLE_POST_OP_BASE (oneDNN 3.x)
ARG_ATTR_SCALES = 4096  # DNNL_ARG_ATTR_SCALES: an argument's scales are `ARG_ATTR_SCALES | arg`
RUNTIME_DIM = -(1 << 63)  # DNNL_RUNTIME_DIM_VAL: a dimension or stride given at execution
_CPU, _IN_ORDER = 1, 1
_CACHE_CAPACITY = 256  # oneDNN's primitive cache, per process (`Dnnl`)


class DnnlError(RuntimeError):
    """A oneDNN call returned a status other than success."""

    def __init__(self, call: str, status: int) -> None:
        super().__init__(f"oneDNN {call} failed with status {status}")
        self.status = status


def check(status: int, call: str = "call") -> None:
    if status != 0:
        raise DnnlError(call, status)


def post_op_arg(index: int, arg: int = ARG_SRC_1) -> int:
    """The execution argument id of post-op `index`'s operand (a binary post-op's src1)."""
    return _POST_OP_BASE * (index + 1) | arg


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", P)]


class Dnnl:
    """The library with the argument types this module's calls need, one CPU engine and one
    in-order stream."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        lib.dnnl_memory_set_data_handle.argtypes = [P, P]
        lib.dnnl_primitive_execute.argtypes = [P, P, ctypes.c_int, P]
        lib.dnnl_memory_create.argtypes = [P, P, P, P]
        lib.dnnl_primitive_create.argtypes = [P, P]
        f32 = ctypes.c_float
        lib.dnnl_post_ops_append_eltwise.argtypes = [P, ctypes.c_int, f32, f32]
        lib.dnnl_post_ops_append_binary.argtypes = [P, ctypes.c_int, P]
        lib.dnnl_post_ops_append_sum.argtypes = [P, f32, ctypes.c_int32, ctypes.c_int]
        lib.dnnl_primitive_attr_set_post_ops.argtypes = [P, P]
        # Every primitive this package makes is held by its caller's LRU while in use; oneDNN's
        # own cache (1,024 by default) speeds re-creating an evicted one (a softmax: 0.02
        # against 0.23 ms), and it kept each bf16 q/k/v matmul's JIT code alive (~0.27 MB per
        # row count: +187 MB after 600 row counts and growing; +87 MB, flat, at 256, the
        # largest of the callers' LRUs): a server sees a new row count nearly every forward.
        lib.dnnl_set_primitive_cache_capacity.argtypes = [ctypes.c_int]
        check(lib.dnnl_set_primitive_cache_capacity(_CACHE_CAPACITY), "primitive_cache")
        self.engine, self.stream = P(), P()
        check(lib.dnnl_engine_create(ctypes.byref(self.engine), _CPU, 0), "engine_create")
        check(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, _IN_ORDER))


@functools.cache
def dnnl() -> Dnnl | None:
    """The process's oneDNN (loaded after paddle), or None where the wheel has none usable."""
    lib = onednn_library()
    try:
        return None if lib is None else Dnnl(lib)
    except (AttributeError, DnnlError):
        return None


def _need() -> Dnnl:
    d = dnnl()
    if d is None:
        raise DnnlError("library load", -1)
    return d


class MemoryDesc:
    """An owned `dnnl_memory_desc_t`: dense row-major, or with explicit strides (in elements)."""

    def __init__(self, dims: Sequence[int], dtype: int, strides: Sequence[int] | None = None):
        lib = self._lib = _need().lib
        self.handle = P()
        n = len(dims)
        d = (ctypes.c_int64 * n)(*dims)
        if strides is None:
            strides = [1] * n
            for i in range(n - 2, -1, -1):
                strides[i] = strides[i + 1] * dims[i + 1]
        s = (ctypes.c_int64 * n)(*strides)
        check(
            lib.dnnl_memory_desc_create_with_strides(ctypes.byref(self.handle), n, d, dtype, s),
            "memory_desc_create_with_strides",
        )

    def __del__(self) -> None:
        if self.handle:
            self._lib.dnnl_memory_desc_destroy(self.handle)


def memory_desc(
    dims: Sequence[int], dtype: int, strides: Sequence[int] | None = None
) -> MemoryDesc:
    return MemoryDesc(dims, dtype, strides)


class PostOps:
    """A primitive attribute with post-ops appended in order (`eltwise`, `binary`, `sum`) and
    argument scales (`scale`)."""

    def __init__(self) -> None:
        lib = self._lib = _need().lib
        self.attr, self._ops = P(), P()
        check(lib.dnnl_primitive_attr_create(ctypes.byref(self.attr)), "primitive_attr_create")
        check(lib.dnnl_post_ops_create(ctypes.byref(self._ops)), "post_ops_create")
        self._keep: list[MemoryDesc] = []
        self.count = 0

    def eltwise(self, alg: int, alpha: float = 0.0, beta: float = 0.0) -> PostOps:
        check(self._lib.dnnl_post_ops_append_eltwise(self._ops, alg, alpha, beta), "eltwise")
        return self._done()

    def binary(self, alg: int, src1: MemoryDesc) -> PostOps:
        """Appends a binary post-op: its operand is argument `post_op_arg(index)`."""
        self._keep.append(src1)
        check(self._lib.dnnl_post_ops_append_binary(self._ops, alg, src1.handle), "binary")
        return self._done()

    def sum(self, scale: float = 1.0) -> PostOps:
        """dst += the product's result (dst's values before the call, scaled)."""
        check(self._lib.dnnl_post_ops_append_sum(self._ops, scale, 0, 0), "sum")
        return self._done()

    def scale(self, arg: int) -> PostOps:
        """A common scale for argument `arg` (execution argument `ARG_ATTR_SCALES | arg`: a
        float32 [1]; a matmul multiplies its product by it). Not a post-op: `count` stays."""
        fn = self._lib.dnnl_primitive_attr_set_scales_mask
        fn.argtypes = [P, ctypes.c_int, ctypes.c_int]
        check(fn(self.attr, arg, 0), "set_scales_mask")
        return self

    def _done(self) -> PostOps:
        self.count += 1
        check(self._lib.dnnl_primitive_attr_set_post_ops(self.attr, self._ops), "set_post_ops")
        return self

    def __del__(self) -> None:
        if self._ops:
            self._lib.dnnl_post_ops_destroy(self._ops)
        if self.attr:
            self._lib.dnnl_primitive_attr_destroy(self.attr)


class Arguments:
    """One memory object per execution argument of a primitive (`args`: (argument id,
    descriptor) pairs). `point(addresses)` points them, in `args`' order, re-pointing only what
    moved (a ctypes call is ~1 us). Memory objects compile nothing: a `RuntimePrimitive`'s
    callers keep one a shape."""

    def __init__(self, args: Sequence[tuple[int, MemoryDesc]]) -> None:
        d = _need()
        lib = self._lib = d.lib
        self._descs, self._mems = [md for _, md in args], []  # the memory objects refer to them
        for _, md in args:
            self._mems.append(m := P())
            check(lib.dnnl_memory_create(ctypes.byref(m), md.handle, d.engine, None), "memory")
        pairs = zip(args, self._mems, strict=True)
        self.array = (_Arg * len(args))(*(_Arg(a, m) for (a, _), m in pairs))
        self.n = len(args)
        self._last: list[int | None] = [None] * len(args)

    def point(self, addresses: Sequence[int]) -> None:
        if len(addresses) != self.n:
            raise ValueError(f"{len(addresses)} addresses for {self.n} arguments")
        for i, a in enumerate(addresses):
            if self._last[i] != a:
                check(self._lib.dnnl_memory_set_data_handle(self._mems[i], a), "set_data_handle")
                self._last[i] = a

    def __del__(self) -> None:
        for m in getattr(self, "_mems", ()):
            self._lib.dnnl_memory_destroy(m)


class Primitive:
    """A primitive from its descriptor `pd` (created by the caller with this module's engine;
    owned from here on) and its execution arguments (`Arguments(args)`: `args` pairs an argument
    id with its descriptor). `__call__(*addresses)` points each argument, in `args`' order, at an
    address and runs the primitive to completion. A primitive's result for an element depends
    on its shapes, not on the memory it is pointed at, so one made for a shape serves every
    array of that shape (callers keep them in an LRU)."""

    def __init__(
        self, pd: P, args: Sequence[tuple[int, MemoryDesc]], keep: Sequence[object] = ()
    ) -> None:
        """`keep`: objects the descriptor refers to that must live as long as the primitive
        (its `PostOps`, a descriptor that is no argument)."""
        d = _need()
        lib = self._lib = d.lib
        self._stream = d.stream
        self._pd, self._prim = pd, P()
        self._keep = list(keep)
        check(lib.dnnl_primitive_create(ctypes.byref(self._prim), pd), "primitive_create")
        self._args = Arguments(args)

    def __call__(self, *addresses: int) -> None:
        self._run(self._args, addresses)

    def _run(self, args: Arguments, addresses: Sequence[int]) -> None:
        args.point(addresses)
        lib = self._lib
        check(lib.dnnl_primitive_execute(self._prim, self._stream, args.n, args.array), "execute")
        check(lib.dnnl_stream_wait(self._stream), "stream_wait")

    def __del__(self) -> None:
        lib = self._lib
        if self._prim:
            lib.dnnl_primitive_destroy(self._prim)
        if self._pd:
            lib.dnnl_primitive_desc_destroy(self._pd)


def primitive_desc(create: str, argtypes: list, *args: object) -> P:
    """A primitive descriptor from oneDNN's `create` function (`dnnl_*_primitive_desc_create`:
    `argtypes` and `args` after its first, the descriptor's address), raising `DnnlError`."""
    d = _need()
    fn = getattr(d.lib, create)
    fn.argtypes = [P, *argtypes]
    pd = P()
    check(fn(ctypes.byref(pd), *args), create)
    return pd


def reorder_primitive(src: MemoryDesc, dst: MemoryDesc) -> Primitive:
    """A copy of `src` into `dst`'s layout and data type (called with src's, then dst's
    address). f32 to bf16 rounds to nearest even (vcvtneps2bf16 where the CPU has it)."""
    e = _need().engine
    args = (src.handle, e, dst.handle, e, None)
    pd = primitive_desc("dnnl_reorder_primitive_desc_create", [P, P, P, P, P], *args)
    return Primitive(pd, [(ARG_SRC, src), (ARG_DST, dst)])


def eltwise_primitive(
    alg: int, src: MemoryDesc, dst: MemoryDesc, alpha: float = 0.0, beta: float = 0.0
) -> Primitive:
    """An element-wise op (called with src's, then dst's address; the same address: in place).
    oneDNN 3.6 JIT-compiles it only for dense memory with src and dst of one data type and no
    post-ops (checked with ONEDNN_VERBOSE=all: the rest runs its reference loops)."""
    f, i = ctypes.c_float, ctypes.c_int
    pd = primitive_desc(
        "dnnl_eltwise_forward_primitive_desc_create", [P, i, i, P, P, f, f, P],
        _need().engine, FORWARD_INFERENCE, alg, src.handle, dst.handle, alpha, beta, None,
    )  # fmt: skip
    return Primitive(pd, [(ARG_SRC, src), (ARG_DST, dst)])


def binary_primitive(alg: int, src0: MemoryDesc, src1: MemoryDesc, dst: MemoryDesc) -> Primitive:
    """dst = src0 (op) src1 (called with src0's, src1's, dst's addresses). JIT-compiled for
    float32 in and out (a bf16 dst ran oneDNN 3.6's reference loops on an AMD Zen 4)."""
    args = (_need().engine, alg, src0.handle, src1.handle, dst.handle, None)
    pd = primitive_desc("dnnl_binary_primitive_desc_create", [P, ctypes.c_int, P, P, P, P], *args)
    return Primitive(pd, [(ARG_SRC, src0), (ARG_SRC_1, src1), (ARG_DST, dst)])


def matmul_primitive_desc(
    src: MemoryDesc, weights: MemoryDesc, dst: MemoryDesc, attr: PostOps | None = None
) -> P:
    """dst = src @ weights, batched over the leading dims (no bias). Dims and strides may be
    `RUNTIME_DIM`: one primitive then serves every shape (`RuntimePrimitive`)."""
    a = None if attr is None else attr.attr
    args = (_need().engine, src.handle, weights.handle, None, dst.handle, a)
    return primitive_desc("dnnl_matmul_primitive_desc_create", [P, P, P, P, P, P], *args)


class RuntimePrimitive(Primitive):
    """A primitive whose descriptor has `RUNTIME_DIM` dims or strides: one primitive, one set
    of kernels, for every shape. Called with an `Arguments` for the call's shapes, then the
    addresses in its order."""

    def __init__(self, pd: P, keep: Sequence[object] = ()) -> None:
        super().__init__(pd, [], keep)

    def __call__(self, args: Arguments, *addresses: int) -> None:  # type: ignore[override]
        self._run(args, addresses)
