"""`check_batch`: a `PaddleRunner` refuses a batch it cannot run (ValueError) before running
anything: no requests, an empty request, token ids outside the vocabulary, positions past the
model's, prefix-cache slots it does not keep, or a chunk that does not continue what the worker
holds for its request. A chunk that restarts its prompt drops the request's stale state."""

from __future__ import annotations

import numpy as np

from aioprefill.models import PaddleModel
from aioprefill.workers.paddle.attention import KVCache
from aioprefill.workers.prefix_blocks import BatchPlan, BlockStore
from aioprefill.workers.runner import ForwardBatch

__all__ = ["check_batch"]


def check_batch(
    batch: ForwardBatch, spec: PaddleModel, store: BlockStore | None, cache: dict[int, KVCache]
) -> None:
    """Raise ValueError for a batch the runner of `spec` cannot run, its prefix-cache slots
    `store` (None: off) and `cache` the KV state it keeps between chunks (by request id;
    a restarted prompt's entry is dropped here)."""
    if batch.size == 0:
        raise ValueError("empty batch")
    lens = batch.seq_lens()
    if (lens <= 0).any():
        raise ValueError("every request in a batch needs at least one token")
    tokens = batch.tokens
    if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= spec.vocab_size):
        raise ValueError(f"token id out of range [0, {spec.vocab_size})")
    ends = batch.start_pos.astype(np.int64) + lens
    if int(ends.max()) > spec.max_prompt_tokens:
        # max_position_embeddings, or a shorter sliding_window (which is never applied).
        raise ValueError(
            f"position {int(ends.max())} past the model's {spec.max_prompt_tokens} "
            "(max_position_embeddings or sliding_window)"
        )
    plan = BatchPlan.of(batch)
    if plan is not None:
        if store is None:
            raise ValueError("a batch reads or writes prefix-cache slots, but none are kept")
        plan.check(batch, store)
    for i, (rid, start) in enumerate(
        zip(batch.request_ids.tolist(), batch.start_pos.tolist(), strict=True)
    ):
        if start == 0 or (plan is not None and len(plan.reads[i])):
            cache.pop(rid, None)  # a restart of a prompt drops any stale chunks
            continue
        have = cache.get(rid)
        if have is None or have.length != start:
            raise ValueError(
                f"request {rid}: chunk starts at {start}, but this worker holds "
                f"{0 if have is None else have.length} earlier tokens"
            )
