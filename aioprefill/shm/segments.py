"""Shared-memory segments: naming, creating, attaching, unlinking, and removing stale ones.

Names are `aioprefill-{owner_pid}-{16 random hex}-{tag}`: unguessable (so another local user
cannot pre-create or squat a segment), and carrying the creating process's pid so a later
engine can tell a live engine's segments from those of a SIGKILLed one
(`cleanup_stale_segments`).

Ownership and the resource tracker. The creator registers its segments with
`multiprocessing.resource_tracker`: if the creating process dies without unlinking (SIGKILL,
OOM), its tracker unlinks them once every process holding the tracker's pipe has exited.
Attaching never touches the tracker. On Python 3.11 `SharedMemory(name, create=False)`
registers the segment, and a spawned worker shares its parent's tracker, so the usual
workaround (unregister after attaching) deletes the *creator's* entry too (the tracker keeps a
set, not a count) and a SIGKILLed engine would leak. We therefore open and map segments
ourselves with `_posixshmem.shm_open` + `mmap`, which is what `SharedMemory` does inside.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import mmap
import os
import re
import secrets
import stat
import time
from multiprocessing import resource_tracker
from pathlib import Path

__all__ = [
    "SHM_DIR",
    "attach_segment",
    "cleanup_stale_segments",
    "create_segment",
    "owner_pid",
    "segment_name",
    "unlink_segment",
]

SHM_DIR = Path("/dev/shm")
PREFIX = "aioprefill-"
PAGE_SIZE = mmap.PAGESIZE
_TAG = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_NAME = re.compile(r"aioprefill-(\d{1,10})-([0-9a-f]{16})-[A-Za-z0-9_.-]{1,64}")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def segment_name(tag: str, owner_pid: int | None = None) -> str:
    """A fresh, unguessable segment name: `aioprefill-{pid}-{16 hex}-{tag}`."""
    if not _TAG.fullmatch(tag):
        raise ValueError(f"segment tag must match [A-Za-z0-9_.-]{{1,64}}, got {tag!r}")
    pid = os.getpid() if owner_pid is None else owner_pid
    return f"{PREFIX}{pid}-{secrets.token_hex(8)}-{tag}"


def owner_pid(name: str) -> int | None:
    """The pid inside an aioprefill segment name, or None when the name is not one of ours."""
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def create_segment(name: str, size: int, *, track: bool = True, prefault: bool = True) -> mmap.mmap:
    """Create segment `name` (mode 0600, must not exist), map it, pre-fault every page.

    The segment is registered with the resource tracker (see the module docstring) unless
    `track` is False: a worker writing a segment that the engine will own (a KV export) leaves
    that to the engine. `prefault=False` skips touching every page, for a segment written once
    right away. On any failure the segment is removed again before the exception propagates.
    """
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    if track:
        resource_tracker.register("/" + name, "shared_memory")
    try:
        try:
            os.fchmod(fd, 0o600)  # exactly 0600 whatever the umask
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (_POPULATE if prefault else 0))
        finally:
            os.close(fd)
        if prefault:
            _prefault(mm)
    except BaseException:
        if track:
            unlink_segment(name)
        else:
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink("/" + name)
        raise
    return mm


def _prefault(mm: mmap.mmap) -> None:
    # Write one byte per page so every page is allocated and mapped writable now: a first
    # touch on the hot path copies 10x slower than a warm page. MAP_POPULATE alone read-faults.
    buf = memoryview(mm)
    try:
        for offset in range(0, len(buf), PAGE_SIZE):
            buf[offset] = 0
    finally:
        buf.release()


def attach_segment(name: str) -> mmap.mmap:
    """Map an existing segment read-write without registering it anywhere (see module doc)."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        size = os.fstat(fd).st_size
        if size <= 0:
            raise ValueError(f"shared-memory segment {name!r} is empty")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> bool:
    """Remove segment `name` and drop it from the resource tracker; False if already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
        gone = True
    except FileNotFoundError:
        gone = False
    resource_tracker.unregister("/" + name, "shared_memory")
    return gone


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, belongs to another user
    return True


def _started_after(pid: int, when: float) -> bool:
    """True when process `pid` started over a second after time `when`: a recycled pid."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
        start_ticks = int(raw[raw.rindex(b")") + 2 :].split()[19])  # proc(5) field 22
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    started = time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    return started > when + 1.0


def cleanup_stale_segments() -> list[str]:
    """Remove this user's aioprefill segments whose owner process is gone; return their names.

    An engine calls this at start to reclaim the segments of an engine that was SIGKILLed
    before its resource tracker could run. A segment is stale when the pid in its name is not
    alive, or was recycled by a process that started after the segment was created. Segments
    of live engines (any user) and of other users are left alone.
    """
    removed: list[str] = []
    uid = os.getuid()
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return removed
    for entry in entries:
        pid = owner_pid(entry.name)
        if pid is None or pid == os.getpid():
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid or not stat.S_ISREG(st.st_mode):
            continue
        if _pid_alive(pid) and not _started_after(pid, st.st_ctime):
            continue
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink("/" + entry.name)
            removed.append(entry.name)
    return removed
