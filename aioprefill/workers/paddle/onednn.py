"""oneDNN's C API through ctypes, for `paddle.gemm.Products`: its row-major gemm routines from
Paddle's wheel (`dnnl_sgemm`, `dnnl_gemm_bf16bf16f32`), whether a CPU worker can run bfloat16
(`cpu_bf16`), the rounding of float32 activations to the bf16 bits the bf16 routine reads
(`Bf16Cast`), bf16 q/k/v in one matmul primitive (`heads_product`), and the OpenMP thread
count both libraries share. Why oneDNN and not Paddle's MKL `matmul`: gemm.py's docstring."""

from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import NamedTuple

import numpy as np
import paddle

from aioprefill.errors import InvalidConfig
from aioprefill.hf.dtype import cpu_bf16_units
from aioprefill.workers.paddle.dnnl import (
    ARG_DST,
    ARG_SRC,
    ARG_WEIGHTS,
    BF16,
    F32,
    PostOps,
    Primitive,
    dnnl,
    matmul_primitive_desc,
    memory_desc,
    reorder_primitive,
)
from aioprefill.workers.paddle.env import onednn_library, paddle_libs

__all__ = [
    "Bf16Cast",
    "Extension",
    "check",
    "cpu_bf16",
    "has_gemm_bf16",
    "heads_product",
    "load_gemm",
    "load_gemm_bf16",
    "load_sgemm",
    "openmp_threads",
    "set_openmp_threads",
]


@functools.cache
def load_gemm(symbol: str) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """oneDNN's row-major gemm `symbol` from Paddle's wheel, or None where there is none:
    `dnnl_sgemm` (float32) or `dnnl_gemm_bf16bf16f32` (bf16 A and B; float32 C, float32
    accumulation), both with the same arguments. Called after paddle loaded the library, so its
    OpenMP calls are bound as Paddle's are."""
    lib = onednn_library()
    if lib is None or not hasattr(lib, symbol):
        return None
    fn = getattr(lib, symbol)
    size, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.restype = ctypes.c_int
    # transa, transb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc
    fn.argtypes = [ctypes.c_char, ctypes.c_char, size, size, size, f32, ptr, size, ptr, size]
    fn.argtypes += [f32, ptr, size]
    return fn


def load_sgemm() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return load_gemm("dnnl_sgemm")


def load_gemm_bf16() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    return load_gemm("dnnl_gemm_bf16bf16f32")


def has_gemm_bf16() -> bool:
    """Whether this wheel's oneDNN has the bf16 product a bfloat16 CPU worker needs."""
    return load_gemm_bf16() is not None


def cpu_bf16(dtype: str, device: str) -> bool:
    """Whether a worker runs bfloat16 on a CPU (bf16 weights and products, float32 elsewhere).
    Raises `InvalidConfig` for a dtype the CPU does not run: float16, or bfloat16 where the CPU
    has no bf16 units (avx512_bf16 or AMX: `hf.dtype.cpu_bf16_units`) or the wheel's oneDNN no
    bf16 product (`dtype="auto"` picks float32 there instead)."""
    if device != "cpu" or dtype == "float32":
        return False
    if dtype != "bfloat16":
        raise InvalidConfig(
            f"PaddleModel.dtype: {dtype} needs a GPU; the CPU runs float32 or bfloat16"
        )
    if not cpu_bf16_units():
        raise InvalidConfig(
            "PaddleModel.dtype: bfloat16 on this CPU needs avx512_bf16 or AMX (not in "
            "/proc/cpuinfo's flags): use dtype='float32' or 'auto'"
        )
    if not has_gemm_bf16():
        raise InvalidConfig(
            "PaddleModel.dtype: bfloat16 on a CPU needs oneDNN's dnnl_gemm_bf16bf16f32, which "
            "this paddle wheel does not ship: use dtype='float32' or 'auto'"
        )
    return True


class Extension(NamedTuple):
    """What an extended bf16 weight carries after its k own inputs (`paddle.lo_channels`): its
    input channels `cols` again (against x's rest on them, x - bf16(x)), and with `weight_rest`
    then its own rest on them (w - bf16(w) of a float32 weight, against x's bf16 rounding)."""

    cols: np.ndarray
    weight_rest: bool = False

    @property
    def inputs(self) -> int:
        """How many inputs the weight carries after its k own."""
        return len(self.cols) * (2 if self.weight_rest else 1)


class Bf16Cast:
    """float32 tensor -> its values rounded to bfloat16 (round to nearest even), as uint16 bits
    in kept, grow-only buffers (one set per `Products`: products run one at a time). Bitwise
    Paddle's cast (checked in the study); by oneDNN's reorder where the wheel has oneDNN, else
    NumPy passes on the bits (3x Paddle's cast); NaNs are not expected in activations.
    `split`: also the rest, x - hi, rounded to bfloat16 the same way (bf16x2: hi + lo carry x
    to ~2^-17 of its value, where hi alone carries it to 2^-9)."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def _buf(self, name: str, n: int, dtype: type) -> np.ndarray:
        b = self._bufs.get(name)
        if b is None or b.size < n:
            b = self._bufs[name] = np.empty(n, dtype)
        return b[:n]

    def _round(self, u: np.ndarray, name: str) -> np.ndarray:
        o = self._buf(name, u.size, np.uint16)
        if u.size and dnnl() is not None:  # one oneDNN reorder pass: the same bits, ~5x faster
            _to_bf16(u.size)(u.ctypes.data, o.ctypes.data)
            return o
        t = self._buf("u32", u.size, np.uint32)
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, u, out=t)
        np.right_shift(t, 16, out=t)
        np.copyto(o, t, casting="unsafe")
        return o

    def __call__(self, x: paddle.Tensor) -> int:
        """The address of x's bf16 bits (valid until the next call)."""
        return int(self._round(np.from_dlpack(x).reshape(-1).view(np.uint32), "hi").ctypes.data)

    def split(self, x: paddle.Tensor) -> tuple[int, int]:
        """The addresses of hi's and lo's bf16 bits (valid until the next call)."""
        hi, lo = self._hi_lo(np.from_dlpack(x).reshape(-1).view(np.uint32), "")
        return int(hi.ctypes.data), int(lo.ctypes.data)

    def extend(self, x: paddle.Tensor, ext: Extension) -> int:
        """The address of x's extended rows, bf16 [rows, k + ext.inputs]: x rounded (the bits
        `__call__` gives), then the rest of its channels `ext.cols` (x - hi, rounded: bf16x2 on
        s channels), with `ext.weight_rest` then those channels' hi again."""
        v = np.from_dlpack(x)
        rows, k = v.shape
        s = len(ext.cols)
        out = self._buf("ext", rows * (k + ext.inputs), np.uint16).reshape(rows, k + ext.inputs)
        if rows == 0:
            return int(out.ctypes.data)
        if dnnl() is not None:  # rounded straight into the rows, `stride` apart
            _to_bf16_rows(rows, k, k + ext.inputs)(v.ctypes.data, out.ctypes.data)
        else:
            out[:, :k] = self._round(v.reshape(-1).view(np.uint32), "hi").reshape(rows, k)
        picked = self._buf("picked", rows * s, np.float32).reshape(rows, s)
        np.take(v, ext.cols, axis=1, out=picked)
        _, lo = self._hi_lo(picked.reshape(-1).view(np.uint32), "picked_")
        out[:, k : k + s] = lo.reshape(rows, s)
        if ext.weight_rest:
            np.take(out[:, :k], ext.cols, axis=1, out=out[:, k + s :])
        return int(out.ctypes.data)

    def _hi_lo(self, u: np.ndarray, prefix: str) -> tuple[np.ndarray, np.ndarray]:
        """float32 bits `u` -> (hi, lo) bf16 bits, hi = bf16(x), lo = bf16(x - hi), in the
        buffers named `prefix` + hi / lo / rest."""
        hi = self._round(u, prefix + "hi")
        rest = self._buf(prefix + "rest", u.size, np.float32)
        r32 = rest.view(np.uint32)
        np.copyto(r32, hi)
        np.left_shift(r32, 16, out=r32)  # hi's values
        np.subtract(u.view(np.float32), rest, out=rest)  # exact: x - hi
        return hi, self._round(r32, prefix + "lo")


@functools.lru_cache(maxsize=64)
def _to_bf16(n: int) -> Primitive:
    """float32 [n] -> bfloat16 [n], oneDNN's reorder: round to nearest even, bitwise the NumPy
    passes above (checked on SmolLM2's activations and on ties; tests/model/test_bf16.py), one
    read and one write (2,240 x 576: 0.13 against 0.64 ms, 1 thread, AMD Zen 4)."""
    return reorder_primitive(memory_desc([n], F32), memory_desc([n], BF16))


@functools.lru_cache(maxsize=64)
def _to_bf16_rows(rows: int, k: int, stride: int) -> Primitive:
    """float32 [rows, k] -> bfloat16 rows `stride` elements apart (`Bf16Cast.extend`)."""
    return reorder_primitive(memory_desc([rows, k], F32), memory_desc([rows, k], BF16, [stride, 1]))


@functools.lru_cache(maxsize=32)  # ~0.27 MB of JIT code each: dnnl._CACHE_CAPACITY's note
def heads_product(rows: int, k: int, heads: int, dim: int, *, add: bool = False) -> Primitive:
    """bf16 x [rows, k] times bf16 w [heads, k, dim] -> float32 [heads, rows, dim], float32
    accumulation: one oneDNN matmul primitive, batched over the heads with x broadcast (called
    with x's, w's and the output's addresses). oneDNN picks its brgemm kernels for fixed shapes
    (`brg_matmul:avx512_core_bf16` on AMD Zen 4; runtime dims or strides fall back to the gemm
    routine's kernels): q/k/v of SmolLM2 at 2,240 rows 11.7 against 14.4 ms CPU as 15 narrow
    per-head `dnnl_gemm_bf16bf16f32` calls in 256-row blocks, 280 rows 1.40 against 1.80, 16
    rows 0.11 against 0.20 (1 thread, AMD Zen 4; benchmarks/results/model/heads_product.txt).
    Its rows kept their bits at every row count tried, 1 to 2,240, at 1 and 2 threads
    (`paddle.rows` checks the worker's own); against the gemm routine they differ by float32
    rounding (~2e-6 of unit-scale values). One primitive per row count (~0.5-1.8 ms to make,
    then reused by every layer; ~0.27 MB of JIT code each, hence the small LRU and
    `dnnl._CACHE_CAPACITY`). `add`: the product is added to the output's values (a sum
    post-op: bf16x2's second product)."""
    src = memory_desc([1, rows, k], BF16)
    weights = memory_desc([heads, k, dim], BF16)
    dst = memory_desc([heads, rows, dim], F32)
    attr = PostOps().sum() if add else None
    pd = matmul_primitive_desc(src, weights, dst, attr)
    args = [(ARG_SRC, src), (ARG_WEIGHTS, weights), (ARG_DST, dst)]
    return Primitive(pd, args, keep=[] if attr is None else [attr])


def _openmp_runtimes() -> list[ctypes.CDLL]:
    """The OpenMP runtimes that load: Paddle's libiomp5 first (whose symbols oneDNN's calls
    reach), then libgomp."""
    libs = paddle_libs()
    found = []
    for name in (str(libs / "libiomp5.so") if libs else None, "libgomp.so.1"):
        if name is None:
            continue
        try:
            found.append(ctypes.CDLL(name))
        except OSError:
            continue
    return found


def set_openmp_threads(threads: int) -> None:
    """The OpenMP runtime's thread count (oneDNN asks it; Paddle sets MKL's own count)."""
    for lib in _openmp_runtimes():
        with contextlib.suppress(AttributeError):
            lib.omp_set_num_threads(threads)


@functools.cache
def _get_max_threads() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    for lib in _openmp_runtimes():
        fn = getattr(lib, "omp_get_max_threads", None)
        if fn is not None:
            fn.argtypes, fn.restype = [], ctypes.c_int
            return fn
    return None


def openmp_threads() -> int:
    """The OpenMP runtime's thread count as oneDNN reads it (the first runtime
    `set_openmp_threads` sets: Paddle's libiomp5, whose symbols oneDNN's calls reach), or 0
    where none loads. ~0.2 us a call."""
    fn = _get_max_threads()
    return 0 if fn is None else int(fn())


def check(status: int) -> None:
    if status != 0:
        raise RuntimeError(f"oneDNN's gemm failed with status {status}")
