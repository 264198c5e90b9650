"""Pulls that cannot succeed fail typed, quickly: forged or malformed params, a prefill engine
that hangs or dies, and a decode process killed mid-pull leaves nothing once the export
expires."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.transfer.util import (
    ROOT,
    kv_segments,
    need_mooncake,
    registered,
    transfer_config,
    wait_for,
)

need_mooncake()

from aioprefill import (  # noqa: E402
    AioprefillError,
    Engine,
    InvalidRequest,
    KVExportClosed,
    TransferError,
)
from aioprefill.transfer import pull_kv, release_kv  # noqa: E402


def _forged(params: dict, **changes: object) -> dict:
    out = json.loads(json.dumps(params))
    for key, value in changes.items():
        if key in out["layout"]:
            out["layout"][key] = value
        else:
            out[key] = value
    return out


@pytest.mark.asyncio
async def test_forged_and_malformed_params_raise_typed_errors():
    async with Engine(transfer_config()) as engine:
        r = await engine.prefill(list(range(1, 33)), return_kv=True)
        p = r.kv.transfer_params()
        malformed = [
            "not json",
            [],
            {k: v for k, v in p.items() if k != "addr"},
            {**p, "extra": 1},
            _forged(p, addr="1"),
            _forged(p, addr=-4096),
            _forged(p, nbytes=p["nbytes"] * 2),  # disagrees with the layout
            _forged(p, num_tokens=p["layout"]["num_tokens"] + 1),
            _forged(p, dtype="int8"),
            _forged(p, keys="before_rope"),
            _forged(p, session="127.0.0.1"),
            _forged(p, session="127.0.0.1:99999"),
            _forged(p, export_id="0" * 16),
            _forged(p, export_id="xyz"),
            _forged(p, backend="nixl"),
            _forged(p, version=2),
        ]
        for bad in malformed:
            with pytest.raises(InvalidRequest):
                pull_kv(bad)
            with pytest.raises(InvalidRequest):
                release_kv(bad)
        for timeout in (0, -1.0, True, "1"):
            with pytest.raises(InvalidRequest):
                pull_kv(p, timeout_s=timeout)
        # well formed but naming memory that is not this export's
        other = await engine.prefill(list(range(1, 33)), return_kv=True)
        q = other.kv.transfer_params()
        cases = [
            (_forged(p, export_id=f"{int(p['export_id'], 16) ^ 1:016x}"), KVExportClosed),
            (_forged(p, addr=q["addr"]), InvalidRequest),  # another export's bytes
            (_forged(p, addr=p["addr"] + (1 << 30)), InvalidRequest),  # refused by the owner
            (_forged(p, id_addr=p["id_addr"] + (1 << 30)), TransferError),
            (_forged(p, id_addr=q["id_addr"]), KVExportClosed),
        ]
        for bad, error in cases:
            started = time.monotonic()
            with pytest.raises(error):
                await asyncio.to_thread(pull_kv, bad, timeout_s=10.0)
            assert time.monotonic() - started < 5.0
        # the real ones still pull, and nothing was released by the forgeries
        kv = await asyncio.to_thread(pull_kv, p)
        assert kv.export_id == p["export_id"] and not r.kv.closed
        assert registered(engine) == 2


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until every thread of `pid` is stopped: SIGSTOP reaches each thread as it next leaves the
    kernel, and on a loaded machine one of Mooncake's server threads once answered a pull
    after kill() had returned (CI-like fresh clone, two test processes)."""
    deadline = time.monotonic() + timeout
    tasks = Path(f"/proc/{pid}/task")
    while time.monotonic() < deadline:
        states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
        if all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} not stopped after {timeout} s: {states}")


def test_a_hung_or_dead_prefill_engine_fails_the_pull_within_the_timeout():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.transfer.children", "serve"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        params = json.loads(proc.stdout.readline())
        assert pull_kv(params, timeout_s=10.0).shape[2] == 64
        os.kill(proc.pid, signal.SIGSTOP)  # hung: accepts nothing, answers nothing
        wait_stopped(proc.pid)
        started = time.monotonic()
        with pytest.raises(TransferError, match=r"within 1\.0 s"):
            pull_kv(params, timeout_s=1.0)
        assert time.monotonic() - started < 3.0
        proc.kill()
        proc.wait(10)
        started = time.monotonic()  # dead: Mooncake retries the connection for ~5 s
        with pytest.raises(TransferError):
            pull_kv(params, timeout_s=2.0)
        assert time.monotonic() - started < 4.0
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.asyncio
async def test_a_decode_process_killed_mid_pull_leaves_nothing_once_the_export_expires():
    # The export's TTL runs from the prefill: the child's first pull (its transfer engine's start
    # and handshake) took 4.6 s on a loaded 2-core machine, past a 3 s TTL. So the child
    # imports before the export exists, and the TTL is 8 s.
    async with Engine(transfer_config(ttl=8.0)) as engine:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.transfer.children",
            "loop",
            cwd=ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line == b"ready\n", (await proc.stderr.read()).decode()[-3000:]
        r = await engine.prefill(list(range(1, 200)), return_kv=True)
        proc.stdin.write(json.dumps(r.kv.transfer_params()).encode() + b"\n")
        await proc.stdin.drain()
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert line == b"pulling\n", (await proc.stderr.read()).decode()[-3000:]
        await asyncio.sleep(0.05)
        proc.kill()  # in the middle of some pull
        await proc.wait()
        assert registered(engine) == 1
        await wait_for(lambda: r.kv.closed, timeout=15.0)
        assert registered(engine) == 0
        # the kept segment is the ledger's, as for any closed export; the engine removes it
        assert engine._kv.used_bytes == engine._kv.pooled_bytes
    assert engine._kv.transfer is not None and engine._kv.transfer.num_regions == 0
    assert kv_segments(engine) == []


def test_errors_are_aioprefill_errors():
    assert issubclass(TransferError, AioprefillError) and issubclass(TransferError, ConnectionError)
    assert issubclass(KVExportClosed, AioprefillError)
