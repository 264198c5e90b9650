"""Prompt validation: everything `engine.prefill()` refuses, refused before anything is queued.

Cheap checks run first: a prompt's length is read with `len()` before a single element is
converted, so a ten-million-id list is refused in O(1) instead of stalling the loop while NumPy
converts it. A list whose elements are all plain ints (the usual case) is converted in one NumPy
call; anything else (bools, None, floats, nested lists, ints beyond int64) takes a slow scan
that names the first bad element by index and value.
"""

from __future__ import annotations

import array as _array
import math
import sys
from typing import Any

import numpy as np

from aioprefill.errors import InvalidRequest, InvalidRequestType
from aioprefill.sched.prefix.hashing import check_salt

__all__ = ["validate_controls", "validate_prompt"]

# Up to this length a list is range-checked and packed without NumPy (little-endian hosts: the
# wire is "<i4", array.array is native).
_SHORT = 64 if sys.byteorder == "little" else 0
# Element types that convert exactly to int64 (bool is deliberately absent: True is not an id).
_INT_TYPES = frozenset(
    {int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64}
)


def validate_prompt(tokens: Any, vocab_size: int, max_prompt_tokens: int) -> bytes:
    """Return the prompt as int32 little-endian bytes, or raise `InvalidRequest` saying why.

    Accepts a list/tuple of ints or a 1-D integer ndarray. The bytes are a copy, decoupled
    from the caller's buffer (which may change once `prefill()` yields), and are what the
    wire carries, so nothing is converted again on the dispatch path.
    """
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            hint = ": pass ids[0] for a batch of one" if tokens.shape[:1] == (1,) else ""
            raise InvalidRequest(f"prompt must be 1-D, got an array of shape {tokens.shape}{hint}")
        if tokens.dtype.kind not in "iu":  # kind "b" (bool) is refused here too
            raise InvalidRequestType(f"prompt ids must be integers, got dtype {tokens.dtype}")
        _check_length(len(tokens), max_prompt_tokens)
        array = tokens
    elif isinstance(tokens, (list, tuple)):
        _check_length(len(tokens), max_prompt_tokens)  # before converting anything
        if not _INT_TYPES.issuperset(map(type, tokens)):
            _refuse_element_type(tokens)  # raises, unless every element is an int subclass
        if len(tokens) <= _SHORT:
            # Builtin min/max and array.array beat NumPy's fixed per-call costs here, and an
            # id beyond int64 is refused by the range check before anything converts it.
            low, high = min(tokens), max(tokens)
            if low < 0 or high >= vocab_size:
                i = tokens.index(low if low < 0 else high)
                raise InvalidRequest(_range_message(i, int(tokens[i]), vocab_size))
            return _array.array("i", tokens).tobytes()
        try:
            array = np.frombuffer(_array.array("q", tokens), dtype=np.int64)
        except OverflowError:  # an id beyond int64: out of any vocabulary
            i, bad = _first_out_of_range(tokens, vocab_size)
            raise InvalidRequest(_range_message(i, bad, vocab_size)) from None
    else:
        raise InvalidRequestType(
            f"prompt must be a list of ints or a 1-D integer array, got {type(tokens).__name__}"
        )
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        i = int(np.argmin(array)) if low < 0 else int(np.argmax(array))
        raise InvalidRequest(_range_message(i, int(array[i]), vocab_size))
    return array.astype("<i4").tobytes()


def _check_length(n: int, max_prompt_tokens: int) -> None:
    if n == 0:
        raise InvalidRequest("prompt is empty")
    if n > max_prompt_tokens:
        raise InvalidRequest(
            f"prompt has {n} tokens, more than max_prompt_tokens={max_prompt_tokens}"
        )


def _refuse_element_type(tokens: list[Any] | tuple[Any, ...]) -> None:
    """Raise for the first element that is not an integer id (bools included)."""
    for i, t in enumerate(tokens):
        if isinstance(t, (bool, np.bool_)):
            raise InvalidRequestType(f"prompt ids must be ints, got bool {t!r} at index {i}")
        if isinstance(t, (list, tuple, np.ndarray)):
            raise InvalidRequest(
                f"prompt must be a flat sequence of ids, got a {type(t).__name__} at index {i}"
            )
        if not isinstance(t, (int, np.integer)):
            raise InvalidRequestType(
                f"prompt ids must be ints, got {type(t).__name__} {t!r} at index {i}"
            )


def _first_out_of_range(tokens: list[Any] | tuple[Any, ...], vocab_size: int) -> tuple[int, int]:
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            return i, int(t)
    raise AssertionError("unreachable: a prompt that overflowed int64 has an id out of range")


def _range_message(index: int, value: int, vocab_size: int) -> str:
    if value < 0:
        return f"prompt has a negative id ({value}) at index {index}"
    return (
        f"prompt has id {value} at index {index}, outside the vocabulary (vocab_size={vocab_size})"
    )


def validate_controls(deadline_s: Any, request_id: Any, cache_salt: Any = None) -> None:
    """Refuse a `deadline_s` that is not a finite number >= 0, a `request_id` that is
    neither a str nor an int (it is shown in errors and logs), and a `cache_salt` that is not
    None or a non-empty str of at most 256 characters."""
    if cache_salt is not None:
        check_salt(cache_salt)
    if deadline_s is not None and (
        isinstance(deadline_s, bool)
        or not isinstance(deadline_s, (int, float))
        or not math.isfinite(deadline_s)
        or deadline_s < 0
    ):
        raise InvalidRequest(
            f"deadline_s must be a finite number of seconds >= 0, got {deadline_s!r}"
        )
    if request_id is not None and (
        isinstance(request_id, bool) or not isinstance(request_id, (str, int))
    ):
        raise InvalidRequestType(f"request_id must be a str or an int, got {request_id!r}")
