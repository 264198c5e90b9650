"""Real `python -m aioprefill.serve` processes on 127.0.0.1 for the tests of tests/serve/."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
HF = ROOT / "tests" / "data" / "hf"
SHM = Path("/dev/shm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> dict:
        """Poll /health until 200 (start-up only: never on a measured path)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return r.json()
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("server did not become ready:\n" + self.output())

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@contextmanager
def serve(*flags: str, ready: bool = True) -> Iterator[Server]:
    """A server process with `flags`; killed at exit if still running."""
    port = free_port()
    with tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "aioprefill.serve", "--port", str(port), *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
    server = Server(proc, port, Path(log.name))
    try:
        if ready:
            server.wait_ready()
        yield server
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(log.name)


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    """True once none of `pids` is alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.05)
    return False


def segments_of(pid: int) -> list[str]:
    return sorted(p.name for p in SHM.glob(f"aioprefill-{pid}-*"))
