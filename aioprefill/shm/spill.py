"""Results too large for the result ring travel through a one-shot segment instead.

A `BatchResult` is small unless requests asked for big outputs (top-k over much of the
vocabulary, embeddings of a wide model for a full batch, prompt log-probabilities of long
prompts). Past `threshold(ring)` bytes the worker writes the encoded result into a fresh
segment named with the engine's pid (0600, untracked) and sends a `Spilled` message naming it;
the engine copies it out, unlinks it and decodes as usual. A dead engine's leftovers are removed
at the next start (`cleanup_stale_segments`), like every segment.
"""

from __future__ import annotations

import _posixshmem
import contextlib

from aioprefill.shm.segments import attach_segment, create_segment, segment_name

__all__ = ["read_spilled", "spill", "threshold"]


def threshold(max_frame: int) -> int:
    """Frames larger than this spill: a quarter of the ring's largest, so several fit."""
    return max_frame // 4


def spill(payload: memoryview | bytes, engine_pid: int, tag: str = "spill") -> str:
    """Write `payload` into a new segment owned (by name) by the engine; return its name."""
    name = segment_name(tag, owner_pid=engine_pid)
    mm = create_segment(name, max(1, len(payload)), track=False, prefault=False)
    try:
        mm[: len(payload)] = payload
    except BaseException:
        mm.close()
        _remove(name)
        raise
    mm.close()
    return name


def read_spilled(name: str, size: int) -> bytes:
    """Copy a spilled frame out and remove its segment."""
    try:
        mm = attach_segment(name)
        try:
            if size > len(mm):
                raise ValueError(f"spilled frame {name} holds {len(mm)} bytes, not {size}")
            return mm[:size]
        finally:
            mm.close()
    finally:
        _remove(name)


def _remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)
