"""Helpers for the prefix-cache model tests: a batch with the engine's read/write plan, every
output option, and the comparison of two forwards' outputs (bitwise or within 1e-5)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from aioprefill.wire import protocol
from aioprefill.workers.runner import ForwardBatch, ForwardOutput

B = 16  # block_tokens in these tests
ALL = (
    protocol.OPT_PROMPT_LOGPROBS
    | protocol.OPT_PROMPT_TOP_K
    | protocol.OPT_EMBED_MEAN
    | protocol.OPT_NORMALIZE
)
LAST = protocol.OPT_PROMPT_LOGPROBS | protocol.OPT_EMBED_LAST
FIELDS = (
    "request_ids",
    "tokens",
    "logprobs",
    "top_k_ids",
    "top_k_logprobs",
    "prompt_logprobs",
    "prompt_top_k_ids",
    "prompt_top_k_logprobs",
    "embeddings",
    "label_logprobs",
)
_TOP_K_VALUES = {"top_k_ids": "top_k_logprobs", "prompt_top_k_ids": "prompt_top_k_logprobs"}
LABELS = (0, 7, 300, 7)  # label token ids (a repeat included) the tests ask for


def _int32(parts: Sequence[Sequence[int]]) -> np.ndarray:
    return np.asarray([s for p in parts for s in p], dtype=np.int32)


def _offsets(parts: Sequence[Sequence[int]]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int32)


def planned(
    batch: ForwardBatch,
    reads: Sequence[Sequence[int]] | None = None,
    writes: Sequence[Sequence[int]] | None = None,
    first: Sequence[int] | None = None,
) -> ForwardBatch:
    """`batch` with the engine's plan: per request the slots it reads, the slots it writes and
    the prompt block its first write slot gets."""
    n = batch.size
    reads = reads or [[]] * n
    writes = writes or [[]] * n
    return dataclasses.replace(
        batch,
        read_offsets=_offsets(reads),
        read_slots=_int32(reads),
        write_offsets=_offsets(writes),
        write_slots=_int32(writes),
        write_first=np.asarray(first or [0] * n, dtype=np.int32),
    )


def with_options(
    batch: ForwardBatch,
    options: Sequence[int],
    top_k: Sequence[int],
    kv_names=(),
    labels: Sequence[int] | None = None,
) -> ForwardBatch:
    """`batch` with output options; `labels`: the same label token ids for every request."""
    n = batch.size
    label_fields = {}
    if labels is not None:
        label_fields = {
            "label_offsets": (np.arange(n + 1) * len(labels)).astype(np.int32),
            "label_ids": np.tile(np.asarray(labels, dtype=np.int32), n),
        }
    return dataclasses.replace(
        batch,
        options=np.asarray(options, dtype=np.uint8),
        top_k=np.asarray(top_k, dtype=np.int32),
        kv_names=tuple(kv_names),
        **label_fields,
    )


def check_same(
    got: ForwardOutput,
    want: ForwardOutput,
    *,
    bitwise: bool,
    what: str = "",
    relative: bool = False,
    tol: float = 1e-5,
    ties: bool = False,
) -> None:
    """Every output field equal (ids always; floats bitwise, or within `tol`: of the value's
    magnitude when above 1 with `relative`). `ties`: top-k ids may differ where `want`'s value
    there is within 2 `tol` of a neighbouring rank's (two near ties in either order)."""
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape, f"{what} {name}: shape {a.shape} vs {b.shape}"
        if ties and name in _TOP_K_VALUES:
            vals = getattr(want, _TOP_K_VALUES[name]).astype(np.float64)
            for m in np.flatnonzero(a != b).tolist():
                near = np.abs(vals[max(m - 1, 0) : m + 2] - vals[m])
                assert np.sort(near)[1] <= 2 * tol * max(1.0, abs(vals[m])), f"{what} {name}"
        elif bitwise or a.dtype.kind in "iu":
            assert np.array_equal(a, b), f"{what} {name} differs"
        else:
            scale = np.maximum(1.0, np.abs(b)) if relative else 1.0
            diff = (np.abs(a.astype(np.float64) - b) / scale).max(initial=0.0)
            assert diff <= tol, f"{what} {name}: |d| = {diff:.2e}"


def concat_outputs(outs: Sequence[ForwardOutput]) -> ForwardOutput:
    """A chunked prompt's forwards as one output (the engine's assembly, for one request)."""
    return ForwardOutput(
        **{
            name: np.concatenate([getattr(o, name) for o in outs])
            if name != "embeddings"
            else next(o.embeddings for o in outs if o.embeddings.size or o is outs[-1])
            for name in FIELDS
        }
    )
