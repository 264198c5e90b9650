"""Causal grouped-query attention for one sequence of a packed batch, its KV state, and the
copy of that state into a KV export segment.

Each sequence attends on its own: one score matrix per sequence costs sum(len^2), where one
block-diagonal mask over the batch would cost tokens^2. The shapes of a sequence's products
depend only on that sequence, so batch-mates cannot change its result; queries run in tiles of
absolute positions, so neither can where a chunk starts (a chunked prompt, a cached prefix).
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
import paddle.nn.functional as F

from aioprefill.workers.kv_writer import KVSegmentWriter
from aioprefill.workers.paddle_head import host

__all__ = ["KVCache", "attend", "export_layer"]


class KVCache:
    """One request's keys and values (after RoPE), `[kv_heads, length, head_dim]` per layer,
    kept between the chunks of a prompt. With a prefix cache, `tail` holds the hidden rows and
    token ids of the block the last chunk left unfinished (`paddle_prefix.keep_tail`)."""

    __slots__ = ("keys", "length", "tail", "values")

    def __init__(self, num_layers: int) -> None:
        self.keys: list[paddle.Tensor | None] = [None] * num_layers
        self.values: list[paddle.Tensor | None] = [None] * num_layers
        self.length = 0
        self.tail: tuple[np.ndarray, np.ndarray] | None = None


@functools.lru_cache(maxsize=512)
def _triangle(heads: int, rows: int, dtype: paddle.dtype, place: str) -> paddle.Tensor:
    """Additive causal mask [heads, rows, rows]: -inf above the diagonal. Copied out per head
    because paddle's CPU kernels broadcast ~10x slower than they add equal shapes."""
    upper = paddle.triu(paddle.full([rows, rows], float("-inf"), dtype=dtype), diagonal=1)
    return paddle.concat([upper.unsqueeze(0)] * heads)


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
    pad: bool,
) -> paddle.Tensor:
    """Attention output `[heads, end - begin, head_dim]` for rows `begin:end` of the batch.

    `q` is `[kv_heads, group, rows, head_dim]` (pre-scaled by head_dim^-0.5; query head
    `g*group + i` reads KV head `g`, as HF's repeat_kv), `k` and `v` are `[kv_heads, rows,
    head_dim]`. The sequence's earlier chunks come from `cache`; with `keep` its keys and values
    so far are stored back for the next chunk. Queries run in tiles of `tile` absolute positions
    (`_aligned`; `pad`: zero-padded to whole tiles), so where a chunk starts changes no row.
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
    return _aligned(q[:, :, begin:end], keys, values, keys.shape[1] - length, tile, pad)


def _aligned(
    q: paddle.Tensor,
    keys: paddle.Tensor,
    values: paddle.Tensor,
    past: int,
    tile: int,
    pad: bool,
) -> paddle.Tensor:
    """Attention for queries at positions `past ...` (`q` [kv_heads, group, rows, dim]) over
    `keys`/`values` [kv_heads, past + rows, dim]: the queries of positions [t*tile, (t+1)*tile)
    run as one tile against keys [0, (t+1)*tile) (zero-padded past the last), with the causal
    mask on the diagonal square. A tile scores only the keys it can see (about half the work
    of a long causal prompt). With `pad` (deterministic mode) a tile the chunk covers part of is
    zero-padded to `tile` rows: every product's shape and a row's place in it depend only on
    the row's absolute position, so a prompt computed whole, in chunks or after a cached prefix
    gives the same bits (masked keys get probability exactly 0). Without it a tile has the
    chunk's rows only, and a row's scores, softmax and weighted sum still run over the same
    keys whatever its chunk (bitwise on SmolLM2 with MKL: benchmarks/results/hit_exact.txt)."""
    kv_heads, group, rows, dim = q.shape
    heads, total = kv_heads * group, past + rows
    first, last = past // tile, (total - 1) // tile
    extra = (last + 1) * tile - total
    if extra:
        zeros = paddle.zeros([kv_heads, extra, dim], dtype=keys.dtype)
        keys = paddle.concat([keys, zeros], axis=1)
        values = paddle.concat([values, zeros], axis=1)
    place = paddle.get_device()
    outs = []
    for t in range(first, last + 1):
        lo, hi = t * tile, (t + 1) * tile
        qa, qb = max(lo, past), min(hi, total)
        qt = q[:, :, qa - past : qb - past]
        # the tile's query rows [a, b) of [lo, hi): all of them, or the chunk's only
        a, b = (0, tile) if pad else (qa - lo, qb - lo)
        if pad and qb - qa < tile:
            parts = [qt]
            if qa > lo:
                parts.insert(0, paddle.zeros([kv_heads, group, qa - lo, dim], dtype=q.dtype))
            if qb < hi:
                parts.append(paddle.zeros([kv_heads, group, hi - qb, dim], dtype=q.dtype))
            qt = paddle.concat(parts, axis=2)
        n = b - a
        qt = qt.reshape([kv_heads, group * n, dim])
        scores = paddle.matmul(qt, keys[:, lo:hi], transpose_y=True).reshape([heads, n, tile])
        mask = _triangle(heads, tile, scores.dtype, place)
        scores = scores + (mask if n == tile else mask[:, a:b])
        if lo:
            before = paddle.matmul(qt, keys[:, :lo], transpose_y=True)
            scores = paddle.concat([before.reshape([heads, n, lo]), scores], axis=-1)
        probs = F.softmax(scores, axis=-1).reshape([kv_heads, group * n, hi])
        out = paddle.matmul(probs, values[:, :hi]).reshape([heads, n, dim])
        outs.append(out[:, qa - lo : qb - lo] if pad and qb - qa < tile else out)
    return outs[0] if len(outs) == 1 else paddle.concat(outs, axis=1)


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
        np.copyto(writer.keys[layer, :, :past], host(past_k))
        np.copyto(writer.values[layer, :, :past], host(past_v))
    np.copyto(writer.keys[layer, :, past:], host(k[:, begin:end]))
    np.copyto(writer.values[layer, :, past:], host(v[:, begin:end]))
