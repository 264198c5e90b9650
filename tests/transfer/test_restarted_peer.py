"""A prefill engine that went away and came back on the same host:port is pulled from again.

Mooncake keeps a peer's descriptor (its data port) by session name for the life of the local
engine; a new engine on the same handshake port listens on another data port, so the puller's
reads fail for good unless it looks the peer up again (`transfer.local.renew_local_engine`).
The first test checks the mechanism on a dead peer (fast, in CI); the second reproduces the
restart itself by forcing the new engine onto the old port (Mooncake's MC_MIN/MAX_RPC_PORT),
which waits out the old port's TIME_WAIT (~60 s): it runs where AIOPREFILL_SLOW_TESTS=1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.transfer.util import ROOT, need_mooncake

need_mooncake()

from aioprefill import TransferError  # noqa: E402
from aioprefill.transfer import pull_kv  # noqa: E402
from aioprefill.transfer.local import local_engine  # noqa: E402


def _serve(env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], dict]:
    """A SimModel engine with one KV export (tests.transfer.children serve) and its params."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.transfer.children", "serve"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(10)
        raise OSError(f"the serving child exited ({proc.returncode}) before its export")
    return proc, json.loads(line)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def test_a_peer_that_answered_before_and_now_refuses_gets_a_fresh_local_engine() -> None:
    first, params = _serve()
    try:
        assert pull_kv(params, timeout_s=10.0).shape[2] == 64
        old = local_engine("tcp")
        assert params["session"] in old.reached
    finally:
        _stop(first)
    with pytest.raises(TransferError):
        pull_kv(params, timeout_s=20.0)
    renewed = local_engine("tcp")
    assert renewed is not old and old.retired and params["session"] not in renewed.reached
    with pytest.raises(TransferError):  # gone for good: refused again, the engine kept
        pull_kv(params, timeout_s=20.0)
    assert local_engine("tcp") is renewed
    second, other = _serve()
    try:
        assert pull_kv(other, timeout_s=10.0).shape[2] == 64
        assert local_engine("tcp") is renewed and other["session"] in renewed.reached
    finally:
        _stop(second)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@pytest.mark.skipif(
    os.environ.get("AIOPREFILL_SLOW_TESTS") != "1", reason="~60-90 s: AIOPREFILL_SLOW_TESTS=1"
)
def test_a_prefill_engine_restarted_on_the_same_port_is_pulled_from_again() -> None:
    first, params = _serve()
    port = params["session"].rsplit(":", 1)[1]
    try:
        assert pull_kv(params, timeout_s=10.0).shape[2] == 64
    finally:
        _stop(first)
    # the new engine may draw only the old handshake port and a few above it (its data port)
    env = dict(os.environ, MC_MIN_RPC_PORT=port, MC_MAX_RPC_PORT=str(int(port) + 8))
    deadline = time.monotonic() + 150
    second = None
    while second is None and time.monotonic() < deadline:
        if not _bindable(int(port)):  # still in TIME_WAIT from the first engine's connections
            time.sleep(1.0)
            continue
        try:
            proc, again = _serve(env)
        except OSError:
            continue  # another process took a port of the range meanwhile
        if again["session"] == params["session"]:
            second = proc
        else:
            _stop(proc)
    assert second is not None, f"no engine came back on {params['session']} within 150 s"
    try:
        assert pull_kv(again, timeout_s=20.0).shape[2] == 64
    finally:
        _stop(second)
