"""Causal grouped-query attention for one sequence of a packed batch, its KV state, and the
copy of that state into a KV export segment.

Each sequence attends on its own: one score matrix per sequence costs sum(len^2), where one
block-diagonal mask over the batch would cost tokens^2. The shapes of a sequence's products
depend only on that sequence, so batch-mates cannot change its result; queries run in tiles of
absolute positions, so neither can where a chunk starts (a chunked prompt, a cached prefix).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import numpy as np
import paddle

from aioprefill.workers.kv_writer import KVSegmentWriter
from aioprefill.workers.paddle.gemm import Products
from aioprefill.workers.paddle.head import host
from aioprefill.workers.paddle.onednn import check, load_sgemm
from aioprefill.workers.paddle.ops import causal_softmax_, causal_softmax_rows_
from aioprefill.workers.prefix_blocks import bf16_bits

__all__ = ["KVCache", "attend", "attend_rows", "export_layer", "tiles_attention"]

_LEAST_M = 16  # attention's sgemm rows are bitwise from this many (AMD Zen 4, 1-2 threads)


class KVCache:
    """One request's keys and values (after RoPE), `[kv_heads, length, head_dim]` per layer,
    kept between the chunks of a prompt. With a prefix cache, `tail` holds the hidden rows and
    token ids of the block the last chunk left unfinished (`paddle.prefix.keep_tail`)."""

    __slots__ = ("keys", "length", "tail", "values")

    def __init__(self, num_layers: int) -> None:
        self.keys: list[paddle.Tensor | None] = [None] * num_layers
        self.values: list[paddle.Tensor | None] = [None] * num_layers
        self.length = 0
        self.tail: tuple[np.ndarray, np.ndarray] | None = None


def attend(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    begin: int,
    end: int,
    cache: KVCache,
    layer: int,
    *,
    keep: bool,
    tile: int,
    mm: Products,
) -> paddle.Tensor:
    """Attention output `[heads, end - begin, head_dim]` for rows `begin:end` of the batch.

    `q` is `[kv_heads, group, rows, head_dim]` (pre-scaled by head_dim^-0.5; query head
    `g*group + i` reads KV head `g`, as HF's repeat_kv), `k` and `v` are `[kv_heads, rows,
    head_dim]`. The sequence's earlier chunks come from `cache`; with `keep` its keys and values
    so far are stored back for the next chunk. Queries run in tiles of `tile` absolute positions,
    zero-padded to whole tiles (`_aligned`), so where a chunk starts changes no row. `mm`: the
    worker's products (`Products.per_head`: oneDNN on a CPU that multiplies with it).
    """
    keys, values = _sequence_kv(k, v, begin, end, cache, layer, keep)
    return _aligned(q[:, :, begin:end], keys, values, keys.shape[1] - (end - begin), tile, mm)


def _sequence_kv(
    k: paddle.Tensor, v: paddle.Tensor, begin: int, end: int, cache: KVCache, layer: int, keep: bool
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """A sequence's keys and values so far ([kv_heads, past + end - begin, dim]): its cache's
    earlier chunks and rows `begin:end` of the batch's; with `keep`, stored back in `cache`."""
    keys, values = k[:, begin:end], v[:, begin:end]
    past_keys, past_values = cache.keys[layer], cache.values[layer]
    if past_keys is not None and past_values is not None:
        keys = paddle.concat([past_keys, keys], axis=1)
        values = paddle.concat([past_values, values], axis=1)
    if keep:
        # Copies, so the batch-wide tensors these are sliced from can be freed.
        cache.keys[layer] = keys.clone() if past_keys is None else keys
        cache.values[layer] = values.clone() if past_values is None else values
    return keys, values


def attend_rows(
    q: paddle.Tensor,
    k: paddle.Tensor,
    v: paddle.Tensor,
    bounds: list[tuple[int, int]],
    caches: list[KVCache],
    keep: list[bool],
    layer: int,
    rows: int,
    before: Callable[[int, KVCache], None],
    *,
    tile: int,
    mm: Products,
    bf16: bool,
    last_only: bool = False,
) -> paddle.Tensor:
    """Every sequence's `attend` (sequence i on rows `bounds[i]`, keeping its K/V where `keep[i]`;
    `before(i, cache)` runs first: prefix slots, exports), as the o projection's input
    `[rows, heads * head_dim]` (rows past the last sequence zero). On a CPU with oneDNN's sgemm
    (a bf16 model, or `AIOPREFILL_CPU_GEMM=onednn`) each query tile runs on NumPy scratch and
    raw addresses (`_Tiles`), writing its rows into the output in place: the same products and
    softmax as `_aligned` (bitwise), without its ~10 Paddle ops per tile and the concat and
    transpose after (0.6 of 3.0 s of attention in a SmolLM2 bf16 forward, 1 thread).

    `last_only` (`tiles_attention`): output row i is sequence i's last position alone (its keys
    and values all kept and exported as before), the rest zero (`paddle.last_rows`)."""
    kv_heads, group, _, dim = q.shape
    heads, total = kv_heads * group, bounds[-1][1]
    sgemm = load_sgemm() if tiles_attention(q.place.is_cpu_place(), mm, bf16) else None
    if last_only and sgemm is None:
        raise ValueError("last_only attention needs oneDNN's sgemm (tiles_attention)")
    if sgemm is None:
        outs = []
        for i, ((a, b), cache) in enumerate(zip(bounds, caches, strict=True)):
            before(i, cache)
            outs.append(attend(q, k, v, a, b, cache, layer, keep=keep[i], tile=tile, mm=mm))
        if rows > total:
            outs.append(paddle.zeros([heads, rows - total, dim], dtype=q.dtype))
        return paddle.concat(outs, axis=1).transpose([1, 0, 2]).reshape([rows, heads * dim])
    out = paddle.empty([rows, heads * dim], dtype=q.dtype)
    o = np.from_dlpack(out).reshape(rows, heads, dim)
    o[total:] = 0
    qn = np.from_dlpack(q)
    # deterministic mode (fixed product tiles) keeps every tile's shape fixed too
    least = None if mm.tile_rows is not None else _least_rows(group, tile)
    tiles = _Tiles(sgemm, kv_heads, group, tile, dim, least)
    if last_only:
        o[len(bounds) :] = 0
    for i, ((a, b), cache) in enumerate(zip(bounds, caches, strict=True)):
        before(i, cache)
        keys, values = _sequence_kv(k, v, a, b, cache, layer, keep[i])
        if last_only:
            tiles(qn[:, :, b - 1 : b], keys, values, o[i : i + 1])
        else:
            tiles(qn[:, :, a:b], keys, values, o[a:b])
    return out


def tiles_attention(cpu: bool, mm: Products, bf16: bool) -> bool:
    """Whether `attend_rows` runs on `_Tiles`: on a CPU with oneDNN's sgemm, for a bf16 model
    or products on oneDNN."""
    return cpu and (bf16 or mm.uses_onednn) and load_sgemm() is not None


class _Tiles:
    """`_aligned` and `_tile` on a CPU with oneDNN's sgemm, on kept NumPy scratch: a sequence's
    keys and values zero-padded to whole tiles, a query tile's rows, its scores and its output.
    The same sgemm calls on the same values as `Products.per_head`, the same mask and softmax
    (`causal_softmax_rows_`). With `least` (the default mode, where `_least_rows` found the
    sgemm's rows bitwise from that many rows on) a tile runs only the chunk's query rows (at
    least `least` of them, zero rows added): a prompt's last tile is mostly padding (280 ids:
    24 of its 64 rows), ~20% of attention's products and softmax; else all `tile` rows, zero
    rows for positions outside the chunk, as `_aligned`."""

    def __init__(
        self,
        sgemm: ctypes._CFuncPtr,  # type: ignore[name-defined]
        kv_heads: int,
        group: int,
        tile: int,
        dim: int,
        least: int | None,
    ) -> None:
        self._sgemm, self._kv, self._group = sgemm, kv_heads, group
        self._tile, self._dim, self._least = tile, dim, least
        self._bufs: dict[str, np.ndarray] = {}

    def _buf(self, name: str, *shape: int) -> np.ndarray:
        size = math.prod(shape)
        b = self._bufs.get(name)
        if b is None or b.size < size:
            b = self._bufs[name] = np.empty(size, np.float32)
        return b[:size].reshape(shape)

    def __call__(
        self, q: np.ndarray, keys: paddle.Tensor, values: paddle.Tensor, dst: np.ndarray
    ) -> None:
        """Queries `q` [kv_heads, group, rows, dim] (the last `rows` positions of `keys`/`values`
        [kv_heads, total, dim]) -> `dst` [rows, heads, dim]."""
        kv, group, tile, dim, sgemm = self._kv, self._group, self._tile, self._dim, self._sgemm
        rows, total = q.shape[2], int(keys.shape[1])
        past = total - rows
        first, last = past // tile, (total - 1) // tile
        padded = (last + 1) * tile
        kp, vp = self._buf("k", kv, padded, dim), self._buf("v", kv, padded, dim)
        for src, pad in ((keys, kp), (values, vp)):
            np.copyto(pad[:, :total], np.from_dlpack(src))
            pad[:, total:] = 0
        ka, va, f = kp.ctypes.data, vp.ctypes.data, 4  # float32 bytes
        for t in range(first, last + 1):
            lo, n = t * tile, (t + 1) * tile
            qa, qb = max(lo, past), min(n, total)
            r = qb - qa  # the chunk's rows of this tile, at `at` of `rt` rows
            at, rt = (0, max(r, self._least)) if self._least else (qa - lo, tile)
            m = group * rt
            qt, scores = self._buf("q", kv, group, rt, dim), self._buf("s", kv, m, n)
            ot = self._buf("o", kv, m, dim)
            if r < rt:
                qt.fill(0)
            np.copyto(qt[:, :, at : at + r], q[:, :, qa - past : qb - past])
            qa_, sa, oa = qt.ctypes.data, scores.ctypes.data, ot.ctypes.data
            for h in range(kv):  # as Products.per_head: scores = q @ keys.T, then @ values
                a, kh, sh = qa_ + h * m * dim * f, ka + h * padded * dim * f, sa + h * m * n * f
                check(sgemm(b"N", b"T", m, n, dim, 1.0, a, dim, kh, dim, 0.0, sh, n))
            s3 = scores.reshape(kv * group, rt, n)
            causal_softmax_rows_(s3, tile, qa - lo, at, r)
            for h in range(kv):
                sh, vh, oh = sa + h * m * n * f, va + h * padded * dim * f, oa + h * m * dim * f
                check(sgemm(b"N", b"N", m, dim, n, 1.0, sh, n, vh, dim, 0.0, oh, dim))
            part = ot.reshape(kv * group, rt, dim)[:, at : at + r]
            np.copyto(dst[qa - past : qb - past], part.transpose(1, 0, 2))


@functools.cache
def _least_rows(group: int, tile: int) -> int | None:
    """The fewest query rows a tile may run (the process's sgemm, at its thread count, gives
    a row the same bits from `_LEAST_M` product rows on, at any place: checked once on random
    rows of both attention products against a full tile's), or None where a row moved."""
    sgemm = load_sgemm()
    assert sgemm is not None
    rng = np.random.default_rng(0)
    full = group * tile
    sizes = [m for m in (_LEAST_M, _LEAST_M + 5, 3 * _LEAST_M, full - 7) if _LEAST_M <= m < full]
    if not sizes:  # a tile too small to trim
        return None
    for n in (tile, 5 * tile, 17 * tile):
        for tb, k, cols in ((b"T", 64, n), (b"N", n, 64)):
            a = rng.standard_normal((full, k)).astype(np.float32)
            b = rng.standard_normal((cols, k) if tb == b"T" else (k, cols)).astype(np.float32)
            ldb = k if tb == b"T" else cols
            whole = np.empty((full, cols), np.float32)
            check(sgemm(b"N", tb, full, cols, k, 1.0, a.ctypes.data, k, b.ctypes.data, ldb, 0.0,
                        whole.ctypes.data, cols))  # fmt: skip
            for m in sizes:
                pick = np.sort(rng.choice(full, m, replace=False))
                part, sub = np.empty((m, cols), np.float32), np.ascontiguousarray(a[pick])
                check(sgemm(b"N", tb, m, cols, k, 1.0, sub.ctypes.data, k, b.ctypes.data, ldb,
                            0.0, part.ctypes.data, cols))  # fmt: skip
                if not np.array_equal(part, whole[pick]):
                    return None
    return min(tile, -(-_LEAST_M // group))


def _aligned(
    q: paddle.Tensor,
    keys: paddle.Tensor,
    values: paddle.Tensor,
    past: int,
    tile: int,
    mm: Products,
) -> paddle.Tensor:
    """Attention for queries at positions `past ...` (`q` [kv_heads, group, rows, dim]) over
    `keys`/`values` [kv_heads, past + rows, dim]: the queries of positions [t*tile, (t+1)*tile)
    run as one tile against keys [0, (t+1)*tile) (zero-padded past the last), with the causal
    mask on the diagonal square. A tile scores only the keys it can see (about half the work
    of a long causal prompt). A tile the chunk covers part of is zero-padded to `tile` rows:
    every product's shape and a row's place in it depend only on the row's absolute position,
    so a prompt computed whole, in chunks or after a cached prefix gives the same bits (masked
    keys get probability exactly 0). Both modes pad: the chunk's own rows alone were bitwise
    on SmolLM2 with MKL on an Intel Xeon, but not on an AMD EPYC (Zen 5), where MKL's products
    move a row's bits with the tile's row count."""
    kv_heads, group, rows, dim = q.shape
    heads, total = kv_heads * group, past + rows
    first, last = past // tile, (total - 1) // tile
    extra = (last + 1) * tile - total
    if extra:
        zeros = paddle.zeros([kv_heads, extra, dim], dtype=keys.dtype)
        keys = paddle.concat([keys, zeros], axis=1)
        values = paddle.concat([values, zeros], axis=1)
    outs = []
    for t in range(first, last + 1):
        lo, hi = t * tile, (t + 1) * tile
        qa, qb = max(lo, past), min(hi, total)
        qt = q[:, :, qa - past : qb - past]
        partial = qb - qa < tile
        if partial:  # zero rows for the tile's positions outside the chunk
            parts = [qt]
            if qa > lo:
                parts.insert(0, paddle.zeros([kv_heads, group, qa - lo, dim], dtype=q.dtype))
            if qb < hi:
                parts.append(paddle.zeros([kv_heads, group, hi - qb, dim], dtype=q.dtype))
            qt = paddle.concat(parts, axis=2)
        qt = qt.reshape([kv_heads, group * tile, dim])
        out = _tile(qt, keys, values, hi, heads, tile, mm)
        outs.append(out[:, qa - lo : qb - lo] if partial else out)
    return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=1)


def _tile(
    q: paddle.Tensor,
    keys: paddle.Tensor,
    values: paddle.Tensor,
    n: int,
    heads: int,
    rows: int,
    mm: Products,
) -> paddle.Tensor:
    """One query tile: `q` [kv_heads, group * rows, dim] against the first `n` of `keys`/`values`
    [kv_heads, >= n, dim], whose last `rows` positions (of those n) are the tile's: query row i
    sits at the i-th of them (the causal mask's rows), to [heads, rows, dim]. One product scores
    every key (the mask and the softmax then run in place on its output: `paddle.ops`), one more
    weighs the values. On a CPU with oneDNN both run per KV head on the keys and values in place
    (`Products.per_head`): 1.3-1.6x Paddle's matmul on these shapes on an AMD Zen 5 (MKL's AVX2
    kernels there), e.g. 363 against 567 us for a tile over 320 keys, softmax included."""
    scores = mm.per_head(q, keys, n, transpose_b=True)
    probs = causal_softmax_(scores, heads, rows, rows, 0)
    return mm.per_head(probs, values, n, transpose_b=False).reshape([heads, rows, keys.shape[-1]])


def export_layer(
    writer: KVSegmentWriter,
    layer: int,
    cache: KVCache,
    k: paddle.Tensor,
    v: paddle.Tensor,
    begin: int,
    end: int,
) -> None:
    """Copy one layer's keys (after RoPE) and values of one request into its export segment:
    the earlier chunks' from its cache, this chunk's from the batch-wide tensors."""
    past_k, past_v = cache.keys[layer], cache.values[layer]
    past = 0
    if past_k is not None and past_v is not None:
        past = past_k.shape[1]
        _copy_kv(writer.keys[layer, :, :past], past_k)
        _copy_kv(writer.values[layer, :, :past], past_v)
    _copy_kv(writer.keys[layer, :, past:], k[:, begin:end])
    _copy_kv(writer.values[layer, :, past:], v[:, begin:end])


def _copy_kv(dst: np.ndarray, t: paddle.Tensor) -> None:
    """One part of an export: a bfloat16 model's K/V as their bits (`wire.kv`: uint16 segments;
    a CPU worker's float32 tensors rounded to nearest even, exact where they hold bfloat16
    values already (deterministic mode); a GPU's bfloat16 tensors give theirs from `.numpy()`),
    any other dtype's values."""
    if dst.dtype != np.uint16:
        np.copyto(dst, host(t))
    elif t.dtype == paddle.bfloat16:
        np.copyto(dst, t.numpy())
    else:
        np.copyto(dst, bf16_bits(host(t)))
