"""Prompt validation: what is refused, with which error, naming which element."""

from __future__ import annotations

import numpy as np
import pytest

from aioprefill import InvalidRequest, InvalidRequestType
from aioprefill.engine.validate import validate_prompt

VOCAB = 32000


def wire(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype="<i4").tobytes()


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 1000])
@pytest.mark.parametrize("kind", ["list", "tuple", "int64", "uint16", "numpy scalars"])
def test_good_prompts_become_int32_wire_bytes(n, kind):
    ids = [(i * 7919) % VOCAB for i in range(n)]
    ids[0] = VOCAB - 1
    tokens = {
        "list": ids,
        "tuple": tuple(ids),
        "int64": np.array(ids, dtype=np.int64),
        "uint16": np.array(ids, dtype=np.uint16),
        "numpy scalars": [np.int64(t) for t in ids],
    }[kind]
    assert validate_prompt(tokens, VOCAB, 1000) == wire(ids)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([1, True], r"got bool True at index 1"),
        ([True, False], r"got bool True at index 0"),
        ([5] * 100 + [False], r"got bool False at index 100"),
        ([3, np.bool_(True)], r"got bool np.True_ at index 1"),
        (np.array([True, False]), r"dtype bool"),
        ([1, None], r"got NoneType None at index 1"),
        ([1, 2, 1.5], r"got float 1.5 at index 2"),
        (["7"], r"got str '7' at index 0"),
    ],
)
def test_non_int_elements_are_refused_naming_index_and_value(bad, message):
    with pytest.raises(InvalidRequestType, match=message) as info:
        validate_prompt(bad, VOCAB, 1000)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([-1, 2**63], r"negative id \(-1\) at index 0"),
        ([1, 2**63], r"id 9223372036854775808 at index 1, outside the vocabulary"),
        ([1] * 100 + [2**63], r"id 9223372036854775808 at index 100"),
        ([1] * 100 + [-(2**70)], r"negative id \(-1180591620717411303424\) at index 100"),
        ([4, VOCAB], rf"id {VOCAB} at index 1, outside the vocabulary \(vocab_size={VOCAB}\)"),
        (np.array([4, 5, -3]), r"negative id \(-3\) at index 2"),
        ([[1, 2], [3, 4]], r"flat sequence of ids, got a list at index 0"),
        (np.zeros((2, 2), dtype=np.int32), r"must be 1-D"),
        ([], r"empty"),
    ],
)
def test_out_of_range_and_misshapen_prompts_name_the_element(bad, message):
    with pytest.raises(InvalidRequest, match=message):
        validate_prompt(bad, VOCAB, 1000)


def test_length_is_checked_before_any_element_is_looked_at():
    """A huge prompt is refused by its length alone: its (bad) elements are never converted.

    Every element here would fail conversion; the length message proves none was looked at.
    The speed this buys is measured in benchmarks/bench_validate.py, not asserted here.
    """

    class Poison:
        def __index__(self) -> int:
            raise AssertionError("an element was converted")

    huge = [Poison()] * 10_000_000
    with pytest.raises(InvalidRequest, match=r"10000000 tokens, more than max_prompt_tokens=100"):
        validate_prompt(huge, VOCAB, 100)
    with pytest.raises(InvalidRequest, match=r"more than max_prompt_tokens=100"):
        validate_prompt(np.zeros(101, dtype=np.int32), VOCAB, 100)


@pytest.mark.parametrize("bad", ["tokens", None, {1: 2}, range(3), b"\x01"])
def test_other_types_are_refused(bad):
    with pytest.raises(InvalidRequestType, match="list of ints or a 1-D integer array"):
        validate_prompt(bad, VOCAB, 1000)
