"""Entry points for the processes the shm tests spawn. Kept light (no pytest, no hypothesis)
so a spawned child starts fast; tests/shm is on sys.path, which spawn passes to children."""

from __future__ import annotations

import os
import signal
import sys
import time
from multiprocessing.reduction import DupFd

from aioprefill.shm.channel import Channel, ChannelSpec
from aioprefill.shm.ring import Ring


def _detach(dup) -> int:  # type: ignore[no-untyped-def]
    return int(dup.detach())


class PassFd:
    """A Process argument that reaches a spawned child as the same fd (pass_fds), as an int.

    `DupFd` must run while the process object is being pickled for spawn, hence __reduce__.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_detach, (DupFd(self.fd),))


def echo(inbound: tuple[str, int], in_fds, outbound: tuple[str, int], out_fds, count: int) -> None:  # type: ignore[no-untyped-def]
    """Receive `count` frames on one channel and send each back, reversed, on the other."""
    inbox = Channel.attach(ChannelSpec(ring=inbound[0], capacity=inbound[1]), *in_fds)
    outbox = Channel.attach(ChannelSpec(ring=outbound[0], capacity=outbound[1]), *out_fds)
    try:
        for _ in range(count):
            view = inbox.recv_blocking(timeout=20)
            if view is None:
                sys.exit(3)
            frame = bytes(view)[::-1]
            inbox.release()
            if not outbox.send_blocking(frame, timeout=20):
                sys.exit(4)
    finally:
        inbox.close()
        outbox.close()


def attach_read_and_hang(name: str, conn) -> None:  # type: ignore[no-untyped-def]
    """Attach, read one frame, report it over `conn`, then hang until killed."""
    ring = Ring.attach(name)
    view = None
    deadline = time.monotonic() + 20
    while view is None and time.monotonic() < deadline:
        view = ring.try_read()
        if view is None:
            time.sleep(0.001)
    conn.send_bytes(bytes(view) if view is not None else b"")
    time.sleep(60)


def attach_read_close(name: str) -> None:
    """Attach, read and release one frame, close, exit normally (a well-behaved worker)."""
    ring = Ring.attach(name)
    view = ring.try_read()
    if view is None or bytes(view) != b"hello":
        sys.exit(5)
    ring.release()
    ring.close()


def engine_then_sigkill(kill_tracker: bool) -> None:
    """Run as a script: create a ring, let a spawned worker attach to it and exit, print the
    ring's name, then die by SIGKILL (optionally killing the resource tracker first)."""
    import multiprocessing as mp
    from multiprocessing import resource_tracker

    ring = Ring.create(4096, tag="killed")
    assert ring.try_write(b"hello")
    worker = mp.get_context("spawn").Process(target=attach_read_close, args=(ring.name,))
    worker.start()
    worker.join(30)
    print(ring.name, worker.exitcode, flush=True)
    if kill_tracker:
        pid = resource_tracker._resource_tracker._pid
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    engine_then_sigkill(sys.argv[1] == "kill-tracker")
