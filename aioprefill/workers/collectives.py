"""`PaddleGroup`: the collectives a rank of a Paddle model group runs, through Paddle's own
distributed runtime (gloo on CPU).

Set-up, as measured on the 2-vCPU build machines with paddle 3.3.1: rank 0 starts Paddle's TCP
store on the group's master endpoint, every rank then builds a `ProcessGroupGloo` on it. We call
`core.TCPStore` / `ProcessGroupGloo.create` directly rather than `init_parallel_env()`: the latter
reads its rank and endpoint from environment variables once per process and keeps one global
default group, and its CPU fallback path starts a `multiprocessing.Manager` (a fork) on rank 0.
Two details: the process group reads `PADDLE_TRAINER_ID` from the environment, so it is set
first; and a TCP-store client that finds no server retries only every 3 s, so ranks > 0 wait for
rank 0 to listen before they connect (group ready ~0.3 s after import instead of ~3.3 s).

Gloo on CPU implements all_reduce, all_gather, broadcast and point-to-point, but not all_to_all
or reduce_scatter; the MoE layers exchange tokens with all_gather + all_reduce.

Failure: a peer that dies closes its sockets, and the collective raises at once; a peer that
hangs trips gloo's own per-operation timeout (30 s, fixed by paddle's ProcessGroupGloo). Both
become `CollectiveError`; the rank then exits and the engine restarts the group.

Only worker processes (and model-level tests) import this module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import paddle
from paddle.base import core

from aioprefill.workers.group import CollectiveError, connect_when_listening, split_endpoint

__all__ = ["PaddleGroup"]


class PaddleGroup:
    """This rank's process group: `rank` of `size`, meeting at `master` ("host:port")."""

    _store: Any = None
    _pg: Any = None

    def __init__(self, rank: int, size: int, master: str, timeout: float = 60.0) -> None:
        if not 0 <= rank < size or size < 2:
            raise ValueError(f"rank {rank} of a group of {size}: need 0 <= rank < size, size >= 2")
        # CPU only (gloo): `PaddleRunner` checks the device once it has picked it (paddle's
        # default device before that is a GPU on a CUDA build, even for a CPU model).
        self.rank, self.size = rank, size
        host, port = split_endpoint(master)
        os.environ["PADDLE_TRAINER_ID"] = str(rank)
        os.environ["PADDLE_TRAINERS_NUM"] = str(size)
        if rank > 0:
            connect_when_listening(master, timeout).close()
        try:
            # The store's timeout (whole seconds) bounds the rendezvous: a rank that never comes.
            self._store = core.TCPStore(host, port, rank == 0, size, max(1, int(timeout)))
            self._pg = core.ProcessGroupGloo.create(self._store, rank, size, 0)
        except RuntimeError as exc:
            raise CollectiveError(f"rank {rank} of {size}: group set-up failed: {exc}") from exc

    def _run(self, what: str, task_fn: Callable[[], Any]) -> None:
        try:
            task_fn().wait()
        except RuntimeError as exc:
            raise CollectiveError(f"rank {self.rank} of {self.size}: {what} failed: {exc}") from exc

    def all_reduce(self, x: paddle.Tensor, op: str = "sum") -> paddle.Tensor:
        """Reduce `x` over the group, in place; returns `x`. `op`: "sum" or "max"."""
        reduce_op = core.ReduceOp.SUM if op == "sum" else core.ReduceOp.MAX
        self._run("all_reduce", lambda: self._pg.all_reduce(x, reduce_op, True))
        return x

    def all_gather(self, x: paddle.Tensor) -> paddle.Tensor:
        """Every rank's `x` (equal shapes), stacked along a new leading axis of size `size`."""
        out = paddle.empty([self.size * x.shape[0], *x.shape[1:]], dtype=x.dtype)
        self._run("all_gather", lambda: self._pg.all_gather_into_tensor(out, x, True))
        return out.reshape([self.size, *x.shape])

    def barrier(self) -> None:
        self._run("barrier", lambda: self._pg.barrier())

    def close(self) -> None:
        """Drop the process group and the store (their sockets close with them)."""
        self._pg = self._store = None
