"""`Products`: the matrix products of a worker's forward, on the CPU through oneDNN's sgemm.

Paddle's CPU wheel multiplies matrices with Intel MKL, which on AMD processors runs its AVX2
kernels at best (`paddle.env`). The same wheel ships oneDNN (`paddle/libs/libdnnl.so.3`, for its
static-graph kernels), whose `dnnl_sgemm` picks kernels by the CPU's instruction set (AVX-512
where there is one) on any vendor: the routine CTranslate2 multiplies with by default. Paddle's
eager `matmul` never reaches it (`FLAGS_use_mkldnn` changes nothing there: measured), so a CPU
worker calls it through ctypes on the tensors' memory, into an output Paddle allocated. Both
libraries run on the wheel's one OpenMP runtime (libiomp5: oneDNN's GNU OpenMP calls bind to it),
so they share one thread pool. Measured on an AMD EPYC Zen 4 (whose AVX-512 units are 256 bits
wide: AVX2 and AVX-512 have the same peak), 1 thread: oneDNN 0.9-1.2x MKL from ~280 rows up,
0.5-1.0x below 64 rows; CTranslate2 ran 1.2-1.3x faster on oneDNN than on its MKL here, 2x on
the machine issue 25 was measured on (docs/perf-ctranslate2.md).

Exactness: float32 in, out and accumulated, as MKL; the two differ by float32 rounding only
(~5e-6 on unit-scale products). Where MKL has its own AVX-512 kernels (Intel) or there is no
AVX-512, or with `AIOPREFILL_CPU_GEMM=mkl` (read when a worker starts: `paddle.env.cpu_gemm`),
the worker keeps Paddle's own `matmul`, as it does on a GPU, for a dtype other than float32, or
with a wheel without the library.

bfloat16 (`PaddleModel.dtype="bfloat16"` on a CPU: weights bfloat16, activations float32):
Paddle's CPU eager ops have no bfloat16 matmul, so `linear`, `project` and `product` with a
bfloat16 weight and a float32 `x` round `x` to bfloat16 (round to nearest even, NumPy on its bits
into a kept buffer: bitwise Paddle's cast, ~3x faster) and call oneDNN's `dnnl_gemm_bf16bf16f32`
from the same library: bfloat16 inputs, float32 accumulation, float32 output written straight
into the Paddle tensor (AMX where the CPU has it, avx512_bf16 otherwise). Its rows are bitwise
batch-invariant from 2 rows (measured for SmolLM2's shapes at 1 and 2 threads while designing
issue 35; `paddle.rows` checks it at start, the tests bitwise), so the tiles and the row floor
hold as for sgemm. `project` (q/k/v) runs every head in one matmul primitive instead
(`paddle.onednn.heads_product`), except in tiles. `per_head` (attention) stays float32. With
`split=True` x goes as bf16x2, hi = bf16(x) and lo = bf16(x - hi), in two products into the
same output (the second adds): x's rounding error drops from 2^-9 to ~2^-17 of each value at
twice that product's cost (the runner's first layers where `paddle.lo_channels` does not apply).
An `extended` weight ([.., k + s]: its last s inputs repeat s of its channels) takes x's bf16
rounding and those channels' rest in one product over k + s inputs (`paddle.lo_channels`); the
LM head's prompt rows, k + 2s: the weight's own rest on those channels too (`Extension`).
`add_linear` (a residual connection) adds a bf16 product into its float32 sum
in place (beta=1 on every pass).

Batch invariance: with `tile_rows` (`deterministic=True`) `linear` and `project` multiply fixed
tiles of that many rows, each written in place into the output (no split, no concat), so no
product's shape depends on the batch; without it a row's result may move by float32 rounding
with the product's row count (within the tests' 1e-5).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import paddle

from aioprefill.workers.paddle.dnnl import dnnl
from aioprefill.workers.paddle.env import cpu_gemm
from aioprefill.workers.paddle.onednn import (
    Bf16Cast,
    Extension,
    check,
    heads_product,
    load_gemm_bf16,
    load_sgemm,
    set_openmp_threads,
)
from aioprefill.workers.paddle.ops import swiglu, swiglu_planes

__all__ = ["Products", "weights_in_out"]

_FLOAT = 4  # bytes
_BF16 = 2
_PROJECT_ROWS = 256  # `project`'s row blocks by default: x's block stays in cache over the heads


class Products:
    """`linear` (a linear layer), `project` (x times per-head weights), `product` (x @ w.T, never
    tiled) and `per_head` (attention's) for one worker: oneDNN on a float32 CPU, else Paddle's
    `matmul`; `strided` (one product on raw addresses) on oneDNN only."""

    def __init__(
        self,
        device: str,
        threads: int,
        tile_rows: int | None,
        gemm: str | None = None,
        *,
        in_out: bool = False,
    ) -> None:
        """`gemm`: a CPU's product library, `onednn` or `mkl`; None: `paddle.env.cpu_gemm()`.
        `in_out`: the linear layers' weights are laid out [in, out] (`weights_in_out`), not
        HF's [out, in]."""
        self.device = device
        onednn = device == "cpu" and (gemm or cpu_gemm()) == "onednn"
        self._sgemm = load_sgemm() if onednn else None
        # bfloat16 weights on a CPU: oneDNN's bf16 product is the only one (whatever `gemm`)
        self._bgemm = load_gemm_bf16() if device == "cpu" else None
        self._cast = Bf16Cast()
        if self._sgemm is not None or self._bgemm is not None:
            set_openmp_threads(threads)
        self._tile = tile_rows
        self.in_out = in_out
        # bf16 weights [.., k + s] (or k + 2s) whose last inputs repeat channels (by the weight's
        # address): x goes as its bf16 rounding plus those channels' rest (`Extension`)
        self.extended: dict[int, Extension] = {}
        self.observe: Callable[[paddle.Tensor, paddle.Tensor], None] | None = None  # x, w of each

    def in_features(self, w: paddle.Tensor, *, heads: bool = False) -> int:
        """A linear layer's input width, from its weight as this worker lays it out (`heads`:
        `project`'s [heads, k, dim])."""
        k = w.shape[1] if heads or not self.in_out else w.shape[0]
        return int(k) - self.extra_inputs(w)

    def extra_inputs(self, w: paddle.Tensor) -> int:
        """How many repeated input channels an extended weight carries (0: none)."""
        ext = self.extended.get(int(w.data_ptr())) if w.dtype == paddle.bfloat16 else None
        return 0 if ext is None else ext.inputs

    @property
    def tile_rows(self) -> int | None:
        return self._tile

    @property
    def uses_onednn(self) -> bool:
        return self._sgemm is not None

    def _fast(self, x: paddle.Tensor, w: paddle.Tensor) -> bool:
        if x.dtype != paddle.float32:
            return False
        if w.dtype == paddle.bfloat16:
            return self._bgemm is not None
        return self._sgemm is not None and w.dtype == paddle.float32

    def _gemm(
        self, x: paddle.Tensor, w: paddle.Tensor, split: bool
    ) -> tuple[ctypes._CFuncPtr, list[tuple[int, float]], int, int, int]:  # type: ignore[name-defined]
        """(gemm, passes, x's and w's element sizes, the product's inner size): a pass is (x's
        address, beta). x rounded to bf16 for a bf16 w: one pass, or with `split` two (hi, then
        lo added: bf16x2), or for an `extended` w one pass on x's extended rows."""
        k = int(x.shape[1])
        if self.observe is not None:
            self.observe(x, w)
        if w.dtype == paddle.bfloat16:
            assert self._bgemm is not None
            ext = self.extended.get(int(w.data_ptr()))
            if ext is not None:
                return self._bgemm, [(self._cast.extend(x, ext), 0.0)], _BF16, _BF16, k + ext.inputs
            if split:
                hi, lo = self._cast.split(x)
                return self._bgemm, [(hi, 0.0), (lo, 1.0)], _BF16, _BF16, k
            return self._bgemm, [(self._cast(x), 0.0)], _BF16, _BF16, k
        assert self._sgemm is not None
        return self._sgemm, [(x.data_ptr(), 0.0)], _FLOAT, _FLOAT, k

    def product(self, x: paddle.Tensor, w: paddle.Tensor, *, split: bool = False) -> paddle.Tensor:
        """[rows, k] x [n, k] -> [rows, n] = x @ w.T, as one product. `split` (a bf16 w): x as
        bf16x2, hi and lo, two products (here and in `linear`, `project`)."""
        if not self._fast(x, w):
            return paddle.matmul(x, w, transpose_y=True)
        return self._xw(x, w, x.shape[0], transposed=True, split=split)

    def product_few(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        """`product` for a float32 `w` and few rows of x (a head's last rows), on oneDNN as
        (w @ x.T).T: a wide w as the product's rows (`N, T` on [rows, k] x [n, k] streams w at
        ~half the speed: 16 x 576 rows against 8,192 of SmolLM2's head, ~6 against ~3 us a
        vocabulary row, 1 thread, AMD Zen 4). Elsewhere `product`. Its rows keep their bits
        from the floor on (`paddle.rows` checks it as `head_last`)."""
        if self._sgemm is None or not self._fast(x, w) or w.dtype != paddle.float32:
            return self.product(x, w)
        x, w = _contiguous(x), _contiguous(w)
        rows, k = x.shape
        n = int(w.shape[0])
        out = paddle.empty([rows, n], dtype=x.dtype)
        if rows == 0:
            return out
        t = np.empty((n, rows), np.float32)
        check(self._sgemm(b"N", b"T", n, rows, k, 1.0, w.data_ptr(), k, x.data_ptr(), k,
                          0.0, t.ctypes.data, rows))  # fmt: skip
        np.copyto(np.from_dlpack(out), t.T)
        return out

    def linear(self, x: paddle.Tensor, w: paddle.Tensor, *, split: bool = False) -> paddle.Tensor:
        """A linear layer: x @ w ([in, out] weights: `in_out`) or x @ w.T (HF's [out, in]);
        with tiles, `tile_rows` rows at a time (x's rows are a multiple of it)."""
        tile, ty = self._tile, not self.in_out
        if not self._fast(x, w):
            if tile is None or x.shape[0] == tile:
                return paddle.matmul(x, w, transpose_y=ty)
            parts = paddle.split(x, x.shape[0] // tile)
            return paddle.concat([paddle.matmul(t, w, transpose_y=ty) for t in parts])
        return self._xw(x, w, tile or x.shape[0], transposed=ty, split=split)

    def add_linear(
        self, acc: paddle.Tensor, x: paddle.Tensor, w: paddle.Tensor, *, split: bool = False
    ) -> paddle.Tensor:
        """acc + `linear(x, w)`: a residual connection. With a bf16 w on a CPU the products
        add into `acc` itself (gemm's beta = 1, no separate pass over the rows; `acc` is
        returned, overwritten): the sum's float32 rounding then differs from the separate
        add's (the product's partial sums meet acc in another order). Elsewhere a new tensor,
        bitwise as before."""
        if w.dtype != paddle.bfloat16 or not self._fast(x, w) or not acc.is_contiguous():
            return acc + self.linear(x, w, split=split)
        ty = not self.in_out
        return self._xw(x, w, self._tile or x.shape[0], transposed=ty, split=split, add_to=acc)

    def swiglu_linear(
        self, x: paddle.Tensor, w: paddle.Tensor, *, split: bool = False
    ) -> paddle.Tensor:
        """silu(gate) * up for the gate/up layer `w` (outputs [gate | up]): `paddle.ops.swiglu`
        of `linear`, or with a bf16 w on a CPU with oneDNN the gate and up products (tiled like
        `linear`) into two planes, then `paddle.ops.swiglu_planes` (no NumPy passes)."""
        if w.dtype != paddle.bfloat16 or self.in_out or not self._fast(x, w) or dnnl() is None:
            return swiglu(self.linear(x, w, split=split))
        x, w = _contiguous(x), _contiguous(w)
        rows, k = x.shape
        n = w.shape[0] // 2
        planes = paddle.empty([2, rows, n], dtype=x.dtype)
        out = paddle.empty([rows, n], dtype=x.dtype)
        if rows == 0:
            return out
        gemm, passes, xs, ws, k = self._gemm(x, w, split)
        wp, pp, step = w.data_ptr(), planes.data_ptr(), self._tile or rows
        for lo in range(0, rows, step):
            m = min(step, rows - lo)
            for half in (0, 1):  # gate's rows of w, then up's
                c, b = pp + (half * rows + lo) * n * _FLOAT, wp + half * n * k * ws
                for xp, beta in passes:
                    check(gemm(b"N", b"T", m, n, k, 1.0, xp + lo * k * xs, k, b, k, beta, c, n))
        swiglu_planes(rows * n)(pp, out.data_ptr())
        return out

    def project(self, x: paddle.Tensor, w: paddle.Tensor, *, split: bool = False) -> paddle.Tensor:
        """[rows, hidden] x [heads, hidden, dim] -> [heads, rows, dim]; tiled like `linear`."""
        tile = self._tile
        if not self._fast(x, w):
            if tile is None or x.shape[0] == tile:
                return paddle.matmul(x.unsqueeze(0), w)
            parts = paddle.split(x, x.shape[0] // tile)
            return paddle.concat([paddle.matmul(t.unsqueeze(0), w) for t in parts], axis=1)
        x, w = _contiguous(x), _contiguous(w)
        rows, k = x.shape
        heads, _, dim = w.shape
        out = paddle.empty([heads, rows, dim], dtype=x.dtype)
        if rows == 0:
            return out
        if w.dtype == paddle.bfloat16 and tile is None and dnnl() is not None:
            # every head of every row in one primitive call; bf16x2: lo's added by a second
            _, passes, _, _, k = self._gemm(x, w, split)
            for i, (addr, _) in enumerate(passes):
                heads_product(rows, k, heads, dim, add=i > 0)(addr, w.data_ptr(), out.data_ptr())
            return out
        sgemm, passes, xs, ws, k = self._gemm(x, w, split)
        wp, op = w.data_ptr(), out.data_ptr()
        # One product per head writes its [block, dim] part of the output in place: the
        # heads-major layout attention reads, with no transpose. Row blocks outside, heads
        # inside: a block of x is read from cache by every head (one product per head over all
        # rows re-read x from memory 15 times: q/k/v ran at 154 GFLOP/s against 205 for o/MLP).
        for lo, m in _blocks(rows, tile):
            for h in range(heads):
                c = op + (h * rows + lo) * dim * _FLOAT
                b = wp + h * k * dim * ws
                for xp, beta in passes:
                    a = xp + lo * k * xs
                    check(sgemm(b"N", b"N", m, dim, k, 1.0, a, k, b, dim, beta, c, dim))
        return out

    def per_head(
        self, a: paddle.Tensor, b: paddle.Tensor, n: int, *, transpose_b: bool
    ) -> paddle.Tensor:
        """Attention's products, one per KV head h, on b's first n rows (`b` [heads, >= n, d],
        read in place: no copy of the slice): a[h] @ b[h, :n].T -> [heads, m, n] (scores, `b`
        the keys) or a[h] @ b[h, :n] -> [heads, m, d] (`a` the probabilities over n keys, `b`
        the values)."""
        if not self._fast(a, b):
            return paddle.matmul(a, b[:, :n], transpose_y=transpose_b)
        a, b = _contiguous(a), _contiguous(b)
        heads, m, k = a.shape
        total, d = b.shape[1], b.shape[2]
        cols = n if transpose_b else d
        out = paddle.empty([heads, m, cols], dtype=a.dtype)
        sgemm, ap, bp, op = self._sgemm, a.data_ptr(), b.data_ptr(), out.data_ptr()
        assert sgemm is not None and k == (d if transpose_b else n)
        for h in range(heads):
            ah, bh = ap + h * m * k * _FLOAT, bp + h * total * d * _FLOAT
            ch = op + h * m * cols * _FLOAT
            if transpose_b:
                check(sgemm(b"N", b"T", m, n, d, 1.0, ah, k, bh, d, 0.0, ch, n))
            else:
                check(sgemm(b"N", b"N", m, d, n, 1.0, ah, k, bh, d, 0.0, ch, d))
        return out

    def strided(
        self, m: int, n: int, k: int, alpha: float, a: int, lda: int, b: int, ldb: int,
        c: int, ldc: int, *, transpose_b: bool,
    ) -> None:  # fmt: skip
        """One float32 product on raw row-major addresses with leading dimensions (oneDNN's
        sgemm; only where `uses_onednn`): c[m, n] = alpha * a[m, k] @ b, b [k, n] or, with
        `transpose_b`, [n, k]. For operands that are column blocks of larger matrices, read and
        written in place: an encoder's per-head attention takes q, k and v from the packed qkv
        rows and writes each head's columns of the context (no transposes, no copies)."""
        assert self._sgemm is not None
        tb = b"T" if transpose_b else b"N"
        check(self._sgemm(b"N", tb, m, n, k, alpha, a, lda, b, ldb, 0.0, c, ldc))

    def _xw(
        self, x: paddle.Tensor, w: paddle.Tensor, step: int, *, transposed: bool, split: bool,
        add_to: paddle.Tensor | None = None,
    ) -> paddle.Tensor:  # fmt: skip
        """x @ w.T (`transposed`: w [n, k]) or x @ w (w [k, n]), `step` rows a product; with
        `add_to` (contiguous float32 [rows, n]) added into it in place, and it returned."""
        x, w = _contiguous(x), _contiguous(w)
        rows, k = x.shape
        n = w.shape[0] if transposed else w.shape[1]
        out = paddle.empty([rows, n], dtype=x.dtype) if add_to is None else add_to
        if rows == 0:
            return out
        sgemm, passes, xs, _, k = self._gemm(x, w, split)
        if add_to is not None:
            passes = [(xp, 1.0) for xp, _ in passes]
        wp, op = w.data_ptr(), out.data_ptr()
        tb, ldb = (b"T", k) if transposed else (b"N", n)
        for lo in range(0, rows, step):
            m, c = min(step, rows - lo), op + lo * n * _FLOAT
            for xp, beta in passes:
                check(sgemm(b"N", tb, m, n, k, 1.0, xp + lo * k * xs, k, wp, ldb, beta, c, n))
        return out


def weights_in_out(device: str, dtype: str) -> bool:
    """Whether a worker keeps its linear layers' weights [in, out] (multiplied x @ w): on a
    float32 CPU. oneDNN's `dnnl_sgemm` runs `N, N` 2.6x faster than `N, T` (x @ w.T on HF's
    [out, in]) at 16 rows, 1.9x at 64, 1.2x at 256, 1.04x at 1,024-4,096 (SmolLM2's gate/up, 30
    weights in turn, 1 thread, AMD Zen 5): below ~64 rows a forward streams the weights, and
    small forwards are what a prefix-cache hit leaves. Laid out once as the weights load (no
    second copy); MKL, if the worker picks it, multiplies either layout. Elsewhere (a GPU,
    other dtypes) HF's layout and Paddle's matmul with transpose_y, as before."""
    return device == "cpu" and dtype == "float32"


def _blocks(rows: int, tile: int | None) -> list[tuple[int, int]]:
    """(first row, row count) of `project`'s row blocks: tiles of `tile` rows, else blocks of
    _PROJECT_ROWS with the remainder joined to the last (a product never has fewer rows than
    min(rows, _PROJECT_ROWS): the floor `paddle.rows` pads to stays met)."""
    if tile is not None:
        return [(lo, tile) for lo in range(0, rows, tile)]
    n = max(1, rows // _PROJECT_ROWS)
    return [(i * _PROJECT_ROWS, _PROJECT_ROWS if i < n - 1 else rows - i * _PROJECT_ROWS)
            for i in range(n)]  # fmt: skip


def _contiguous(t: paddle.Tensor) -> paddle.Tensor:
    return t if t.is_contiguous() else t.contiguous()
