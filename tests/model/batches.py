"""Helpers shared by the model tests: small specs, packed batches, cached runners."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import msgspec
import numpy as np

from aioprefill.config import PaddleModel
from aioprefill.workers.runner import ForwardBatch

# Most tests use this: 2 layers, hidden 64, GQA with 2 query heads per KV head, head_dim 16.
SMALL = PaddleModel(
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=4096,
    seed=3,
)


def small(**changes) -> PaddleModel:
    """SMALL with some fields changed."""
    return msgspec.structs.replace(SMALL, **changes)


def make_batch(
    prompts: Sequence[np.ndarray],
    ids: Sequence[int] | None = None,
    starts: Sequence[int] | None = None,
    last: Sequence[bool] | None = None,
) -> ForwardBatch:
    """Pack prompts (or chunks) back to back into a ForwardBatch."""
    n = len(prompts)
    offsets = np.zeros(n + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(p) for p in prompts])
    return ForwardBatch(
        request_ids=np.asarray(range(n) if ids is None else ids, dtype=np.int64),
        offsets=offsets,
        tokens=np.concatenate([np.asarray(p) for p in prompts]).astype(np.int32),
        start_pos=np.asarray([0] * n if starts is None else starts, dtype=np.int32),
        is_last=np.asarray([True] * n if last is None else last, dtype=bool),
    )


def prompts(rng: np.random.Generator, lengths: Sequence[int], vocab: int) -> list[np.ndarray]:
    return [rng.integers(0, vocab, n).astype(np.int32) for n in lengths]


@functools.cache
def runner(spec: PaddleModel):
    """One PaddleRunner per spec for the whole session (building the tiny model takes ~1 s)."""
    from aioprefill.workers.paddle.runner import PaddleRunner

    return PaddleRunner(spec)
