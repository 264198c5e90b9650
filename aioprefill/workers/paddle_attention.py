"""Causal grouped-query attention for one sequence of a packed batch, its KV state, and the
copy of that state into a KV export segment.

Each sequence attends on its own: one score matrix per sequence costs sum(len^2), where one
block-diagonal mask over the batch would cost tokens^2. The shapes of a sequence's products
depend only on that sequence (its length and cached prefix), so batch-mates cannot change its
result.
"""

from __future__ import annotations

import functools

import numpy as np
import paddle
import paddle.nn.functional as F

from aioprefill.workers.kv_writer import KVSegmentWriter
from aioprefill.workers.paddle_head import host

__all__ = ["KVCache", "attend", "export_layer"]

# Queries run in blocks of at most this many rows. A block scores only the keys it can see,
# which skips about half the work of a long causal prompt, and only its diagonal square needs
# the causal mask: keys before the block are visible to all of its rows.
_QUERY_BLOCK = 128
# ... and fewer when a block's scores (heads x rows x keys) would pass this many elements.
_SCORE_BUDGET = 1 << 25


class KVCache:
    """One request's keys and values (after RoPE), `[kv_heads, length, head_dim]` per layer,
    kept between the chunks of a prompt."""

    __slots__ = ("keys", "length", "values")

    def __init__(self, num_layers: int) -> None:
        self.keys: list[paddle.Tensor | None] = [None] * num_layers
        self.values: list[paddle.Tensor | None] = [None] * num_layers
        self.length = 0


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
) -> paddle.Tensor:
    """Attention output `[heads, end - begin, head_dim]` for rows `begin:end` of the batch.

    `q` is `[kv_heads, group, rows, head_dim]` (pre-scaled by head_dim^-0.5; query head
    `g*group + i` reads KV head `g`, as HF's repeat_kv), `k` and `v` are `[kv_heads, rows,
    head_dim]`. The sequence's earlier chunks come from `cache`; with `keep` its keys and values
    so far are stored back for the next chunk.
    """
    kv_heads, group, _, dim = q.shape
    heads = kv_heads * group
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
    past = keys.shape[1] - length
    block = max(1, min(_QUERY_BLOCK, _SCORE_BUDGET // (heads * keys.shape[1])))
    place = paddle.get_device()
    outs = []
    for lo in range(0, length, block):
        rows = min(block, length - lo)
        seen = past + lo  # keys every row of this block sees
        qb = q[:, :, begin + lo : begin + lo + rows].reshape([kv_heads, group * rows, dim])
        scores = paddle.matmul(qb, keys[:, seen : seen + rows], transpose_y=True)
        scores = scores.reshape([heads, rows, rows])
        if rows > 1:
            scores = scores + _triangle(heads, rows, scores.dtype, place)
        if seen:
            before = paddle.matmul(qb, keys[:, :seen], transpose_y=True)
            scores = paddle.concat([before.reshape([heads, rows, seen]), scores], axis=-1)
        probs = F.softmax(scores, axis=-1).reshape([kv_heads, group * rows, seen + rows])
        outs.append(paddle.matmul(probs, values[:, : seen + rows]).reshape([heads, rows, dim]))
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
