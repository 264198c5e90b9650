"""The prefix cache slots of a `SimRunner` (see `aioprefill.workers.sim`): per slot, its
block's token ids and the CRC32 of the prompt up to the block's end, in place of KV.

A slot is valid once written; the slots a failed forward was to write are invalidated (it may
have written none of them), and reading an invalid slot raises, so the batch fails rather than
answer from a block that was never stored. A batch that reads nothing and only writes whole
prompts' blocks (`only_whole_writes`: traffic that reuses nothing) stores them in bulk
(`write_whole`) and keeps the runner's plain path."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

__all__ = ["SimBlocks", "only_whole_writes", "slots_of"]


class SimBlocks:
    """The prefix cache slots of a `SimRunner`: each block's token ids and the prompt's CRC32
    at its end (allocated once, touched as written)."""

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        self.tokens = np.empty((num_blocks, block_tokens), dtype=np.int32)
        self.crc = np.empty(num_blocks, dtype=np.uint32)
        self.valid = np.zeros(num_blocks, dtype=bool)

    def slot_arrays(self, slot: int) -> list[np.ndarray]:
        """One slot's arrays as the KV store keeps them (`aioprefill.kvstore`; the store pads
        them to the slot's nominal bytes, a real model's KV for the block)."""
        return [self.tokens[slot], self.crc[slot : slot + 1]]

    def layout(self) -> str:
        return f"sim-slot-v1 B{self.tokens.shape[1]}"

    def loaded(self, slot: int) -> None:
        """`slot_arrays(slot)` were filled from the KV store: the slot holds its block."""
        self.valid[slot] = True

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, int]:
        """(the blocks' tokens back to back, the CRC32 after the last)."""
        if not self.valid[slots].all():
            raise RuntimeError(f"prefix cache slots {slots.tolist()} read but never stored")
        return self.tokens[slots].reshape(-1), int(self.crc[slots[-1]])

    def write(self, slot: int, tokens: np.ndarray, crc: int) -> None:
        self.tokens[slot] = tokens
        self.crc[slot] = crc
        self.valid[slot] = True

    def write_whole(self, batch: Any, block_tokens: int) -> None:
        """Store the blocks of a batch whose writers are all whole prompts that read nothing
        (`only_whole_writes`), in one assignment per array (the CPU a real worker's device
        copies would not cost the host)."""
        if batch.write_offsets is None or not len(batch.write_slots):
            return
        counts = np.diff(batch.write_offsets).tolist()
        firsts, offsets, tokens = batch.write_first.tolist(), batch.offsets.tolist(), batch.tokens
        rows, crcs = [], []
        for i, count in enumerate(counts):
            if not count:
                continue
            base, first = offsets[i], firsts[i]
            at = base + first * block_tokens
            crc = zlib.crc32(tokens[base:at])  # the prompt's CRC32 up to its first block
            for _ in range(count):
                crc = zlib.crc32(tokens[at : at + block_tokens], crc)
                rows.append(tokens[at : at + block_tokens])
                crcs.append(crc)
                at += block_tokens
        slots = batch.write_slots
        self.tokens[slots] = np.stack(rows)
        self.crc[slots] = crcs
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
