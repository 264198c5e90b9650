"""`TransferRegistry`, engine side of KV transfer: the engine process's one Mooncake transfer
engine, and every open KV export registered with it.

Life of an export with `EngineConfig(kv_transfer="mooncake")` (the ledger, `aioprefill.wire.kv`,
calls these hooks):

1. `start()` on the first `return_kv` request (before it is queued: a failure to start is the
   caller's `TransferError`): the transfer engine and its id table (`IdTable`).
2. `register(handle)` when the result arrives: the engine maps the export's segment and
   registers `[addr, addr + nbytes)` in place (zero copy), and its id table entry names it.
3. `params(handle)`: the plain-JSON `transfer_params()` (`aioprefill.transfer.params`).
4. `deregister(name)` when the export closes (`KVExport.close()`, a decode node's release, its
   TTL, `Engine.close()`): the id goes first, then the registration. The mapping itself is
   unmapped a grace period later, so a read the engine was still serving never touches
   unmapped memory (the segment is kept or unlinked by the ledger as before).
5. `sweep()` closes exports a decode node released or whose `export_ttl_s` passed: on a timer
   that runs only while exports are registered, and at once when a request needs the room.
6. `close()` with the engine: every registration, the table, then the transfer engine.
"""

from __future__ import annotations

import _posixshmem
import asyncio
import mmap
import os
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioprefill.errors import KVExportClosed, TransferError
from aioprefill.transfer.backend import address_of, new_engine
from aioprefill.transfer.idtable import IdTable
from aioprefill.transfer.options import TransferOptions
from aioprefill.transfer.params import VERSION, LayoutParams, TransferParams

if TYPE_CHECKING:
    from aioprefill.wire.kv import KVExport

__all__ = ["TransferRegistry"]

SWEEP_S = 0.5  # how often released / expired exports are closed while any is registered
UNMAP_GRACE_S = 2.0  # a deregistered export's mapping outlives its registration this long


def _map_lazily(name: str, nbytes: int) -> mmap.mmap:
    """The export's first `nbytes` of its segment, mapped without MAP_POPULATE: prefaulting
    would cost the event loop time that grows with the size (lazily mapped, registration takes
    tens of µs whatever the size: benchmarks/bench_kv_transfer.py), while the transfer
    engine's own threads fault the pages in as they read them."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)


@dataclass(slots=True, eq=False)
class _Entry:
    handle: KVExport
    mm: mmap.mmap
    addr: int
    slot: tuple[int, int]
    export_id: int
    expires: float | None  # time.monotonic() after which the export closes
    params: dict[str, Any]


class TransferRegistry:
    """The registered exports of one engine, by segment name."""

    def __init__(self, options: TransferOptions) -> None:
        self.options = options
        self.session = ""
        self._engine: Any = None
        self._table: IdTable | None = None
        self._live: dict[str, _Entry] = {}
        self._retired: list[tuple[float, mmap.mmap]] = []  # (unmap after, mapping)
        self._timer: asyncio.TimerHandle | None = None

    @property
    def num_registered(self) -> int:
        """Exports registered right now (the id table's chunks not counted)."""
        return len(self._live)

    @property
    def num_regions(self) -> int:
        """Every region this engine has registered: exports plus id table chunks."""
        return len(self._live) + (self._table.num_chunks if self._table else 0)

    def start(self) -> None:
        if self._engine is None:
            opts = self.options
            self._engine, self.session = new_engine(opts.host, opts.protocol, opts.device)
            self._table = IdTable(self._engine)

    def register(self, handle: KVExport) -> None:
        """Register an export that just opened. A failure leaves it a local export only: its
        `transfer_params()` then raises TransferError."""
        self.start()
        assert self._table is not None
        try:
            mm = _map_lazily(handle.name, handle.nbytes)
        except OSError:
            return
        addr = address_of(mm)
        if self._engine.register_memory(addr, handle.nbytes) != 0:
            mm.close()
            return
        export_id = secrets.randbits(64) or 1
        try:
            slot = self._table.take(export_id, addr, handle.nbytes)
        except TransferError:  # the table could not grow
            self._engine.unregister_memory(addr)
            mm.close()
            return
        ttl = self.options.export_ttl_s
        expires = None if ttl is None else time.monotonic() + ttl
        layout = handle.layout
        params = TransferParams(
            backend="mooncake",
            version=VERSION,
            session=self.session,
            protocol=self.options.protocol,
            export_id=f"{export_id:016x}",
            id_addr=self._table.address(slot),
            addr=addr,
            nbytes=handle.nbytes,
            values_offset=handle.nbytes // 2,
            layout=LayoutParams(
                layout.num_layers,
                layout.num_kv_heads,
                handle.num_tokens,
                layout.head_dim,
                layout.dtype,
            ),
        ).to_dict()
        self._live[handle.name] = _Entry(handle, mm, addr, slot, export_id, expires, params)
        self._arm()

    def params(self, handle: KVExport) -> dict[str, Any]:
        entry = self._live.get(handle.name)
        if entry is None or entry.handle is not handle:
            if handle.closed:
                raise KVExportClosed(f"KV export {handle.name} is closed")
            raise TransferError(f"KV export {handle.name} is not registered for transfer")
        params = dict(entry.params)
        params["layout"] = dict(params["layout"])
        return params

    def deregister(self, name: str) -> None:
        entry = self._live.pop(name, None)
        if entry is None:
            return
        assert self._table is not None
        self._table.clear(entry.slot)  # the id first: a pull reading it now fails
        self._engine.unregister_memory(entry.addr)
        self._retired.append((time.monotonic() + UNMAP_GRACE_S, entry.mm))

    def sweep(self) -> int:
        """Close every export a decode node released or whose TTL passed; how many."""
        now = time.monotonic()
        table = self._table
        done = [
            e
            for e in self._live.values()
            if (e.expires is not None and e.expires <= now)
            or (table is not None and table.released(e.slot, e.export_id))
        ]
        for entry in done:
            entry.handle.close()  # -> ledger.recycle -> deregister
            self.deregister(entry.handle.name)  # (a no-op unless the handle was closed)
        while self._retired and self._retired[0][0] <= now:
            self._retired.pop(0)[1].close()
        return len(done)

    def _arm(self) -> None:
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on a loop (a bare ledger): sweeps happen on demand only
            return
        ttl = self.options.export_ttl_s
        self._timer = loop.call_later(min(SWEEP_S, ttl or SWEEP_S), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.sweep()
        if self._live or self._retired:
            self._arm()

    def close(self) -> None:
        """Deregister everything and drop the transfer engine (its listeners close)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for name in list(self._live):
            self.deregister(name)
        maps = [mm for _, mm in self._retired]
        self._retired.clear()
        if self._table is not None:
            maps += self._table.close()
            self._table = None
        self._engine = None  # the last reference: Mooncake's engine is destroyed here
        for mm in maps:
            mm.close()
