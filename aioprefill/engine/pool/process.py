"""`WorkerHandle`: the engine's side of one worker process and its two channels.

Workers start under `spawn`, or for Paddle models on a CPU under a `forkserver` that has
already imported paddle (start-to-ready drops from ~0.9 s to ~0.2 s; on a CUDA device `spawn`:
`start_method_for`); the engine process itself never imports paddle and never forks after it.
The channels' eventfds reach the child through multiprocessing's own fd passing
(`reduction.DupFd`); the worker's spec travels msgspec-encoded. The only pickling is
multiprocessing's start-up handshake, never the data path.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import multiprocessing
import os
import signal
import time
from multiprocessing import reduction
from multiprocessing.process import BaseProcess
from typing import Any

from aioprefill.config import EngineConfig
from aioprefill.engine.pool.main_guard import missing_guard_hint, refuse_while_bootstrapping
from aioprefill.errors import ProtocolError, WorkerStartFailed
from aioprefill.models import PaddleModel
from aioprefill.parallel import ParallelInfo
from aioprefill.shm.channel import Channel
from aioprefill.wire import protocol
from aioprefill.wire.protocol import Ready, StartFailed, WorkerSpec
from aioprefill.workers.main import WORKER_ENV_PREFIX, worker_main

__all__ = ["WorkerHandle", "set_once", "start_method_for"]

PADDLE_PRELOAD = ["aioprefill.workers.paddle.runner"]


class _PassedFd:
    """An fd that multiprocessing duplicates into the child at start (then a plain int there)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _rebuild_fd, (reduction.DupFd(self.fd),)


def set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _rebuild_fd(dup: Any) -> int:
    return int(dup.detach())


def _start_worker(spec_bytes: bytes, to_fds: tuple[Any, Any], from_fds: tuple[Any, Any]) -> None:
    worker_main(spec_bytes, (int(to_fds[0]), int(to_fds[1])), (int(from_fds[0]), int(from_fds[1])))


def start_method_for(config: EngineConfig) -> str:
    """`forkserver` with paddle preloaded for Paddle models on a CPU, else `spawn`
    (overridable). A model that may run on a CUDA device (`device="gpu"`, or `"auto"` with
    Paddle's CUDA build installed and an NVIDIA device present) starts with `spawn`: a process
    forked from one that imported paddle's CUDA build inherits CUDA state it cannot use."""
    if config.start_method is not None:
        return config.start_method
    model = config.model
    if not isinstance(model, PaddleModel):
        return "spawn"
    if model.device == "gpu" or (model.device == "auto" and _cuda_paddle()):
        return "spawn"
    return "forkserver"


def _cuda_paddle() -> bool:
    """Whether Paddle's CUDA wheel is installed and an NVIDIA device is present (no import)."""
    if not os.path.exists("/dev/nvidiactl"):
        return False
    try:
        importlib.metadata.distribution("paddlepaddle-gpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


class WorkerHandle:
    """A started worker process: its channels, its process and its sentinel fd."""

    process: BaseProcess | None = None
    inbox: Channel | None = None  # engine -> worker
    outbox: Channel | None = None  # worker -> engine
    ready: Ready | None = None
    corrupt = False  # its result ring was found corrupt: never read again
    _exit_fd = -1  # pidfd: readable once the process exited *and* can be reaped

    def __init__(
        self,
        index: int,
        config: EngineConfig,
        parallel: ParallelInfo | None = None,
    ) -> None:
        """Worker process `index` (its place among all ranks); as a rank of a group of
        `group_size`, it meets its peers at `master` ("host:port")."""
        self.index = index
        capacity = config.effective_ring_capacity()
        self.inbox = Channel.create(capacity, tag=f"w{index}-in")
        try:
            self.outbox = Channel.create(capacity, tag=f"w{index}-out")
        except BaseException:
            self.close()
            raise
        self.spec = WorkerSpec(
            worker=index,
            model=config.model,
            to_worker=self.inbox.spec,
            from_worker=self.outbox.spec,
            engine_pid=os.getpid(),
            parallel=parallel or ParallelInfo(),
            prefix_cache_bytes=config.prefix_cache_bytes,
            block_tokens=config.prefix_block_tokens,
            kv_store=config.kv_store_options if config.kv_store else None,
            env={k: v for k, v in os.environ.items() if k.startswith(WORKER_ENV_PREFIX)},
        )
        self._method = start_method_for(config)

    def start(self) -> None:
        refuse_while_bootstrapping()  # not multiprocessing's opaque RuntimeError
        ctx = multiprocessing.get_context(self._method)
        if self._method == "forkserver":
            ctx.set_forkserver_preload(PADDLE_PRELOAD)
        assert self.inbox is not None and self.outbox is not None
        to_fds = tuple(_PassedFd(fd) for fd in self.inbox.fds())
        from_fds = tuple(_PassedFd(fd) for fd in self.outbox.fds())
        self.process = ctx.Process(  # type: ignore[attr-defined]
            target=_start_worker,
            args=(protocol.encode(self.spec), to_fds, from_fds),
            name=f"aioprefill-worker-{self.index}",
            daemon=True,
        )
        self.started_ns = time.monotonic_ns()
        self.process.start()
        if self._method != "forkserver":  # (its sentinel carries the exit code: see exit_fd)
            with contextlib.suppress(OSError, AttributeError):  # no pidfd: the sentinel
                self._exit_fd = os.pidfd_open(self.process.pid)  # type: ignore[arg-type]

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None and self.process.pid else -1

    @property
    def sentinel(self) -> int:
        assert self.process is not None
        return self.process.sentinel

    @property
    def exit_fd(self) -> int:
        """The fd that turns readable when the process exits: its pidfd, which fires only once
        the process can be reaped, so `exit_code()` then never waits (the sentinel, a pipe the
        child holds, closes while it exits: reaping right after it may still block). The
        sentinel where pidfds are missing (Linux < 5.3), and under `forkserver`, whose
        sentinel is the server's socket that turns readable with the exit code (the process is
        the server's child: only the server can reap it)."""
        return self._exit_fd if self._exit_fd >= 0 else self.sentinel

    def exit_code(self) -> int | None:
        """The exit code (negative: the signal) if the process was reaped or can be now; None
        while it runs. Never blocks: safe on the event loop."""
        if self.process is None:
            return None
        with contextlib.suppress(ValueError):  # the process object was closed
            return self.process.exitcode
        return None

    async def wait_ready(self, timeout: float) -> Ready:
        """Wait for the worker's Ready; raise WorkerStartFailed if it fails, dies or times out."""
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(self.exit_fd, set_once, died)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    msg = self._recv_start_message()
                    if isinstance(msg, Ready):
                        self.ready = msg
                        return msg
                    if isinstance(msg, StartFailed):
                        raise WorkerStartFailed(
                            f"worker {self.index} failed to start: {msg.error_type}: {msg.message}"
                        )
                    if died.done():
                        raise WorkerStartFailed(self._died_before_ready())
                    assert self.outbox is not None
                    waiter = asyncio.ensure_future(self.outbox.wait_async())
                    try:
                        await asyncio.wait({waiter, died}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        if not waiter.done():
                            waiter.cancel()
                            with contextlib.suppress(BaseException):
                                await waiter
        except TimeoutError:
            raise WorkerStartFailed(
                f"worker {self.index} was not ready within {timeout:g} s"
            ) from None
        except ProtocolError as exc:  # garbage instead of Ready: never trust this worker
            raise WorkerStartFailed(f"worker {self.index} failed to start: {exc}") from exc
        finally:
            loop.remove_reader(self.exit_fd)

    def _died_before_ready(self) -> str:
        """Why the worker exited before Ready: its exit code (its exit fd fired: reaping it
        does not wait) and, when it fits, the missing guard."""
        code = self.exit_code()
        why = f"exit code {code}" if code is None or code >= 0 else f"signal {-code}"
        hint = missing_guard_hint() if code == 1 else ""
        return (
            f"worker {self.index} (pid {self.pid}) exited before it was ready ({why}; its "
            f"traceback, if any, is on stderr){hint}"
        )

    def _recv_start_message(self) -> Ready | StartFailed | None:
        assert self.outbox is not None
        view = self.outbox.recv_nowait()
        if view is None:
            return None
        try:
            msg = protocol.decode_from_worker(view)
        finally:
            self.outbox.release()
        if not isinstance(msg, (Ready, StartFailed)):
            raise ProtocolError(f"worker {self.index} sent {type(msg).__name__} before Ready")
        return msg

    async def wait_exit(self, timeout: float) -> None:
        """Wait up to `timeout` s for the process to exit (e.g. after Shutdown), then kill it."""
        if self.pid <= 0 or self.exit_code() is not None:
            return  # never started, or already exited
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()
        loop.add_reader(self.exit_fd, set_once, exited)
        try:
            await asyncio.wait_for(exited, max(0.0, timeout))
        except TimeoutError:
            self.kill()  # gone within moments; still waited for without blocking the loop
            loop.remove_reader(self.exit_fd)
            killed: asyncio.Future[None] = loop.create_future()
            loop.add_reader(self.exit_fd, set_once, killed)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(killed, 5.0)
        finally:
            loop.remove_reader(self.exit_fd)
        self.exit_code()  # reap it

    def kill(self) -> None:
        """SIGKILL the process if it runs (a no-op once it was reaped or closed)."""
        with contextlib.suppress(ValueError):  # ValueError: the process object was closed
            if self.process is not None and self.process.pid and self.process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.process.pid, signal.SIGKILL)

    def close(self) -> bool:
        """Release the channels (unlinking their segments) and, if the process was reaped (or
        can be now), the process and its exit fd: True. Never waits: a process still exiting
        keeps its exit fd (False), and `reap()` finishes once that fires."""
        for ch in (self.inbox, self.outbox):
            if ch is not None:
                ch.close()
                ch.unlink()
        self.inbox = self.outbox = None
        if self.process is None or self.exit_code() is not None:
            self.reap()
            return True
        return False

    def reap(self) -> None:
        """The process exited (its exit fd fired): collect it and close its fds."""
        if self.process is not None and self.exit_code() is not None:
            self.process.close()
        if self._exit_fd >= 0:
            os.close(self._exit_fd)
            self._exit_fd = -1
