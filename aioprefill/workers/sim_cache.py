"""The prefix cache slots of a `SimRunner` (see `aioprefill.workers.sim`): per slot, its
block's token ids and the CRC32 of the prompt up to the block's end, in place of KV."""

from __future__ import annotations

import numpy as np

__all__ = ["SimBlocks", "slots_of"]


class SimBlocks:
    """The prefix cache slots of a `SimRunner`: each block's token ids and the prompt's CRC32
    at its end (allocated once, touched as written)."""

    def __init__(self, num_blocks: int, block_tokens: int) -> None:
        self.tokens = np.empty((num_blocks, block_tokens), dtype=np.int32)
        self.crc = np.empty(num_blocks, dtype=np.uint32)

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
