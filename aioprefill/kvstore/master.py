"""`LocalMaster`: a `mooncake_master` (the binary in Mooncake's wheel) started on this host
for one-node setups, tests and benchmarks: listening on `host` only, on a free (or given)
port, its metrics server on a free port of `host` too, stopped by pid.

    with LocalMaster() as master:          # master.address: "127.0.0.1:PORT"
        EngineConfig(kv_store="mooncake", kv_store_options=KVStoreOptions(master=master.address))
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from aioprefill.errors import InvalidConfig

__all__ = ["LocalMaster", "free_port", "master_binary"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def master_binary() -> Path:
    """The `mooncake_master` executable inside the installed `mooncake` package."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidConfig("mooncake_master: pip install 'aioprefill[transfer]'")
    path = Path(next(iter(spec.submodule_search_locations))) / "mooncake_master"
    if not path.is_file():
        raise InvalidConfig(f"mooncake_master: not found at {path}")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)
    return path


class LocalMaster:
    """One `mooncake_master` process. `start()` returns once its RPC port accepts."""

    process: subprocess.Popen[bytes] | None = None

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_path: str | os.PathLike[str] | None = None,
        *extra: str,
    ) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.log_path = log_path
        self.extra = extra

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self, timeout: float = 30.0) -> LocalMaster:
        args = [
            str(master_binary()),
            f"-rpc_port={self.port}",
            f"-rpc_address={self.host}",
            f"-metrics_port={free_port(self.host)}",
            f"-metrics_host={self.host}",
            "-enable_metric_reporting=false",
            "-enable_http_metadata_server=false",
            *self.extra,
        ]
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout
        while True:  # start-up only: the port accepts within a few hundred ms
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.process.returncode}")
            try:
                socket.create_connection((self.host, self.port), 0.2).close()
                return self
            except OSError as exc:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"mooncake_master did not listen on {self.address}") from exc
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would (faults tests)."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout: float = 10.0) -> None:
        p = self.process
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def __enter__(self) -> LocalMaster:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
