"""A next-token batch's last layer on each prompt's last row alone.

When nothing after the last layer reads a row but each prompt's last (every chunk ends its
prompt; no prompt log-probabilities or mean pooling, which read every row; no block that a KV
store puts, which carries its hidden rows), `paddle.runner` runs that layer's attention for those
rows' queries only (`attend_rows(last_only=True)`: keys and values of every row are still made,
kept and exported) and its o projection, norm and MLP on those rows gathered (`take_rows`),
then writes them back into the batch's hidden states (`put_rows`; the other rows keep the layer
before's values, which nothing reads). The o projection and MLP are ~84% of a layer's products:
on SmolLM2 (30 layers) ~2.8% of a next-token forward's. The prefix-cache blocks such a forward
writes keep their K/V and token ids but no hidden rows (`prefix_blocks.BlockStore.has_rows`):
the engine reads them for next-token requests only (`sched.prefix.BlockIndex.rowless`). Before,
any block written kept the whole layer, and the prefix cache on (the default) cost a next-token
miss those 2.8%.

Bits: the same as the whole layer's. The gathered rows are zero-padded to the product floor
(`paddle.rows`: every product keeps a row's bits from there on, wherever the row sits), norms
and element-wise ops are per row, and attention computes each query row on its own in its tile
(`attention._Tiles`; deterministic mode keeps the tile's shape). tests/model/test_bf16.py checks
it bitwise in both modes.
"""

from __future__ import annotations

import numpy as np
import paddle

from aioprefill.wire.outputs import OPTS_OVER_PROMPT
from aioprefill.workers.paddle.attention import tiles_attention
from aioprefill.workers.paddle.gemm import Products
from aioprefill.workers.prefix_blocks import BatchPlan
from aioprefill.workers.runner import ForwardBatch

__all__ = ["last_rows_only", "put_rows", "take_rows"]


def last_rows_only(batch: ForwardBatch, plan: BatchPlan | None, mm: Products, bf16: bool) -> bool:
    """Whether `batch` needs only each prompt's last row after the last layer, on a worker
    whose attention runs on `attention._Tiles` (`tiles_attention`: a CPU with oneDNN; `mm` its
    products, `bf16` a bfloat16 model)."""
    if not bool(batch.is_last.all()):
        return False
    if batch.has(OPTS_OVER_PROMPT).any():
        return False
    if plan is not None and batch.write_hashes is not None and any(len(w) for w in plan.writes):
        return False  # a KV store puts the written blocks whole
    return tiles_attention(mm.device == "cpu", mm, bf16)


def take_rows(x: paddle.Tensor, rows: np.ndarray, count: int) -> paddle.Tensor:
    """Rows `rows` of the CPU tensor `x`, then zero rows up to `count` rows."""
    out = paddle.zeros([count, x.shape[1]], dtype=x.dtype)
    np.from_dlpack(out)[: len(rows)] = np.from_dlpack(x)[rows]
    return out


def put_rows(x: paddle.Tensor, rows: np.ndarray, src: paddle.Tensor) -> None:
    """`src`'s first len(rows) rows into rows `rows` of the CPU tensor `x`, in place."""
    np.from_dlpack(x)[rows] = np.from_dlpack(src)[: len(rows)]
