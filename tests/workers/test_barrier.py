"""SocketBarrier between three spawned rank processes (no Paddle): nobody leaves a step before
the slowest rank arrived, and a dead or absent peer raises CollectiveError."""

from __future__ import annotations

import os
import time

import msgspec

from tests.ranks import run_ranks

HERE = "tests.workers.test_barrier"


def steps(rank: int, size: int, master: str, arg: bytes) -> bytes:
    from aioprefill.workers.barrier import SocketBarrier

    barrier = SocketBarrier(rank, size, master, timeout=60.0)
    marks = []
    for step in range(3):
        time.sleep(0.05 * ((rank + step) % size))  # a different rank is slowest each step
        arrived = time.monotonic_ns()
        barrier.wait()
        marks.append((arrived, time.monotonic_ns()))
    barrier.close()
    return msgspec.msgpack.encode(marks)


def test_no_rank_leaves_before_the_slowest_arrived() -> None:
    marks = [msgspec.msgpack.decode(r) for r in run_ranks(f"{HERE}:steps", 3, timeout=60)]
    for step in range(3):
        last_arrival = max(m[step][0] for m in marks)
        first_departure = min(m[step][1] for m in marks)
        assert first_departure >= last_arrival, f"step {step}"


def leaves(rank: int, size: int, master: str, arg: bytes) -> bytes:
    """The last rank dies (arg=b"die") or stops coming (b"hang") after one good step."""
    from aioprefill.workers.barrier import SocketBarrier
    from aioprefill.workers.group import CollectiveError

    barrier = SocketBarrier(rank, size, master, timeout=1.0 if arg == b"hang" else 60.0)
    barrier.wait()
    if rank == size - 1:
        if arg == b"die":
            os._exit(3)
        time.sleep(3600)
    try:
        barrier.wait()
    except CollectiveError as exc:
        return f"CollectiveError: {exc}".encode()
    return b"no error"


def test_dead_peer_breaks_the_barrier_for_everyone() -> None:
    *survivors, dead = run_ranks(f"{HERE}:leaves", 3, b"die", timeout=60)
    assert dead is None
    for got in survivors:
        assert got is not None and got.startswith(b"CollectiveError"), got


def test_absent_peer_trips_the_timeout() -> None:
    *survivors, _ = run_ranks(f"{HERE}:leaves", 3, b"hang", timeout=60, collect=[0, 1])
    for got in survivors:
        assert got is not None and got.startswith(b"CollectiveError"), got
