"""Decode side's transfer engine: one per process and protocol, started on the first pull,
and the daemon threads its blocking calls run on so that `pull_kv(timeout_s=...)` can give up
on a prefill engine that hangs (Mooncake's own reads have no per-call timeout; a dead peer
fails them at once, a stopped one only after its process-wide MC_TRANSFER_TIMEOUT).

Each thread owns a small registered scratch buffer for the id-table reads and release writes.
A thread stuck in a read stays out of the pool until the read returns; a new one is started
meanwhile, so one hung peer never blocks pulls from the others.

Mooncake keeps each peer's descriptor (its data port) by session name (`host:port`) for the
life of the engine and never looks it up again. A prefill engine restarted on the same
handshake port (a fixed port, or a random one drawn again) listens on a new data port, so
this process's reads to it would fail for good ("failed to read READ status frame", then
"connection refused" to the old data port: seen in CI, reproduced by forcing the port). So a
session that answered this engine before and now refuses gets one fresh engine
(`renew_local_engine`), which looks the peer up again; `MC_DISABLE_METACACHE` would also do,
but costs a handshake on every read (measured: a 64-byte read 86 -> 699 us).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from aioprefill.transfer.backend import new_engine

__all__ = ["LocalEngine", "Scratch", "local_engine", "renew_local_engine"]

HOST_ENV = "AIOPREFILL_TRANSFER_HOST"  # the decode side's own address (default loopback)
SCRATCH_BYTES = 64

Job = Callable[["Scratch"], Any]


class Scratch:
    """What a job runs with: the engine and a registered 64-byte buffer of its own thread."""

    def __init__(self, local: LocalEngine) -> None:
        self.local = local
        self.scratch = np.zeros(SCRATCH_BYTES, dtype=np.uint8)
        self.scratch_ptr = int(self.scratch.ctypes.data)
        local.engine.register_memory(self.scratch_ptr, SCRATCH_BYTES)


class Worker(Scratch):
    """A daemon thread running jobs."""

    def __init__(self, local: LocalEngine) -> None:
        super().__init__(local)
        self.jobs: queue.SimpleQueue[tuple[Job, Future[Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="aioprefill-kv-pull", daemon=True).start()

    def _run(self) -> None:
        while True:
            item = self.jobs.get()
            if item is None:  # its engine was replaced
                return
            job, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(job(self))
                except BaseException as exc:
                    future.set_exception(exc)
            if not self.local.idle(self):
                return


class LocalEngine:
    """This process's transfer engine for one protocol, and its pool of pull threads."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.engine, self.session = new_engine(os.environ.get(HOST_ENV, "127.0.0.1"), protocol)
        self._idle: list[Worker] = []
        self._lock = threading.Lock()
        self._inline = threading.local()
        self.reached: set[str] = set()  # sessions a read of this engine has succeeded on
        self.retired = False

    def run_inline(self, job: Job) -> Any:
        """Run `job` in the calling thread (no timeout: the caller chose to wait)."""
        scratch = getattr(self._inline, "scratch", None)
        if scratch is None:
            scratch = self._inline.scratch = Scratch(self)
        return job(scratch)

    def submit(self, job: Job) -> Future[Any]:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = Worker(self)
        future: Future[Any] = Future()
        worker.jobs.put((job, future))
        return future

    def idle(self, worker: Worker) -> bool:
        """Back into the pool; False once this engine was replaced (the thread ends)."""
        with self._lock:
            if not self.retired:
                self._idle.append(worker)
            return not self.retired

    def retire(self) -> None:
        """End the idle threads; busy ones end after their job. The Mooncake engine goes with
        the last reference (a pull still running on it finishes first)."""
        with self._lock:
            self.retired = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.jobs.put(None)


_engines: dict[str, LocalEngine] = {}
_engines_lock = threading.Lock()


def local_engine(protocol: str) -> LocalEngine:
    with _engines_lock:
        local = _engines.get(protocol)
        if local is None:
            local = _engines[protocol] = LocalEngine(protocol)
        return local


def renew_local_engine(stale: LocalEngine) -> LocalEngine:
    """Replace `stale`, if it is still this process's engine for its protocol, with a fresh
    one (which knows no peer yet); return the current engine."""
    with _engines_lock:
        if _engines.get(stale.protocol) is stale:
            _engines[stale.protocol] = LocalEngine(stale.protocol)
            stale.retire()
        return _engines[stale.protocol]
