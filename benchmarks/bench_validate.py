"""What `prefill()`'s prompt validation costs, per call, on the engine's event loop.

Rows: a list of plain ints of 1, 16, 64, 512 and 8192 ids; the same as an int32 ndarray; and
the refusals that must stay cheap: a 10-million-id list over `max_prompt_tokens` (refused by
its length before any element is converted), a list with a bool at its end, an id beyond
int64. Each figure is the median of 7 repeats of a timed loop (`timeit`), in microseconds per
call, everything in one run so the rows compare.

    python benchmarks/bench_validate.py
"""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np

from aioprefill.engine.validate import validate_prompt
from aioprefill.errors import InvalidRequest

VOCAB = 32000


def per_call_us(fn: Callable[[], Any], number: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=7)) / number * 1e6


def refused(tokens: Any, max_prompt_tokens: int) -> Callable[[], None]:
    def call() -> None:
        try:
            validate_prompt(tokens, VOCAB, max_prompt_tokens)
        except InvalidRequest:
            return
        raise AssertionError("accepted")

    return call


def main() -> None:
    rows: list[tuple[str, float]] = []
    for n in (1, 16, 64, 512, 8192):
        ids = [(i * 7919) % VOCAB for i in range(n)]
        number = max(10, 200_000 // n)
        rows.append(
            (
                f"list of {n} ints",
                per_call_us(lambda ids=ids: validate_prompt(ids, VOCAB, 1 << 20), number),
            )
        )
        arr = np.asarray(ids, dtype=np.int32)
        rows.append(
            (
                f"int32 ndarray of {n}",
                per_call_us(lambda arr=arr: validate_prompt(arr, VOCAB, 1 << 20), number),
            )
        )
    huge = [1] * 10_000_000
    rows.append(
        (
            "refuse: 10M-id list over max_prompt_tokens=32768",
            per_call_us(refused(huge, 32768), 1000),
        )
    )
    rows.append(
        (
            "refuse: 512 ints, a bool at the end",
            per_call_us(refused([5] * 511 + [True], 1 << 20), 2000),
        )
    )
    rows.append(
        (
            "refuse: 512 ints, 2**63 at the end",
            per_call_us(refused([5] * 511 + [2**63], 1 << 20), 2000),
        )
    )
    width = max(len(name) for name, _ in rows)
    print(f"{'prompt':<{width}}  us/call")
    for name, us in rows:
        print(f"{name:<{width}}  {us:8.2f}")


if __name__ == "__main__":
    main()
