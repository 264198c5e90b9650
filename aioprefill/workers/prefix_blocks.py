"""The worker's prefix-cache block slots, and one batch's read/write plan for them.

The engine owns the slots (it decides which block each holds, `protocol.PrefillBatch`); the
worker only reads the slots a chunk names and writes the blocks a chunk completes into the slots
named. A slot holds one block of `block_tokens` prompt positions:

- per layer, this rank's KV heads' keys (after RoPE) and values, `[kv_heads, block_tokens,
  head_dim]` float32 (a 2-byte model's values widen exactly to float32 and narrow back);
- the final hidden state (before the final norm) of every position, float32 `[block_tokens,
  hidden]`: what prompt log-probabilities, prompt top-k and mean pooling over cached positions
  are computed from (the head and the norm run on these rows exactly as on computed ones), so a
  hit never recomputes a layer;
- the block's token ids (int32): the targets of the cached positions' prompt log-probabilities.

Memory: one `np.empty` per array, allocated once at start for `prefix_cache_bytes //
block_bytes` slots and never touched until written, so the worker's RSS grows with the slots
used. Layout `[layer][kv_head, slot, position, dim]`: gathering a request's slots of one layer
is one fancy index that lands as `[kv_heads, slots * block_tokens, dim]`, what attention reads.

Bytes per block (block_tokens=16, one rank): 4 * 16 * (2 * layers * kv_heads * head_dim +
hidden + 1): SmolLM2-135M (30 layers, 3 KV heads of 64, hidden 576) 774,208 bytes (~756 KiB, so
1 GiB holds 1,386 blocks, 22,176 tokens); the tiny default model (4 layers, 4 KV heads of 32,
hidden 256) 81,984 bytes (~80 KiB). A TP rank keeps its share of the KV heads (and all of the
hidden rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aioprefill.workers.runner import ForwardBatch

__all__ = ["BatchPlan", "BlockStore"]


class BlockStore:
    """`num_blocks` slots of `block_tokens` positions each (see the module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        hidden_size: int,
        block_tokens: int,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_tokens = block_tokens
        shape = (num_layers, kv_heads, num_blocks, block_tokens, head_dim)
        self.keys = np.empty(shape, dtype=np.float32)  # lazily touched: RSS grows with use
        self.values = np.empty(shape, dtype=np.float32)
        self.hidden = np.empty((num_blocks, block_tokens, hidden_size), dtype=np.float32)
        self.tokens = np.empty((num_blocks, block_tokens), dtype=np.int32)

    @staticmethod
    def block_bytes(
        *, num_layers: int, kv_heads: int, head_dim: int, hidden_size: int, block_tokens: int
    ) -> int:
        """Bytes one slot takes: K and V of every layer, the hidden rows, the token ids."""
        per_position = 2 * num_layers * kv_heads * head_dim + hidden_size + 1
        return 4 * block_tokens * per_position

    def read_kv(self, layer: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One layer's keys and values of `slots`, in order: `[kv_heads, n * B, head_dim]`."""
        k, v = self.keys[layer][:, slots], self.values[layer][:, slots]
        heads, n, b, dim = k.shape
        return k.reshape(heads, n * b, dim), v.reshape(heads, n * b, dim)

    def write_kv(self, layer: int, slots: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        """Store `[kv_heads, n * B, head_dim]` keys and values as blocks into `slots`."""
        heads, _, dim = keys.shape
        shape = (heads, len(slots), self.block_tokens, dim)
        self.keys[layer][:, slots] = keys.reshape(shape)
        self.values[layer][:, slots] = values.reshape(shape)

    def read_rows(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hidden rows `[n * B, hidden]` and token ids `[n * B]` of `slots`, in order."""
        return (
            self.hidden[slots].reshape(-1, self.hidden.shape[-1]),
            self.tokens[slots].reshape(-1),
        )

    def write_rows(self, slots: np.ndarray, hidden: np.ndarray, tokens: np.ndarray) -> None:
        self.hidden[slots] = hidden.reshape(len(slots), self.block_tokens, -1)
        self.tokens[slots] = tokens.reshape(len(slots), self.block_tokens)


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """One batch's prefix-cache instructions per request: the slots it reads (its prompt's
    first blocks) and the slots it writes with the blocks `first_write`, `first_write + 1`, ..."""

    reads: list[np.ndarray]
    writes: list[np.ndarray]
    first_write: list[int]

    @classmethod
    def of(cls, batch: ForwardBatch) -> BatchPlan | None:
        """The batch's plan, or None when it neither reads nor writes a slot."""
        ro, rs, wo, ws, wf = (
            batch.read_offsets,
            batch.read_slots,
            batch.write_offsets,
            batch.write_slots,
            batch.write_first,
        )
        if ro is None or rs is None or wo is None or ws is None or wf is None:
            return None
        if not len(rs) and not len(ws):
            return None
        n = batch.size
        reads = [rs[ro[i] : ro[i + 1]].astype(np.int64) for i in range(n)]
        writes = [ws[wo[i] : wo[i + 1]].astype(np.int64) for i in range(n)]
        return cls(reads, writes, [int(f) for f in wf.tolist()])

    def check(self, batch: ForwardBatch, num_blocks: int, block_tokens: int) -> None:
        """ValueError for instructions this worker cannot follow, before anything runs."""
        ends = (batch.start_pos.astype(np.int64) + batch.seq_lens()).tolist()
        for i, (rid, start, end) in enumerate(
            zip(batch.request_ids.tolist(), batch.start_pos.tolist(), ends, strict=True)
        ):
            reads, writes = self.reads[i], self.writes[i]
            for slots, what in ((reads, "reads"), (writes, "writes")):
                if len(slots) and int(slots.max()) >= num_blocks:
                    raise ValueError(f"request {rid} {what} slot past this worker's {num_blocks}")
            if len(reads) and start != len(reads) * block_tokens:
                raise ValueError(
                    f"request {rid}: {len(reads)} blocks read, but its chunk starts at {start}"
                )
            if len(writes):
                lo = self.first_write[i] * block_tokens
                if lo + len(writes) * block_tokens > end:
                    raise ValueError(f"request {rid}: writes blocks past its chunk's end {end}")
                # K/V of every earlier position is in the request's state, but its hidden rows
                # only from the block the previous chunk left unfinished.
                held = start // block_tokens * block_tokens
                if lo < held:
                    raise ValueError(
                        f"request {rid}: writes block {lo // block_tokens}, before its chunk"
                    )
