"""Segments: names, permissions, the resource tracker, and nothing left in /dev/shm when a
consumer or the creating engine is SIGKILLed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
import subprocess
import sys
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import shm_children

from aioprefill.shm import segments
from aioprefill.shm.ring import Ring
from aioprefill.shm.segments import cleanup_stale_segments, owner_pid, segment_name

SHM = Path("/dev/shm")
CHILDREN = Path(shm_children.__file__)


def wait_gone(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def dead_pid() -> int:
    """A pid that just exited (and was reaped), so it is not alive."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return int(proc.stdout)


def test_names_are_random_and_carry_the_pid():
    a, b = segment_name("x"), segment_name("x")
    assert a != b
    assert owner_pid(a) == os.getpid()
    assert owner_pid(segment_name("w0-in", owner_pid=123)) == 123
    assert owner_pid("aioprefill-12-nothex-x") is None
    assert owner_pid("psm_1234") is None
    assert len(a.split("-")[2]) == 16


def test_mode_0600_even_with_a_lax_umask():
    old = os.umask(0)
    try:
        ring = Ring.create(64, tag="mode")
    finally:
        os.umask(old)
    try:
        st = os.stat(SHM / ring.name)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
    finally:
        ring.close()
        ring.unlink()


def test_close_then_unlink_leaves_nothing():
    ring = Ring.create(4096, tag="gone")
    path = SHM / ring.name
    attached = Ring.attach(ring.name)
    attached.close()
    attached.unlink()  # not the creator: a no-op
    assert path.exists()
    ring.close()
    assert path.exists()  # close() does not unlink
    ring.unlink()
    ring.unlink()  # idempotent
    assert not path.exists()


def test_attach_does_not_touch_the_resource_tracker(monkeypatch: pytest.MonkeyPatch):
    calls: list[tuple[str, str]] = []
    ring = Ring.create(64, tag="rt")
    try:
        monkeypatch.setattr(resource_tracker, "register", lambda *a: calls.append(("reg", *a)))
        monkeypatch.setattr(resource_tracker, "unregister", lambda *a: calls.append(("unr", *a)))
        other = Ring.attach(ring.name)
        other.close()
        other.unlink()
        assert calls == []
    finally:
        monkeypatch.undo()
        ring.close()
        ring.unlink()


@pytest.mark.timeout(60)
def test_consumer_sigkilled_leaves_nothing():
    """A consumer (spawned, sharing our resource tracker) is SIGKILLed mid-frame: the segment
    is still ours, intact, and close + unlink leave nothing behind."""
    ring = Ring.create(4096, tag="consumer")
    path = SHM / ring.name
    try:
        assert ring.try_write(b"frame-1")
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=shm_children.attach_read_and_hang, args=(ring.name, child))
        proc.start()
        child.close()
        try:
            assert parent.poll(30), "consumer never reported"
            assert parent.recv_bytes() == b"frame-1"
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            proc.join(10)
            assert proc.exitcode == -signal.SIGKILL
        finally:
            parent.close()
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        assert path.exists()
        assert ring.try_write(b"frame-2")  # still usable by the producer
    finally:
        ring.close()
        ring.unlink()
    assert not path.exists()


def run_engine_script(mode: str) -> tuple[str, int, str]:
    """Run the engine script; returns (segment name, worker exit code, stderr). The engine's
    resource tracker inherits its stderr, so this also waits for the tracker to finish."""
    proc = subprocess.run(
        [sys.executable, str(CHILDREN), mode],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=CHILDREN.parent,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    name, worker_exit = proc.stdout.split()
    return name, int(worker_exit), proc.stderr


@pytest.mark.timeout(90)
def test_sigkilled_engine_is_cleaned_by_its_resource_tracker():
    """The engine creates a ring, a spawned worker (sharing its tracker) attaches, reads,
    closes and exits, then the engine is SIGKILLed. Its tracker unlinks the segment: so the
    creator's registration survived the worker's attach (which must not unregister it)."""
    name, worker_exit, stderr = run_engine_script("keep-tracker")
    assert worker_exit == 0
    assert owner_pid(name) is not None
    # The tracker itself did it (not a concurrent engine's cleanup_stale_segments): it warns.
    assert "leaked shared_memory objects to clean up" in stderr, stderr
    assert wait_gone(SHM / name, 10), f"{name} leaked after the engine was SIGKILLed"


@pytest.mark.timeout(90)
def test_cleanup_stale_segments_after_engine_and_tracker_sigkilled():
    """Engine and its resource tracker both SIGKILLed (kill -9 of the process group): the
    segment stays, and a later engine's cleanup_stale_segments() removes it."""
    name, worker_exit, _ = run_engine_script("kill-tracker")
    assert worker_exit == 0
    path = SHM / name
    present = path.exists()  # a concurrent engine's cleanup may have beaten us to it
    removed = cleanup_stale_segments()
    assert not path.exists()
    if present:
        assert name in removed


def test_cleanup_keeps_live_and_foreign_names():
    live = Ring.create(64, tag="live")  # our own pid: alive
    stale_name = segment_name("stale", owner_pid=dead_pid())
    mm = segments.create_segment(stale_name, 4096)
    mm.close()
    foreign = SHM / f"aioprefill-{dead_pid()}-not-ours"  # does not match the name pattern
    foreign.write_bytes(b"")
    try:
        removed = cleanup_stale_segments()
        assert stale_name in removed or not (SHM / stale_name).exists()
        assert not (SHM / stale_name).exists()
        assert (SHM / live.name).exists()
        assert foreign.exists()
    finally:
        foreign.unlink()
        segments.unlink_segment(stale_name)  # gone already: drops the tracker entry
        live.close()
        live.unlink()


def test_cleanup_removes_recycled_pid(monkeypatch: pytest.MonkeyPatch):
    """A stale segment whose pid now belongs to a process started after it is removed."""
    name = segment_name("recycled", owner_pid=1)  # pid 1 is alive, started at boot...
    mm = segments.create_segment(name, 4096)
    mm.close()
    try:
        assert name not in cleanup_stale_segments()  # ...before the segment: kept
        # Only pid 1 looks recycled: `lambda pid, when: True` made this call unlink every live
        # engine's segments on the machine (any test run or server of this user, at that moment).
        monkeypatch.setattr(segments, "_started_after", lambda pid, when: pid == 1)
        assert name in cleanup_stale_segments()
    finally:
        segments.unlink_segment(name)
