"""The prefix cache slots of a `SimRunner` (see `aioprefill.workers.sim`): per slot, its
block's token ids and the CRC32 of the prompt up to the block's end, in place of KV.

A slot is valid once written; the slots a failed forward was to write are invalidated (it may
have written none of them), and reading an invalid slot raises, so the batch fails rather than
answer from a block that was never stored."""

from __future__ import annotations

import numpy as np

__all__ = ["SimBlocks", "slots_of"]


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

    def invalidate(self, slots: np.ndarray | None) -> None:
        """A forward that was to write these slots failed."""
        if slots is not None and len(slots):
            self.valid[slots] = False


_NO_SLOTS = np.empty(0, dtype=np.int32)


def slots_of(offsets: np.ndarray | None, slots: np.ndarray | None, i: int) -> np.ndarray:
    """Request i's read (or write) slots from a batch's cache columns."""
    if offsets is None or slots is None:
        return _NO_SLOTS
    return slots[offsets[i] : offsets[i + 1]]
