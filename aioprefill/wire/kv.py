"""KV export: a prompt's keys and values in a shared-memory segment the worker writes.

With `return_kv=True` the engine names a segment for the request (`aioprefill-{engine pid}-
{16 random hex}-kv.{engine tag}`), the worker creates it (0600) when the prompt's last chunk
runs and writes every layer's K and V straight into it (in a tensor-parallel group rank 0
creates it and each rank writes its own KV heads), and the result carries a `KVExport`
handle: zero-copy NumPy views, `close()` / `with`. Nothing of it crosses the result ring.

Segment layout (C order, the model's dtype, no header; docs/kv-export.md):

    offset 0:          keys   [num_layers, num_kv_heads, num_tokens, head_dim]
    offset nbytes / 2: values [num_layers, num_kv_heads, num_tokens, head_dim]

Keys are after RoPE, in Hugging Face's rotate-half head_dim order; KV head `g` serves query
heads `g*group .. g*group + group - 1` (HF `repeat_kv`). bfloat16 is exposed as uint16 bits.

Ownership follows the rings (`aioprefill.shm.segments`): the engine registers an export with
its resource tracker once the worker reports it written, so the tracker unlinks it if the
engine process dies; a failed or cancelled request and `Engine.close()` unlink it; names carry
the engine's pid, so an engine start removes those of a SIGKILLed engine. `close()` keeps the
segment for the engine to hand to a later export (its pages already faulted in), unless the
caller still holds arrays over it. Requests in flight, open exports and kept segments count
against `EngineConfig.max_kv_export_bytes`; kept ones are unlinked first when room is needed.
With `EngineConfig(kv_transfer=...)` open exports are also registered with a transfer engine
(`aioprefill.transfer.registry`, hooked in at open, close, release and close_all).
"""

from __future__ import annotations

import _posixshmem
import contextlib
import functools
import mmap
import os
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Any, Protocol

import numpy as np

from aioprefill.errors import InvalidRequest, KVBudgetExceeded, KVExportClosed
from aioprefill.models import ModelSpec, PaddleModel
from aioprefill.shm.segments import SHM_DIR, attach_segment, segment_name

__all__ = ["KVExport", "KVExports", "KVLayout", "KVTicket", "KVTransfer", "kv_layout"]


class KVTransfer(Protocol):
    """What the exports' ledger calls on a transfer engine's registry
    (`aioprefill.transfer.registry.TransferRegistry` is the one there is), in this order:
    `start()` once before anything is queued; `sweep()` before each export opens (released and
    expired exports give their room back); `register(export)` when one opens; `params(export)`
    from `KVExport.transfer_params()`; `deregister(name)` when one closes; `close()` at shutdown."""

    def start(self) -> None: ...
    def sweep(self) -> int: ...
    def register(self, handle: KVExport) -> None: ...
    def params(self, handle: KVExport) -> dict[str, Any]: ...
    def deregister(self, name: str) -> None: ...
    def close(self) -> None: ...


_NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclass(slots=True, frozen=True)
class KVLayout:
    """The per-token shape of a model's KV export."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the model's: "float32" | "float16" | "bfloat16"

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(_NUMPY_DTYPE[self.dtype])

    def shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, num_tokens, self.head_dim)

    def nbytes(self, num_tokens: int) -> int:
        """Bytes of keys and values together for a prompt of `num_tokens`."""
        per = self.num_layers * self.num_kv_heads * self.head_dim * self.numpy_dtype.itemsize
        return 2 * per * num_tokens

    def views(self, buffer: Any, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) arrays over a segment's buffer."""
        count = self.nbytes(num_tokens) // 2 // self.numpy_dtype.itemsize
        shape = self.shape(num_tokens)
        dt = self.numpy_dtype
        keys = np.frombuffer(buffer, dtype=dt, count=count).reshape(shape)
        values = np.frombuffer(buffer, dtype=dt, count=count, offset=count * dt.itemsize)
        return keys, values.reshape(shape)


# SimModel's synthetic KV (and embedding) sizes: small, so tests and the bench move real bytes.
SIM_KV_LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")


def kv_layout(model: ModelSpec) -> KVLayout:
    if isinstance(model, PaddleModel):
        return KVLayout(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype)
    return SIM_KV_LAYOUT


def _remove(name: str) -> None:
    """Unlink a segment the resource tracker does not know about."""
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


@dataclass(slots=True, eq=False)
class KVTicket:
    """A request's claim on the KV budget, from admission until its handle closes."""

    name: str
    nbytes: int  # K and V of this prompt
    num_tokens: int
    capacity: int  # bytes of its segment, counted against the budget (>= nbytes when reused)
    tracked: bool = False  # registered with the engine's resource tracker
    state: str = "reserved"  # -> "open" (a handle owns it) -> "pooled" | "released"


class KVExport:
    """A prompt's exported keys and values. `with r.kv as kv: kv.keys, kv.values`.

    `keys` / `values` are read-only zero-copy views `[num_layers, num_kv_heads, num_tokens,
    head_dim]` over the segment, mapped on first use. After `close()` the engine may reuse the
    segment for a later export (arrays still held then keep theirs: such a segment is unlinked,
    never reused, and stays readable until they are dropped). Closing twice is a no-op.
    """

    _mm: mmap.mmap | None = None
    _keys: np.ndarray | None = None
    _values: np.ndarray | None = None

    def __init__(self, ticket: KVTicket, layout: KVLayout, ledger: KVExports) -> None:
        self._ticket = ticket
        self._ledger = ledger
        self.layout = layout
        self.name = ticket.name
        self.nbytes = ticket.nbytes
        self.num_tokens = ticket.num_tokens
        self.shape = layout.shape(ticket.num_tokens)
        self.dtype = layout.dtype

    @property
    def closed(self) -> bool:
        return self._ticket.state != "open"

    def _map(self) -> None:
        if self.closed:
            raise KVExportClosed(f"KV export {self.name} is closed")
        if self._mm is None:
            self._mm = attach_segment(self.name)
            keys, values = self.layout.views(self._mm, self.num_tokens)
            keys.flags.writeable = False
            values.flags.writeable = False
            self._keys, self._values = keys, values

    @property
    def keys(self) -> np.ndarray:
        self._map()
        assert self._keys is not None
        return self._keys

    @property
    def values(self) -> np.ndarray:
        self._map()
        assert self._values is not None
        return self._values

    def transfer_params(self) -> dict[str, Any]:
        """What a decode node needs to pull this export with `aioprefill.transfer.pull_kv`:
        a plain JSON-serialisable dict (session, addresses, layout, export id). Needs
        `EngineConfig(kv_transfer="mooncake")`; see docs/kv-export.md."""
        if self.closed:
            raise KVExportClosed(f"KV export {self.name} is closed")
        if self._ledger.transfer is None:
            raise InvalidRequest("transfer_params() needs EngineConfig(kv_transfer='mooncake')")
        return self._ledger.transfer.params(self)

    def close(self) -> None:
        if self.closed:
            return
        self._keys = self._values = None
        reusable = True
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # the caller still holds arrays: never hand these pages out
                reusable = False
            self._mm = None
        self._ledger.recycle(self._ticket, reusable=reusable)

    def __enter__(self) -> KVExport:
        self._map()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<KVExport {self.name} {self.shape} {self.dtype} {state}>"


class KVExports:
    """The engine's ledger of KV exports: the bytes of requests in flight, of open handles, and
    of closed exports' segments kept for reuse, together at most `max_bytes`.

    Reuse: writing a fresh segment runs at the speed the kernel allocates and zeroes pages
    (~1 GB/s on the build VM), a warm one at memcpy speed (~10 GB/s). So `close()` keeps the
    segment (unless the caller still holds arrays over it) and the next `return_kv` request that
    fits gets its name; kept segments are unlinked first whenever room is needed.
    """

    def __init__(
        self, model: ModelSpec, max_bytes: int, transfer: KVTransfer | None = None
    ) -> None:
        self.layout = kv_layout(model)
        # kv_transfer: open exports registered with the engine's transfer engine (made by the
        # engine and passed in: the transfer package sits above this module)
        self.transfer = transfer
        self.max_bytes = max_bytes
        self.used_bytes = 0  # in flight + open + kept
        self._open: dict[str, KVExport] = {}
        self._pool: list[tuple[str, int]] = []  # (name, capacity): closed, kept for reuse
        self._tag = f"kv.{secrets.token_hex(4)}"  # this engine's exports, among the process's

    @property
    def num_open(self) -> int:
        return len(self._open)

    @property
    def pooled_bytes(self) -> int:
        return sum(capacity for _, capacity in self._pool)

    def reserve(self, num_tokens: int) -> KVTicket:
        """Claim budget for a `return_kv` request; raises before anything is queued."""
        nbytes = self.layout.nbytes(num_tokens)
        if self.transfer is not None:  # started before anything is queued; released and
            self.transfer.start()  # expired exports give their room back first
            if self.used_bytes + nbytes > self.max_bytes:
                self.transfer.sweep()
        if nbytes > self.max_bytes:
            raise InvalidRequest(
                f"the KV export of a {num_tokens}-token prompt takes {nbytes} bytes, more than "
                f"max_kv_export_bytes={self.max_bytes}"
            )
        # A kept segment that fits without wasting more than half of itself, smallest first.
        fits = [(cap, i) for i, (_, cap) in enumerate(self._pool) if nbytes <= cap <= 2 * nbytes]
        if fits:
            name, capacity = self._pool.pop(min(fits)[1])
            return KVTicket(name, nbytes, num_tokens, capacity, tracked=True)
        while self._pool and self.used_bytes + nbytes > self.max_bytes:
            self._unlink(*self._pool.pop(0))  # oldest first
        if self.used_bytes + nbytes > self.max_bytes:
            raise KVBudgetExceeded(
                f"KV exports hold {self.used_bytes} of max_kv_export_bytes={self.max_bytes} "
                f"bytes; this one needs {nbytes}: close() some exports"
            )
        self.used_bytes += nbytes
        return KVTicket(segment_name(self._tag), nbytes, num_tokens, nbytes)

    def open(self, ticket: KVTicket) -> KVExport:
        """The worker wrote the segment: hand the caller its handle (tracked from now on)."""
        if not ticket.tracked:
            resource_tracker.register("/" + ticket.name, "shared_memory")
            ticket.tracked = True
        ticket.state = "open"
        handle = KVExport(ticket, self.layout, self)
        self._open[ticket.name] = handle
        if self.transfer is not None:
            self.transfer.register(handle)
        return handle

    def recycle(self, ticket: KVTicket, *, reusable: bool) -> None:
        """A handle closed: keep its segment for the next export, or remove it."""
        if ticket.state != "open":
            return
        self._open.pop(ticket.name, None)
        if self.transfer is not None:
            self.transfer.deregister(ticket.name)
        if reusable:
            ticket.state = "pooled"
            self._pool.append((ticket.name, ticket.capacity))
        else:
            self.release(ticket)

    def release(self, ticket: KVTicket) -> None:
        """Give the bytes back and remove the segment (if it exists). Idempotent."""
        if ticket.state in ("released", "pooled"):
            return
        self._open.pop(ticket.name, None)
        if self.transfer is not None:
            self.transfer.deregister(ticket.name)
        ticket.state = "released"
        self._unlink(ticket.name, ticket.capacity, tracked=ticket.tracked)

    def _unlink(self, name: str, capacity: int, *, tracked: bool = True) -> None:
        self.used_bytes -= capacity
        if tracked:
            resource_tracker.unregister("/" + name, "shared_memory")
        _remove(name)

    def discard(self, ticket: KVTicket) -> None:
        """The request ended without a handle (failed, cancelled): release it, and remove its
        segment even if the worker wrote it after an earlier release."""
        if ticket.state == "pooled":
            return  # an earlier request's closed export, kept (never this request's)
        self.release(ticket)
        _remove(ticket.name)

    def reserve_for(self, future: Any, num_tokens: int) -> KVTicket:
        """`reserve` for the request whose future is `future`, settled when it ends."""
        ticket = self.reserve(num_tokens)
        future.add_done_callback(functools.partial(self.settle, ticket))
        return ticket

    def settle(self, ticket: KVTicket, future: Any) -> None:
        """Done-callback (partial on the ticket) of a `return_kv` request's future: when it
        ended without a handle (failed, cancelled), the reservation and any segment go."""
        if ticket.state == "reserved" or future.cancelled() or future.exception() is not None:
            self.discard(ticket)

    def close_all(self) -> None:
        """Engine close: every open handle closes; kept segments, and any a dead worker left,
        are removed."""
        for handle in list(self._open.values()):
            handle.close()
        if self.transfer is not None:
            self.transfer.close()
        while self._pool:
            self._unlink(*self._pool.pop())
        prefix = f"aioprefill-{os.getpid()}-"
        with contextlib.suppress(OSError):
            for entry in os.scandir(SHM_DIR):
                if entry.name.startswith(prefix) and entry.name.endswith("-" + self._tag):
                    _remove(entry.name)
