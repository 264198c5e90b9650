"""PaddleGroup between two spawned rank processes over gloo: the collectives the sharded model
uses give the right numbers, and a broken group raises CollectiveError instead of hanging."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import numpy as np
import pytest

from tests.ranks import run_ranks

HERE = "tests.workers.test_collectives"
HUNG = "test_hung_peer_trips_the_timeout"


@pytest.fixture(scope="module", autouse=True)
def hung_peer(request: pytest.FixtureRequest) -> Iterator[Future | None]:
    """The hung-peer group of the last test, started with the module's first test: its
    survivor spends 30 s waiting for gloo's fixed timeout, asleep, and the other tests run
    meanwhile instead of after it. Not started when that test is not selected."""
    if not any(item.name == HUNG for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(1) as pool:  # leaving it waits for the group to end
        yield pool.submit(run_ranks, f"{HERE}:peer_leaves", 2, b"hang", collect=[0])


def ops(rank: int, size: int, master: str, arg: bytes) -> bytes:
    import paddle

    from aioprefill.workers.collectives import PaddleGroup

    group = PaddleGroup(rank, size, master, timeout=60.0)
    total = group.all_reduce(paddle.full([3, 5], float(rank + 1)))
    most = group.all_reduce(paddle.to_tensor([rank * 10 + 1], dtype="int64"), op="max")
    every = group.all_gather(paddle.full([2, 4], float(rank), dtype="float64"))
    group.barrier()
    group.close()
    return msgspec.msgpack.encode(
        [total.numpy().tolist(), most.numpy().tolist(), every.numpy().tolist()]
    )


def test_all_reduce_all_gather_barrier() -> None:
    for raw in run_ranks(f"{HERE}:ops", 2):
        assert raw is not None
        total, most, every = msgspec.msgpack.decode(raw)
        assert np.array_equal(total, np.full((3, 5), 3.0))
        assert most == [11]
        assert np.array_equal(every, np.stack([np.zeros((2, 4)), np.ones((2, 4))]))


def peer_leaves(rank: int, size: int, master: str, arg: bytes) -> bytes:
    """Rank 1 dies (arg=b"die") or stops taking part (b"hang") after one good all_reduce."""
    import paddle

    from aioprefill.workers.collectives import PaddleGroup
    from aioprefill.workers.group import CollectiveError

    group = PaddleGroup(rank, size, master, timeout=60.0)
    x = paddle.ones([1024])
    group.all_reduce(x)
    if rank == 1:
        if arg == b"die":
            os._exit(3)
        time.sleep(3600)
    try:
        group.all_reduce(x)
    except CollectiveError as exc:
        return f"CollectiveError: {exc}".encode()
    return b"no error"


def test_dead_peer_breaks_the_collective() -> None:
    survivor, dead = run_ranks(f"{HERE}:peer_leaves", 2, b"die")
    assert dead is None
    assert survivor is not None and survivor.startswith(b"CollectiveError"), survivor


@pytest.mark.slow
def test_hung_peer_trips_the_timeout(hung_peer: Future) -> None:
    """The survivor of a peer that stopped taking part is released by gloo's 30 s timeout."""
    survivor, _ = hung_peer.result()
    assert survivor is not None and survivor.startswith(b"CollectiveError"), survivor
