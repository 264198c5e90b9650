"""Forming one expert-parallel step: the pending work split across the EP ranks. Pure.

Expert-parallel ranks run different batches but step together: each MoE layer exchanges tokens
between them, so every rank must run every step, and a rank with no work gets an empty batch
(only when a peer got work: with nothing pending, no step at all). `split_step` decides who
runs what in the next step: late binding (a request goes to whichever rank has room when the
step forms) and balance by tokens (the step lasts as long as its fullest rank), within the
usual batch budgets, first come first served.
"""

from __future__ import annotations

from collections import deque

from aioprefill.batching import Budget, Chunk, Request

__all__ = ["split_step"]


def split_step(pending: deque[Request], num_ranks: int, budget: Budget) -> list[list[Chunk]]:
    """Remove and return each rank's chunks for the next step.

    Each request goes to the rank it is pinned to (a chunked prompt's KV cache lives there),
    else to the rank with the fewest tokens so far that has room for it. A long prompt (over
    `max_batch_tokens`, chunking on) sends one chunk per step, as large as its rank has room
    for, at most one long prompt per rank. The first short unpinned request that no rank has
    room for ends the step, so no request overtakes an earlier one of its size class. Skips
    (and drops) cancelled requests and skips those whose previous chunk still runs. Requests
    whose last chunk is taken leave `pending`; the others keep their place. Changes no
    request: the caller marks the chunks sent once they are.
    """
    max_tokens, max_size = budget.max_batch_tokens, budget.max_batch_size
    long_threshold = max_tokens if budget.chunked else 1 << 62
    loads = [0] * num_ranks
    has_long = [False] * num_ranks
    steps: list[list[Chunk]] = [[] for _ in range(num_ranks)]
    kept: list[Request] = []
    everyone = range(num_ranks)
    popleft = pending.popleft
    while pending:
        req = popleft()
        if req.cancelled:
            continue
        if req.chunk_in_flight:
            kept.append(req)
            continue
        is_long = req.num_tokens > long_threshold
        remaining = req.num_tokens - req.next_pos
        ranks = (req.worker,) if 0 <= req.worker < num_ranks else everyone
        placed = False
        for r in sorted(ranks, key=loads.__getitem__):
            if len(steps[r]) >= max_size:
                continue
            room = max_tokens - loads[r]
            if is_long:
                if has_long[r] or room <= 0:
                    continue
                size = min(remaining, room)
                has_long[r] = True
            elif remaining <= room:
                size = remaining
            else:
                continue
            steps[r].append(Chunk(req, req.next_pos, req.next_pos + size))
            loads[r] += size
            if size < remaining:
                kept.append(req)  # more chunks to come: it keeps its place
            placed = True
            break
        if not placed:
            kept.append(req)
            if not is_long and ranks is everyone:
                break  # FCFS: nothing behind it may take its place
    if kept:
        pending.extendleft(reversed(kept))
    return steps
