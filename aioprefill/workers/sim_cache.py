"""The prefix cache slots of a `SimRunner` (see `aioprefill.workers.sim`): per slot, its
block's token ids, in place of KV.

A chunk that reads slots (always its prompt's first blocks) continues from their ids: its CRC32
starts as the CRC32 of the ids read, so a wrong read (a wrong or stale block) gives a wrong
answer, as a real model's wrong KV would. A slot is valid once written; the slots a failed
forward was to write are invalidated (it may have written none of them), and reading an invalid
slot raises, so the batch fails rather than answer from a block that was never stored. A batch
that reads nothing and only writes whole prompts' blocks (`only_whole_writes`: traffic that
reuses nothing) stores them with one gather (`write_whole`) and keeps the runner's plain path."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

__all__ = ["SimBlocks", "only_whole_writes", "slots_of"]


class SimBlocks:
    """The prefix cache slots of a `SimRunner`: each block's token ids (allocated once,
    touched as written)."""

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        self.tokens = np.empty((num_blocks, block_tokens), dtype=np.int32)
        self.valid = np.zeros(num_blocks, dtype=bool)

    def add_slots(self, extra: int) -> None:
        """`extra` slots past the engine's (the KV store tier's scratch); before any is
        stored."""
        if self.valid.any():
            raise RuntimeError("slots added to a prefix cache already in use")
        n, b = self.tokens.shape
        self.tokens = np.empty((n + extra, b), dtype=np.int32)
        self.valid = np.zeros(n + extra, dtype=bool)

    def slot_arrays(self, slot: int) -> list[np.ndarray]:
        """One slot's arrays as the KV store keeps them (`aioprefill.kvstore`; the store pads
        them to the slot's nominal bytes, a real model's KV for the block)."""
        return [self.tokens[slot]]

    def layout(self) -> str:
        return f"sim-slot-v2 B{self.tokens.shape[1]}"

    def loaded(self, slot: int) -> None:
        """`slot_arrays(slot)` were filled from the KV store: the slot holds its block."""
        self.valid[slot] = True

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, int]:
        """(the blocks' tokens back to back, their CRC32: where the reader continues)."""
        if not self.valid[slots].all():
            raise RuntimeError(f"prefix cache slots {slots.tolist()} read but never stored")
        ids = self.tokens[slots].reshape(-1)
        return ids, zlib.crc32(ids.tobytes())

    def write(self, slot: int, tokens: np.ndarray) -> None:
        self.tokens[slot] = tokens
        self.valid[slot] = True

    def write_whole(self, batch: Any, block_tokens: int) -> None:
        """Store the blocks of a batch whose writers are all whole prompts that read nothing
        (`only_whole_writes`): one gather of every written block's ids from the batch's tokens
        into the slots (no per-block Python work: the host CPU a real worker's device copies
        would not cost)."""
        if batch.write_offsets is None or not len(batch.write_slots):
            return
        slots = batch.write_slots
        woff = batch.write_offsets.astype(np.int64)
        # write g of writer i is its prompt block first[i] + (g - woff[i]), which starts at
        # offsets[i] + (first[i] + g - woff[i]) * block_tokens in the batch's tokens
        base = batch.offsets[:-1].astype(np.int64) + (batch.write_first - woff[:-1]) * block_tokens
        starts = np.repeat(base, np.diff(woff)) + np.arange(len(slots)) * block_tokens
        self.tokens[slots] = batch.tokens[starts[:, None] + np.arange(block_tokens)]
        self.valid[slots] = True

    def invalidate(self, slots: np.ndarray | None) -> None:
        """A forward that was to write these slots failed."""
        if slots is not None and len(slots):
            self.valid[slots] = False


_NO_SLOTS = np.empty(0, dtype=np.int32)


def only_whole_writes(batch: Any) -> bool:
    """No block read, and every request that writes blocks is a whole prompt (one chunk)."""
    if batch.read_offsets is None:
        return True
    if len(batch.read_slots):
        return False
    writes = np.diff(batch.write_offsets) > 0
    return bool((batch.start_pos[writes] == 0).all() and batch.is_last[writes].all())


def slots_of(offsets: np.ndarray | None, slots: np.ndarray | None, i: int) -> np.ndarray:
    """Request i's read (or write) slots from a batch's cache columns."""
    if offsets is None or slots is None:
        return _NO_SLOTS
    return slots[offsets[i] : offsets[i + 1]]
