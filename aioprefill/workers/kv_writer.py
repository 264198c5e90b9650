"""Worker side of a KV export: open the segment the engine named and write K/V into it.

The engine names every export's segment (`aioprefill.wire.kv`). The worker that runs the prompt's
last chunk creates it (0600, untracked: the engine owns it once the result arrives) and writes
straight into NumPy views of it. The name may already exist: the engine hands out a segment a
closed export left behind (its pages already faulted in: writing it runs at memcpy speed, a
fresh segment at the speed the kernel allocates pages), or a worker died part-way through
writing it before this retry. Either way it is overwritten, or replaced when too small.

Tensor parallelism (`KVShare`): every rank of a group runs the same batch but holds only its
contiguous slice of the KV heads, so each writes only those heads of the shared segment. Rank
0 alone creates (or replaces) the segment; the other ranks attach once one all_reduce over the
group (`KVShare.agree`) says rank 0 has every segment of the batch ready, or raise with it
when it could not open them. A batch without an export to open runs no such collective.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import mmap
from collections.abc import Callable
from dataclasses import dataclass

from aioprefill.shm.segments import attach_segment, create_segment
from aioprefill.wire.kv import KVLayout
from aioprefill.workers.runner import ForwardBatch

__all__ = ["ALONE", "KVSegmentWriter", "KVShare", "KVWriters", "open_writers"]


def _remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)


def _open(name: str, size: int) -> mmap.mmap:
    try:
        return create_segment(name, size, track=False, prefault=False)
    except FileExistsError:
        pass
    mm = attach_segment(name)
    if len(mm) >= size:
        return mm
    mm.close()
    _remove(name)
    return create_segment(name, size, track=False, prefault=False)


def _attach(name: str, size: int) -> mmap.mmap:
    mm = attach_segment(name)
    have = len(mm)
    if have < size:
        mm.close()
        raise ValueError(f"KV export segment {name!r} has {have} bytes, needs {size}")
    return mm


@dataclass(frozen=True, slots=True)
class KVShare:
    """Which KV heads this rank writes: rank `rank` of `size` tensor-parallel ranks writes
    heads `[rank * n / size, (rank + 1) * n / size)`. `agree(ok)` is the group's collective:
    each rank calls it once per batch with exports, rank 0 saying whether it opened them, and
    every rank gets rank 0's answer (None alone)."""

    rank: int = 0
    size: int = 1
    agree: Callable[[bool], bool] | None = None

    def heads(self, layout: KVLayout) -> slice:
        per = layout.num_kv_heads // self.size
        return slice(self.rank * per, (self.rank + 1) * per)


ALONE = KVShare()


class KVSegmentWriter:
    """Writable `keys` / `values` views over this rank's KV heads of a request's segment.
    `owner`: this rank created (or replaced) the segment, and removes it on `discard`."""

    _mm: mmap.mmap | None = None

    def __init__(
        self,
        name: str,
        layout: KVLayout,
        num_tokens: int,
        heads: slice = slice(None),
        *,
        owner: bool = True,
    ) -> None:
        self.name = name
        self.owner = owner
        size = layout.nbytes(num_tokens)
        self._mm = _open(name, size) if owner else _attach(name, size)
        keys, values = layout.views(self._mm, num_tokens)
        self.keys, self.values = keys[:, heads], values[:, heads]

    def close(self) -> None:
        """Unmap (the segment stays for the engine)."""
        self.keys = self.values = None  # type: ignore[assignment]
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def discard(self) -> None:
        """Unmap, and remove if this rank owns it: the forward failed after it was opened."""
        self.close()
        if self.owner:
            _remove(self.name)


class KVWriters(dict[int, KVSegmentWriter]):
    """The exports one forward writes, by batch index. `error`: a segment a rank > 0 could not
    map after rank 0 made it; that rank still runs the forward in step with its peers (leaving
    the segment unwritten) and raises it from `close()`, so the batch fails, not the group."""

    error: Exception | None = None

    def close(self) -> None:
        """The forward is done: unmap every segment (raises a deferred `error`)."""
        for writer in self.values():
            writer.close()
        if self.error is not None:
            raise self.error

    def discard(self) -> None:
        """The forward failed: unmap every segment, removing those this rank owns."""
        for writer in self.values():
            writer.discard()


_Wanted = list[tuple[int, str, int]]  # (batch index, segment name, tokens of the prompt)


def open_writers(batch: ForwardBatch, layout: KVLayout, share: KVShare = ALONE) -> KVWriters:
    """A writer per request whose *last* chunk is in `batch` and asks for its KV (by batch
    index), each sized for the whole prompt. On failure none is left behind: every rank of a
    group raises when rank 0 could not open the segments."""
    writers = KVWriters()
    if not batch.kv_names:
        return writers
    lens = batch.seq_lens()
    wanted = [
        (i, name, int(batch.start_pos[i] + lens[i]))
        for i, name in batch.kv_name_of().items()
        if batch.is_last[i]
    ]
    if not wanted:
        return writers
    heads = share.heads(layout)
    try:
        if share.agree is None:  # alone (or an EP rank: its own requests, every KV head)
            for i, name, num_tokens in wanted:
                writers[i] = KVSegmentWriter(name, layout, num_tokens, heads)
        elif share.rank == 0:
            _create_for_group(writers, wanted, layout, heads, share.agree)
        else:
            _attach_for_group(writers, wanted, layout, heads, share.agree)
    except BaseException:
        writers.discard()
        raise
    return writers


def _create_for_group(
    writers: KVWriters,
    wanted: _Wanted,
    layout: KVLayout,
    heads: slice,
    agree: Callable[[bool], bool],
) -> None:
    """TP rank 0: create (or replace) every segment, then tell the peers, also when that
    failed: they wait for the word."""
    try:
        for i, name, num_tokens in wanted:
            writers[i] = KVSegmentWriter(name, layout, num_tokens, heads)
    except Exception:
        agree(False)
        raise
    agree(True)


def _attach_for_group(
    writers: KVWriters,
    wanted: _Wanted,
    layout: KVLayout,
    heads: slice,
    agree: Callable[[bool], bool],
) -> None:
    """TP rank > 0: once rank 0 made the segments, map them (or fail with rank 0)."""
    if not agree(True):
        raise RuntimeError("rank 0 of the group could not open the KV exports")
    for i, name, num_tokens in wanted:
        try:
            writers[i] = KVSegmentWriter(name, layout, num_tokens, heads, owner=False)
        except FileNotFoundError:
            continue  # the engine removed it since: the request ended, nobody reads it
        except Exception as exc:
            writers.error = writers.error or exc  # raised after the forward (`close`)
