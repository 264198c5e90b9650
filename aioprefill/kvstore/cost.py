"""The cost rule: read a chain from the store only when that is cheaper than computing it.

    load k blocks  iff  read_latency_s + k * value_bytes / read_bytes_per_s
                        < k * block_tokens * seconds_per_token

`read_bytes_per_s` and `read_latency_s` are `KVStoreOptions` fields (defaults measured on
loopback TCP by benchmarks/bench_kvstore.py: docs/kv-store.md); `seconds_per_token` is the
worker's own forward time per computed token, measured as it runs (`ForwardClock`). Blocks
per chain: the latency is paid once per chain (one `batch_get_into`), so short chains are the
ones that may not pay; `min_blocks` says from how many on it does.
"""

from __future__ import annotations

import math

__all__ = ["ForwardClock", "load_pays", "min_blocks"]


def load_pays(
    num_blocks: int,
    value_bytes: int,
    block_tokens: int,
    seconds_per_token: float,
    read_bytes_per_s: float,
    read_latency_s: float,
) -> bool:
    """True when reading `num_blocks` blocks costs less than computing their tokens."""
    if num_blocks <= 0:
        return False
    read = read_latency_s + num_blocks * value_bytes / read_bytes_per_s
    return read < num_blocks * block_tokens * seconds_per_token


def min_blocks(
    value_bytes: int,
    block_tokens: int,
    seconds_per_token: float,
    read_bytes_per_s: float,
    read_latency_s: float,
) -> int | None:
    """The shortest chain worth reading (None: no chain ever pays: reading a block's bytes
    takes longer than computing its tokens)."""
    gain = block_tokens * seconds_per_token - value_bytes / read_bytes_per_s
    if gain <= 0:
        return None
    return max(1, math.floor(read_latency_s / gain) + 1)


class ForwardClock:
    """Seconds per computed token, an exponential average over the worker's forwards (a
    forward's wall time over the tokens it computed). Until the first forward, `initial`."""

    __slots__ = ("alpha", "seconds_per_token")

    def __init__(self, initial: float, alpha: float = 0.2) -> None:
        self.seconds_per_token = initial
        self.alpha = alpha

    def record(self, seconds: float, tokens: int) -> None:
        if tokens > 0 and seconds > 0:
            x = seconds / tokens
            self.seconds_per_token += self.alpha * (x - self.seconds_per_token)
