"""`Staging`: registered staging buffers for the pages a prefill node writes into a vLLM decode
node, reused: a fresh buffer costs the kernel's page zeroing (~1 GB/s here) and a registration
each time, a kept one neither. Buffers are anonymous mappings registered whole with the
transfer engine once; `take` hands out the smallest free one that fits (or maps a new one,
rounded up to 1 MiB), `give` keeps it while the free ones hold at most `keep_bytes`, else
unregisters and unmaps it. Thread-safe: the writing threads take and give.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass
from typing import Any

from aioprefill.errors import TransferError
from aioprefill.transfer.backend import address_of

__all__ = ["Buffer", "Staging"]

_ROUND = 1 << 20


@dataclass(slots=True, eq=False)
class Buffer:
    mm: mmap.mmap
    addr: int
    size: int


class Staging:
    def __init__(self, engine: Any, keep_bytes: int = 256 << 20) -> None:
        self._engine = engine
        self._keep = keep_bytes
        self._free: list[Buffer] = []
        self._lock = threading.Lock()
        self.mapped = 0  # buffers made, for the stats

    def take(self, nbytes: int) -> Buffer:
        with self._lock:
            fits = [b for b in self._free if b.size >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.size)
                self._free.remove(best)
                return best
        size = -(-nbytes // _ROUND) * _ROUND
        mm = mmap.mmap(-1, size)
        addr = address_of(mm)
        if self._engine.register_memory(addr, size) != 0:
            mm.close()
            raise TransferError(f"registering a {size}-byte staging buffer failed")
        self.mapped += 1
        return Buffer(mm, addr, size)

    def give(self, buf: Buffer) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.size)
            while sum(b.size for b in self._free) > self._keep:
                self._drop(self._free.pop(0))

    def _drop(self, buf: Buffer) -> None:
        self._engine.unregister_memory(buf.addr)
        buf.mm.close()

    def close(self) -> None:
        with self._lock:
            while self._free:
                self._drop(self._free.pop())
