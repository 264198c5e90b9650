"""Causal grouped-query attention for one sequence of a packed batch, its KV state, and the
copy of that state into a KV export segment.

Each sequence attends on its own: one score matrix per sequence costs sum(len^2), where one
block-diagonal mask over the batch would cost tokens^2. The shapes of a sequence's products
depend only on that sequence, so batch-mates cannot change its result; queries run in tiles of
absolute positions, so neither can where a chunk starts (a chunked prompt, a cached prefix).
"""

from __future__ import annotations

import numpy as np
import paddle

from aioprefill.workers.kv_writer import KVSegmentWriter
from aioprefill.workers.paddle.gemm import Products
from aioprefill.workers.paddle.head import host
from aioprefill.workers.paddle.ops import causal_softmax_
from aioprefill.workers.prefix_blocks import bf16_bits

__all__ = ["KVCache", "attend", "export_layer"]


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
    length = end - begin
    keys, values = k[:, begin:end], v[:, begin:end]
    past_keys, past_values = cache.keys[layer], cache.values[layer]
    if past_keys is not None and past_values is not None:
        keys = paddle.concat([past_keys, keys], axis=1)
        values = paddle.concat([past_values, values], axis=1)
    if keep:
        # Copies, so the batch-wide tensors these are sliced from can be freed.
        cache.keys[layer] = keys.clone() if past_keys is None else keys
        cache.values[layer] = values.clone() if past_values is None else values
    return _aligned(q[:, :, begin:end], keys, values, keys.shape[1] - length, tile, mm)


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
