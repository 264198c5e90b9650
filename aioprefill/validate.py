"""Prompt validation: everything `engine.prefill()` refuses, refused before anything is queued."""

from __future__ import annotations

from typing import Any

import numpy as np

from aioprefill.errors import InvalidRequest, InvalidRequestType

__all__ = ["validate_prompt"]


def validate_prompt(tokens: Any, vocab_size: int, max_prompt_tokens: int) -> bytes:
    """Return the prompt as int32 little-endian bytes, or raise `InvalidRequest` saying why.

    Accepts a list/tuple of ints or a 1-D integer ndarray. The bytes are a copy, decoupled
    from the caller's buffer (which may change once `prefill()` yields), and are what the
    wire carries, so nothing is converted again on the dispatch path.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise InvalidRequest(f"prompt must be 1-D, got an array of shape {tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise InvalidRequestType(f"prompt ids must be integers, got dtype {tokens.dtype}")
        array = tokens
    elif isinstance(tokens, (list, tuple)):
        try:
            array = np.asarray(tokens)
        except (ValueError, OverflowError) as exc:  # ragged nesting, ints beyond int64
            raise InvalidRequest(f"prompt is not a flat sequence of ids: {exc}") from None
        if array.ndim != 1 and len(tokens):
            raise InvalidRequest(f"prompt must be a flat sequence of ids, got shape {array.shape}")
        if len(tokens) and array.dtype.kind not in "iu":
            bad = next(
                (t for t in tokens if not isinstance(t, (int, np.integer)) or isinstance(t, bool)),
                None,
            )
            shown = f"{type(bad).__name__} {bad!r}" if bad is not None else f"dtype {array.dtype}"
            raise InvalidRequestType(f"prompt ids must be ints, got {shown}")
    else:
        raise InvalidRequestType(
            f"prompt must be a list of ints or a 1-D integer array, got {type(tokens).__name__}"
        )
    n = len(array)
    if n == 0:
        raise InvalidRequest("prompt is empty")
    if n > max_prompt_tokens:
        raise InvalidRequest(
            f"prompt has {n} tokens, more than max_prompt_tokens={max_prompt_tokens}"
        )
    low, high = int(array.min()), int(array.max())
    if low < 0:
        raise InvalidRequest(f"prompt has a negative id ({low}) at index {int(np.argmin(array))}")
    if high >= vocab_size:
        raise InvalidRequest(
            f"prompt has id {high} at index {int(np.argmax(array))}, outside the vocabulary "
            f"(vocab_size={vocab_size})"
        )
    return array.astype("<i4").tobytes()
