"""Worker side of a KV export: open the segment the engine named and write K/V into it.

The engine names every export's segment (`aioprefill.kv`). The worker that runs the prompt's
last chunk creates it (0600, untracked: the engine owns it once the result arrives) and writes
straight into NumPy views of it. The name may already exist: the engine hands out a segment a
closed export left behind (its pages already faulted in: writing it runs at memcpy speed, a
fresh segment at the speed the kernel allocates pages), or a worker died part-way through
writing it before this retry. Either way it is overwritten, or replaced when too small.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import mmap

from aioprefill.kv import KVLayout
from aioprefill.shm.segments import attach_segment, create_segment
from aioprefill.workers.runner import ForwardBatch

__all__ = ["KVSegmentWriter", "open_writers"]


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


class KVSegmentWriter:
    """Writable `keys` / `values` views over a request's export segment."""

    _mm: mmap.mmap | None = None

    def __init__(self, name: str, layout: KVLayout, num_tokens: int) -> None:
        self.name = name
        self._mm = _open(name, layout.nbytes(num_tokens))
        self.keys, self.values = layout.views(self._mm, num_tokens)

    def close(self) -> None:
        """Unmap (the segment stays for the engine)."""
        self.keys = self.values = None  # type: ignore[assignment]
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    def discard(self) -> None:
        """Unmap and remove: the forward failed after the segment was opened."""
        self.close()
        _remove(self.name)


def open_writers(batch: ForwardBatch, layout: KVLayout) -> dict[int, KVSegmentWriter]:
    """A writer per request whose *last* chunk is in `batch` and asks for its KV (by batch
    index), each sized for the whole prompt. On failure none is left behind."""
    writers: dict[int, KVSegmentWriter] = {}
    if not batch.kv_names:
        return writers
    lens = batch.seq_lens()
    try:
        for i, name in batch.kv_name_of().items():
            if batch.is_last[i]:
                writers[i] = KVSegmentWriter(name, layout, int(batch.start_pos[i] + lens[i]))
    except BaseException:
        for writer in writers.values():
            writer.discard()
        raise
    return writers
