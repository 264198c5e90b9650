"""`IdTable`: which export each registered KV region holds right now, in memory the transfer
engine serves, so a decode node can check an export's id next to its bytes.

Byte layout: chunks of 4096 entries, each chunk one anonymous mapping registered with the
engine; an entry is 32 bytes, four little-endian u64 (one aligned store each, so a reader
never sees half of one):

    +0   export_id   nonzero while the export is open; zeroed FIRST when it closes, before
                     its region is deregistered, unmapped or handed to another export
    +8   addr        the export's registered address (written before export_id)
    +16  nbytes      its length (written before export_id)
    +24  released    a decode node writes export_id here to give the export back early

Why a table and not a header inside the segment: the segment's layout is fixed (keys at
offset 0, written by the workers, docs/kv-export.md) and a reused segment keeps its old bytes
until a worker overwrites them, so an id in it would have to be cleared at close anyway. The
entry gives the same guarantee: a pull reads the data, then the entry (a seqlock's second
read). The engine zeroes export_id before the pages can change, so an entry still holding the
id after the data arrived means the data were read while the export was open.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from aioprefill.errors import TransferError
from aioprefill.transfer.backend import address_of

__all__ = ["ENTRY_BYTES", "IdTable"]

ENTRY_BYTES = 32
_PER_CHUNK = 4096


class IdTable:
    """Entries handed out by `take()`, given back by `clear()`; `close()` deregisters all."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._maps: list[mmap.mmap] = []
        self._words: list[np.ndarray] = []  # per chunk: [entries, 4] uint64 over the mapping
        self._addrs: list[int] = []
        self._free: list[tuple[int, int]] = []

    @property
    def num_chunks(self) -> int:
        return len(self._maps)

    def _grow(self) -> None:
        mm = mmap.mmap(-1, _PER_CHUNK * ENTRY_BYTES)
        addr = address_of(mm)
        rc = self._engine.register_memory(addr, len(mm))
        if rc != 0:
            mm.close()
            raise TransferError(f"registering the KV id table failed: {rc}")
        chunk = len(self._maps)
        self._maps.append(mm)
        self._words.append(np.frombuffer(mm, dtype="<u8").reshape(_PER_CHUNK, 4))
        self._addrs.append(addr)
        self._free.extend((chunk, i) for i in reversed(range(_PER_CHUNK)))

    def take(self, export_id: int, addr: int, nbytes: int) -> tuple[int, int]:
        """An entry for an export that is open from now on (its id written last)."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        row = self._words[slot[0]][slot[1]]
        row[1], row[2], row[3] = addr, nbytes, 0
        row[0] = export_id
        return slot

    def clear(self, slot: tuple[int, int]) -> None:
        """The export closed: its id goes first, then the rest; the entry is free again."""
        row = self._words[slot[0]][slot[1]]
        row[0] = 0
        row[1:] = 0
        self._free.append(slot)

    def released(self, slot: tuple[int, int], export_id: int) -> bool:
        """Whether a decode node wrote this export's id into its `released` word."""
        return int(self._words[slot[0]][slot[1]][3]) == export_id

    def address(self, slot: tuple[int, int]) -> int:
        return self._addrs[slot[0]] + slot[1] * ENTRY_BYTES

    def close(self) -> list[mmap.mmap]:
        """Deregister every chunk; returns the mappings, for the caller to unmap once the
        engine is gone (a read it was still serving never touches unmapped memory)."""
        self._words.clear()
        self._free.clear()
        for addr in self._addrs:
            self._engine.unregister_memory(addr)
        maps, self._maps, self._addrs = self._maps, [], []
        return maps
