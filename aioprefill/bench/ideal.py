"""The yardstick for every policy: the same arrivals through an ideal, zero-overhead engine.

A point's requests (their arrival times and prompt lengths, as the engine saw them) are
replayed through the cost model (`costmodel.CostModel`, the SimModel's own or fitted to this
run) by a discrete-event simulation with no overhead at all: no wake-ups, no transport, no
Python, forwards exactly as long as the cost model says. Two ideal schedulers:

- batching (the yardstick): the moment a worker is free it starts a forward on everything
  waiting, first come first served within `max_batch_tokens` / `max_batch_size`; a request
  arriving at an idle worker starts at once. Efficiency = ideal TTFT / measured TTFT (1.00: as
  good as a zero-overhead engine; lower: what overhead and scheduling cost).
- one at a time (eager's rule without overhead): the same, one request per forward.

With a prefix cache, each request's cached tokens (as the engine reported them) are free: a
request costs its uncached tokens, in the budget and in the forward (`uncached_cost`).

Their ratio is what batching can buy on this model and hardware, free of run-to-run noise:
on a GPU-class cost (a large fixed cost per forward) it halves TTFT under load; on the tiny
CPU model (a forward is mostly per-token work) it buys little, and a target set for the first
is meaningless for the second.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from aioprefill.bench.costmodel import CostModel
from aioprefill.bench.metrics import Records

__all__ = ["ideal_point", "replay", "uncached_cost"]


def uncached_cost(length: int, cached: int) -> tuple[int, int]:
    """(tokens, attention) a prompt of `length` tokens whose first `cached` are cached adds to
    a forward: its uncached tokens, and `length^2 - cached^2` in place of `len^2` (its new
    queries attend over every position before them)."""
    return length - cached, length * length - cached * cached


def replay(
    arrivals_s: np.ndarray,
    lengths: np.ndarray,
    model: CostModel,
    *,
    num_workers: int,
    max_batch_tokens: int,
    max_batch_size: int,
    cached: np.ndarray | None = None,
) -> np.ndarray:
    """TTFT in seconds of each request (arrival order) under the zero-overhead scheduler.

    `max_batch_size=1` gives the one-at-a-time ideal. A prompt over `max_batch_tokens` runs
    alone, unchunked (chunking only adds forwards). `cached`: tokens of each prompt that a
    prefix cache holds (they cost nothing).
    """
    order = np.argsort(arrivals_s, kind="stable")
    arr = arrivals_s[order].astype(np.float64)
    lens = lengths[order].astype(np.int64)
    hits = np.zeros_like(lens) if cached is None else cached[order].astype(np.int64)
    n = len(arr)
    ttft = np.empty(n, dtype=np.float64)
    free = [float(arr[0]) if n else 0.0] * num_workers  # when each worker is next free
    waiting: deque[int] = deque()
    i = 0
    while i < n or waiting:
        w = min(range(num_workers), key=free.__getitem__)
        first = waiting[0] if waiting else i
        t = max(free[w], float(arr[first]))  # it starts when free and something has arrived
        while i < n and arr[i] <= t:
            waiting.append(i)
            i += 1
        batch: list[int] = []
        tokens = sq = 0
        while waiting and len(batch) < max_batch_size and arr[waiting[0]] <= t:
            k, k_sq = uncached_cost(int(lens[waiting[0]]), int(hits[waiting[0]]))
            if batch and tokens + k > max_batch_tokens:
                break
            batch.append(waiting.popleft())
            tokens, sq = tokens + k, sq + k_sq
        end = t + model.seconds(tokens, sq)
        free[w] = end
        for j in batch:
            ttft[j] = end - arr[j]
    out = np.empty(n, dtype=np.float64)
    out[order] = ttft
    return out


def _mean_p99_ms(seconds: np.ndarray) -> dict[str, float]:
    return {"mean": float(seconds.mean() * 1e3), "p99": float(np.percentile(seconds, 99) * 1e3)}


def ideal_point(
    rec: Records,
    model: CostModel,
    *,
    num_workers: int,
    max_batch_tokens: int,
    max_batch_size: int,
) -> dict[str, Any] | None:
    """The ideal engines' TTFT on this point's arrivals, and the point's efficiency against
    the batching ideal (None for an empty point)."""
    if len(rec) == 0:
        return None
    arrivals = (rec.submitted_ns - rec.submitted_ns.min()) / 1e9

    def run(size: int) -> np.ndarray:
        return replay(
            arrivals,
            rec.prompt_len,
            model,
            num_workers=num_workers,
            max_batch_tokens=max_batch_tokens,
            max_batch_size=size,
            cached=rec.cached_tokens,
        )

    batched, single = run(max_batch_size), run(1)
    ideal, measured = (
        _mean_p99_ms(batched),
        _mean_p99_ms((rec.finished_ns - rec.submitted_ns) / 1e9),
    )
    return {
        "ttft_ms": ideal,
        "single_ttft_ms": _mean_p99_ms(single),
        "efficiency": {k: ideal[k] / measured[k] if measured[k] > 0 else None for k in ideal},
    }
