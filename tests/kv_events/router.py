"""vllm-router 0.1.17 started by a test on 127.0.0.1 (killed by pid at exit, even on failure)."""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.serve.util import free_port

ROUTER = Path(sys.executable).parent / "vllm-router"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Router:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def output(self) -> str:
        return ANSI.sub("", self.log.read_text(errors="replace"))

    def advanced(self, worker_url: str) -> bool:
        """The router applied a batch from `worker_url`'s event source, live or replayed (its
        debug log: with a replay source it asks for a replay as it starts)."""
        return f"sequence advanced source={worker_url} " in self.output()

    def applied(self, worker_url: str) -> int:
        """How many batches from `worker_url`'s source the router has applied so far."""
        return self.output().count(f"sequence advanced source={worker_url} ")

    def wait_applied(self, worker_url: str, more_than: int) -> None:
        """Until the router has applied more than `more_than` batches from `worker_url`."""
        deadline = time.monotonic() + 30
        while self.applied(worker_url) <= more_than:
            assert time.monotonic() < deadline, self.output()[-4000:]
            time.sleep(0.02)


@contextmanager
def router(
    workers: Sequence[str],
    policy: str,
    *flags: str,
    sources: dict[str, str] | None = None,
    replays: dict[str, str] | None = None,
) -> Iterator[Router]:
    """vllm-router in front of `workers`; `sources` / `replays`: worker URL -> endpoint."""
    port = free_port()
    kv: list[str] = []
    for url, ep in (sources or {}).items():
        kv += ["--kv-event-source", f"{url}={ep}"]
    for url, ep in (replays or {}).items():
        kv += ["--kv-event-replay-source", f"{url}={ep}"]
    if sources:
        kv += ["--kv-event-model", "sim"]
    with tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(
            [str(ROUTER), "--worker-urls", *workers, "--host", "127.0.0.1",
             "--port", str(port), "--policy", policy, "--log-level", "debug",
             "--health-check-interval-secs", "1", "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port()), *kv, *flags],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    r = Router(proc, f"http://127.0.0.1:{port}", Path(log.name))
    try:
        deadline = time.monotonic() + 60
        while True:  # start-up only
            if proc.poll() is not None:
                raise AssertionError(f"vllm-router exited:\n{r.output()[-4000:]}")
            try:
                if httpx.get(r.url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm-router did not start:\n{r.output()[-4000:]}")
            time.sleep(0.1)
        yield r
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        Path(log.name).unlink()
