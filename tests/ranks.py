"""Run a function on every rank of a real group of spawned processes and collect what each
returns (bytes). The group meets at a free localhost port, as the engine's would."""

from __future__ import annotations

import importlib
import multiprocessing
import os
from collections.abc import Sequence
from multiprocessing.connection import Connection

from aioprefill.workers.group import free_port


def _child(target: str, rank: int, size: int, master: str, arg: bytes, conn: Connection) -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")  # paddle's INFO lines about its TCP store
    module, _, name = target.partition(":")
    try:
        out = getattr(importlib.import_module(module), name)(rank, size, master, arg)
        conn.send_bytes(b"ok" + out)
    except BaseException as exc:
        conn.send_bytes(b"er" + f"rank {rank}: {type(exc).__name__}: {exc}".encode())
        raise
    finally:
        conn.close()


def run_ranks(
    target: str,
    size: int,
    arg: bytes = b"",
    timeout: float = 240.0,
    collect: Sequence[int] | None = None,
) -> list[bytes | None]:
    """`target` ("module:function") called as f(rank, size, master, arg) -> bytes in `size`
    spawned processes; the results of the ranks in `collect` (default: all), by rank, None for
    a rank that died without one. Raises if a rank fails or times out. Ranks still running
    once the results are in are killed."""
    ctx = multiprocessing.get_context("spawn")
    master = f"127.0.0.1:{free_port()}"
    pipes = [ctx.Pipe(duplex=False) for _ in range(size)]
    procs = [
        ctx.Process(target=_child, args=(target, r, size, master, arg, pipes[r][1]), daemon=True)
        for r in range(size)
    ]
    for p in procs:
        p.start()
    for _, w in pipes:
        w.close()
    try:
        results: list[bytes | None] = []
        for rank, (r, _) in enumerate(pipes):
            if collect is not None and rank not in collect:
                results.append(None)
                continue
            if not r.poll(timeout):
                raise TimeoutError(f"rank {rank} gave no result within {timeout} s")
            try:
                msg = r.recv_bytes()
            except EOFError:  # it exited without a word
                results.append(None)
                continue
            if msg[:2] != b"ok":
                raise RuntimeError(msg[2:].decode())
            results.append(msg[2:])
        return results
    finally:
        for p in procs:
            p.join(10 if collect is None else 0.1)
            if p.exitcode is None:
                p.kill()
                p.join()
        for r, _ in pipes:
            r.close()
