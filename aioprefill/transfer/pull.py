"""Decode side: pull a prefill engine's KV export with nothing but its `transfer_params()`.

A pull is one read of the export's whole region (or, into caller buffers, one read per layer
for keys and values, in one batch), then one 32-byte read of the export's id-table entry
(`aioprefill.transfer.idtable`): the entry still holding the export's id proves the bytes were
read while the export was open. Otherwise `KVExportClosed` (closed, released, evicted, expired
or reused meanwhile); an entry naming another region: `InvalidRequest` (forged parameters); an
engine that is gone, refuses the read or does not answer within `timeout_s`: `TransferError`.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from aioprefill.errors import InvalidRequest, KVExportClosed, TransferError
from aioprefill.transfer.idtable import ENTRY_BYTES
from aioprefill.transfer.local import LocalEngine, Scratch, local_engine, renew_local_engine
from aioprefill.transfer.params import TransferParams, parse_params

__all__ = ["SLICE_BYTES", "PulledKV", "pull_kv", "release_kv", "sliced"]

_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)

# Reads longer than this are split, all in one batch: Mooncake spreads a batch's requests over
# its connections to the peer, which moves 16-64 MiB faster than one long read
# (benchmarks/bench_kv_transfer.py: `raw` against `raw_sliced`).
SLICE_BYTES = 4 << 20

AFTER_REFUSAL = 6  # entry reads tried after a refused read (backing off 20 ms x 3^k)


class _Refused(TransferError):
    """The peer refused or could not be reached (not a timeout): worth one fresh engine when
    it answered this one before (`transfer.local`: a restarted peer on the same port)."""


Into = tuple[np.ndarray, np.ndarray] | Sequence[tuple[np.ndarray, np.ndarray]]
_Reads = list[tuple[int, int, int]]  # (local address, remote address, bytes)


@dataclass(slots=True)
class PulledKV:
    """A pulled export. `keys` / `values`: `[num_layers, num_kv_heads, num_tokens, head_dim]`
    arrays (the caller's own when pulled `into` a pair; per-layer lists when into layers)."""

    keys: Any
    values: Any
    shape: tuple[int, int, int, int]
    dtype: str
    export_id: str
    nbytes: int


def _dest(arr: np.ndarray, shape: tuple[int, ...], dtype: np.dtype, what: str) -> int:
    if not isinstance(arr, np.ndarray):
        raise InvalidRequest(f"pull_kv into: {what} must be a NumPy array, got {type(arr)}")
    if arr.shape != shape or arr.dtype != dtype:
        raise InvalidRequest(
            f"pull_kv into: {what} is {arr.dtype}{list(arr.shape)}, needs {dtype}{list(shape)}"
        )
    if not (arr.flags.c_contiguous and arr.flags.writeable):
        raise InvalidRequest(f"pull_kv into: {what} must be C-contiguous and writeable")
    return int(arr.ctypes.data)


def _plan(p: TransferParams, into: Into | None) -> tuple[_Reads, Any, Any]:
    """The reads a pull makes and the keys / values it returns."""
    layout = p.layout
    dt = layout.kv_layout.numpy_dtype
    if into is None:  # pages populated in one call, not faulted one by one by the reader
        buf = np.frombuffer(mmap.mmap(-1, p.nbytes, flags=_ANONYMOUS), dtype=np.uint8)
        keys, values = layout.kv_layout.views(buf, layout.num_tokens)
        return [(int(buf.ctypes.data), p.addr, p.nbytes)], keys, values
    if isinstance(into, tuple) and len(into) == 2 and isinstance(into[0], np.ndarray):
        k = _dest(into[0], layout.shape, dt, "keys")
        v = _dest(into[1], layout.shape, dt, "values")
        return [(k, p.addr, p.values_offset), (v, p.addr + p.values_offset, p.values_offset)], *into
    layers = list(into)
    if len(layers) != layout.num_layers:
        raise InvalidRequest(
            f"pull_kv into: {len(layers)} layers, the export has {layout.num_layers}"
        )
    per = p.values_offset // layout.num_layers
    reads: _Reads = []
    for i, pair in enumerate(layers):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise InvalidRequest(f"pull_kv into: layer {i} must be a (keys, values) pair")
        k, v = pair
        reads.append((_dest(k, layout.shape[1:], dt, f"layer {i} keys"), p.addr + i * per, per))
        at = p.addr + p.values_offset + i * per
        reads.append((_dest(v, layout.shape[1:], dt, f"layer {i} values"), at, per))
    return reads, [k for k, _ in layers], [v for _, v in layers]


def sliced(reads: _Reads, piece: int = SLICE_BYTES) -> _Reads:
    """The same reads, none longer than `piece` bytes."""
    out: _Reads = []
    for local, remote, n in reads:
        out.extend((local + at, remote + at, min(piece, n - at)) for at in range(0, n, piece))
    return out


def _ranges(reads: _Reads) -> list[tuple[int, int]]:
    """The destination bytes as disjoint (start, length) ranges, to register once each."""
    spans = sorted((local, local + n) for local, _, n in reads)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end - start) for start, end in merged]


def _check_entry(worker: Scratch, p: TransferParams, *, tries: int = 1) -> None:
    """Read the export's id-table entry; raise unless it still names this export. After a
    refused read Mooncake's TCP session to that peer may fail the next request while it
    reconnects, so the error path (`tries` > 1) reads again, backing off (up to ~2.4 s in
    all with `AFTER_REFUSAL`: a loaded host reconnects slowly)."""
    te = worker.local.engine
    for attempt in range(tries):
        if te.transfer_sync_read(p.session, worker.scratch_ptr, p.id_addr, ENTRY_BYTES) == 0:
            break
        if attempt + 1 == tries:
            raise _Refused(f"the prefill engine at {p.session} is unreachable or refused")
        time.sleep(0.02 * 3**attempt)
    export_id, addr, nbytes, _ = worker.scratch[:ENTRY_BYTES].view("<u8").tolist()
    if export_id != p.id_value:
        raise KVExportClosed(
            f"KV export {p.export_id} is closed (closed, released, evicted or expired)"
        )
    if (addr, nbytes) != (p.addr, p.nbytes):
        raise InvalidRequest(f"transfer params do not match KV export {p.export_id}")


def _pull(worker: Scratch, p: TransferParams, reads: _Reads) -> None:
    te = worker.local.engine
    registered = [at for at, n in _ranges(reads) if te.register_memory(at, n) == 0]
    reads = sliced(reads)
    try:
        if len(reads) == 1:
            rc = te.transfer_sync_read(p.session, *reads[0])
        else:
            local, remote, lengths = (list(c) for c in zip(*reads, strict=True))
            rc = te.batch_transfer_sync_read(p.session, local, remote, lengths)
    finally:
        for at in registered:
            te.unregister_memory(at)
    _check_entry(worker, p, tries=1 if rc == 0 else AFTER_REFUSAL)  # the seqlock's check
    if rc != 0:
        raise _Refused(f"the prefill engine at {p.session} refused the read ({rc})")


def _run(p: TransferParams, job: Any, timeout_s: float | None) -> Any:
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not (isinstance(timeout_s, (int, float)) and timeout_s > 0)
    ):
        raise InvalidRequest(f"timeout_s must be None or a number > 0, got {timeout_s!r}")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    local = local_engine(p.protocol)
    try:
        out = _run_on(local, p, job, deadline, timeout_s)
    except _Refused:
        if p.session not in local.reached:
            raise
        # It answered this engine before: maybe a new prefill engine on the same host:port,
        # which Mooncake's kept descriptor (the old data port) cannot reach. A fresh engine
        # looks it up again; a peer that is really gone refuses that one at once.
        local = renew_local_engine(local)
        out = _run_on(local, p, job, deadline, timeout_s)
    local.reached.add(p.session)
    return out


def _run_on(
    local: LocalEngine, p: TransferParams, job: Any, deadline: float | None, timeout_s: float | None
) -> Any:
    if deadline is None:
        return local.run_inline(job)
    future = local.submit(job)
    try:
        return future.result(max(deadline - time.monotonic(), 0.0))
    except FutureTimeout:
        raise TransferError(
            f"no answer from the prefill engine at {p.session} within {timeout_s} s"
        ) from None


def pull_kv(params: Any, *, into: Into | None = None, timeout_s: float | None = 30.0) -> PulledKV:
    """Pull a KV export described by `params` (`KVExport.transfer_params()`, a dict or its
    JSON). `into`: write into the caller's arrays instead of new ones, either a `(keys,
    values)` pair shaped like the export or one `(keys, values)` pair per layer, each
    `[num_kv_heads, num_tokens, head_dim]` (e.g. views into a paged cache); C-contiguous, of
    the export's dtype. If the pull times out, a read still in flight may write into them
    later (until the prefill engine answers or dies). `timeout_s=None`: no timeout, and the
    read runs in the calling thread (saves a thread hand-off per pull)."""
    p = parse_params(params)
    reads, keys, values = _plan(p, into)
    _run(p, lambda worker: _pull(worker, p, reads), timeout_s)
    layout = p.layout
    return PulledKV(keys, values, layout.shape, layout.dtype, p.export_id, p.nbytes)


def _release(worker: Scratch, p: TransferParams) -> bool:
    try:
        _check_entry(worker, p, tries=AFTER_REFUSAL)
    except KVExportClosed:
        return False
    worker.scratch[:8].view("<u8")[0] = p.id_value
    released_at = p.id_addr + 24
    if worker.local.engine.transfer_sync_write(p.session, worker.scratch_ptr, released_at, 8):
        raise _Refused(f"the prefill engine at {p.session} refused the release")
    return True


def release_kv(params: Any, *, timeout_s: float | None = 30.0) -> bool:
    """Tell the prefill engine that this export may go (it closes it within ~0.5 s, or at
    once when it needs the room). False when it was already closed. Without it the export
    lives until the prefill side closes it or its `export_ttl_s` passes."""
    p = parse_params(params)
    return bool(_run(p, lambda worker: _release(worker, p), timeout_s))
