"""The prefix cache slots of a `SimRunner` (see `aioprefill.workers.sim`): per slot, its
block's token ids and the CRC32 of the prompt up to the block's end, in place of KV."""

from __future__ import annotations

import numpy as np

__all__ = ["SimBlocks", "slots_of"]


class SimBlocks:
    """The prefix cache slots of a `SimRunner`: each block's token ids and the prompt's CRC32
    at its end (allocated once, touched as written)."""

    def __init__(self, num_blocks: int, block_tokens: int, block_bytes: int = 0) -> None:
        self.tokens = np.empty((num_blocks, block_tokens), dtype=np.int32)
        self.crc = np.empty(num_blocks, dtype=np.uint32)
        # In the KV store a slot takes its nominal bytes (a real model's KV for the block):
        # its tokens and CRC, then zeros.
        self._pad = np.zeros(max(0, block_bytes - 4 * block_tokens - 4), dtype=np.uint8)
        self._pad.flags.writeable = False

    def slot_arrays(self, slot: int) -> list[np.ndarray]:
        """One slot's arrays as the KV store keeps them (`aioprefill.kvstore`)."""
        return [self.tokens[slot], self.crc[slot : slot + 1], self._pad]

    def layout(self) -> str:
        return f"sim-slot-v1 B{self.tokens.shape[1]} pad{len(self._pad)}"

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, int]:
        """(the blocks' tokens back to back, the CRC32 after the last)."""
        return self.tokens[slots].reshape(-1), int(self.crc[slots[-1]])

    def write(self, slot: int, tokens: np.ndarray, crc: int) -> None:
        self.tokens[slot] = tokens
        self.crc[slot] = crc


_NO_SLOTS = np.empty(0, dtype=np.int32)


def slots_of(offsets: np.ndarray | None, slots: np.ndarray | None, i: int) -> np.ndarray:
    """Request i's read (or write) slots from a batch's cache columns."""
    if offsets is None or slots is None:
        return _NO_SLOTS
    return slots[offsets[i] : offsets[i + 1]]
