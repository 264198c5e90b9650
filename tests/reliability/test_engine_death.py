"""SIGKILL the engine process while it is busy: no worker outlives it, and no /dev/shm entry
of it survives the start of the next engine."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from aioprefill import Engine, EngineConfig
from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.shm.segments import cleanup_stale_segments
from tests.reliability.util import SHM, pid_alive, segments_of, sim, wait_dead

CHILD = Path(__file__).with_name("engine_child.py")
ROOT = Path(__file__).parents[2]


def start_busy_engine(mode: str) -> tuple[subprocess.Popen[bytes], dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(CHILD), mode], stdout=subprocess.PIPE, env=env, cwd=ROOT
    )
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    if not ready:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        pytest.fail("the engine subprocess did not report busy within 60 s")
    line = proc.stdout.readline()
    assert line, f"the engine subprocess exited early with {proc.wait()}"
    return proc, json.loads(line)


async def start_next_engine() -> None:
    async with Engine(EngineConfig(model=sim(), num_workers=1)) as engine:
        await engine.prefill([1])


# busy: every worker mid-forward. hung: worker 0 in a forward that never ends (only the
# kernel's parent-death signal can stop it). no-tracker: the engine's resource tracker is
# killed too, so only the next engine's sweep can remove the segments.
@pytest.mark.parametrize("mode", ["busy", "hung", "no-tracker"])
def test_sigkilled_engine_leaves_no_worker_and_no_segment(mode: str):
    proc, report = start_busy_engine(mode)
    pid = report["pid"]
    try:
        segments = report["segments"]
        assert len(segments) == 4 and segments == segments_of(pid)  # two channels per worker
        for name in segments:
            assert stat.S_IMODE((SHM / name).stat().st_mode) == 0o600
        if mode == "no-tracker":
            os.kill(report["tracker"], signal.SIGKILL)
            assert not wait_dead([report["tracker"]], 5)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
    assert proc.returncode == -signal.SIGKILL
    survivors = wait_dead(report["workers"], timeout=5.0)
    assert not survivors, f"workers outlived their engine: {survivors}"
    # Its resource tracker exits too, once the last process holding its pipe is gone.
    assert not wait_dead([report["tracker"]], 5.0)
    if mode == "no-tracker":
        assert segments_of(pid) == segments  # nobody removed them: the next engine must
    asyncio.run(start_next_engine())
    assert segments_of(pid) == []
    assert not pid_alive(pid)


def test_sweep_spares_live_engines_and_foreign_names(tmp_path):
    """cleanup_stale_segments removes only aioprefill segments whose owner pid is dead."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    dead_pid = int(dead.stdout)
    mine = f"aioprefill-{os.getpid()}-0123456789abcdef-live"
    stale = f"aioprefill-{dead_pid}-0123456789abcdef-stale"
    foreign = f"notours-{dead_pid}-0123456789abcdef-x"
    for name in (mine, stale, foreign):
        fd = os.open(SHM / name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)
    try:
        removed = cleanup_stale_segments()
        assert stale in removed
        assert not (SHM / stale).exists()
        assert (SHM / mine).exists() and (SHM / foreign).exists()
    finally:
        for name in (mine, stale, foreign):
            (SHM / name).unlink(missing_ok=True)


@pytest.mark.asyncio
async def test_a_worker_whose_engine_is_already_gone_exits():
    """The engine died while the worker was loading: it must not serve (or linger) forever."""
    handle = WorkerHandle(0, EngineConfig(model=sim()))
    try:
        # Pretend the engine is a process that already exited (a fresh child's pid, reaped).
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        handle.spec = msgspec.structs.replace(handle.spec, engine_pid=gone.pid)
        handle.start()
        await handle.wait_ready(30)
        assert handle.process is not None
        loop = asyncio.get_running_loop()
        exited = loop.create_future()
        loop.add_reader(handle.sentinel, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, 5)
        finally:
            loop.remove_reader(handle.sentinel)
        handle.process.join(1)
        assert handle.process.exitcode == 0
    finally:
        handle.kill()
        if handle.process is not None:
            handle.process.join(5)
        handle.close()
