"""The cost rule: read a chain from the store only when that is cheaper than computing it.

    load k blocks  iff  read_latency_s + k * value_bytes / read_bytes_per_s
                        < k * block_tokens * seconds_per_token

`read_bytes_per_s` and `read_latency_s` are `KVStoreOptions` fields (defaults set against
loopback TCP as benchmarks/bench_kvstore.py measures it: docs/kv-store.md);
`seconds_per_token` is what one more computed token costs the worker, fitted from its own
forwards as it runs (`ForwardClock`). Blocks
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
    """What one more computed token costs this worker: the slope of its forwards' wall time
    against the tokens they computed, an exponentially weighted least-squares fit over its
    forwards (a forward also pays a fixed cost, which a load does not save, so the average
    time per token would overstate the gain). Until the forwards varied enough in size to
    fit a slope (or when the fit says nothing sensible), the average per token; until the
    first forward, `initial`."""

    __slots__ = ("alpha", "n", "sx", "sxx", "sxy", "sy")

    def __init__(self, initial: float, alpha: float = 0.05) -> None:
        self.alpha = alpha
        self.n = 0
        # Weighted means of tokens, seconds, tokens^2, tokens*seconds (seeded by `initial`).
        self.sx, self.sy = 1.0, initial
        self.sxx, self.sxy = 1.0, initial

    @property
    def seconds_per_token(self) -> float:
        average = self.sy / self.sx if self.sx > 0 else 0.0
        var = self.sxx - self.sx * self.sx
        if self.n < 8 or var <= 0.01 * self.sx * self.sx:  # sizes too alike to fit a slope
            return average
        slope = (self.sxy - self.sx * self.sy) / var
        return slope if 0 < slope <= average else average

    def record(self, seconds: float, tokens: int) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        a = 1.0 if self.n == 0 else self.alpha
        self.n += 1
        self.sx += a * (tokens - self.sx)
        self.sy += a * (seconds - self.sy)
        self.sxx += a * (tokens * tokens - self.sxx)
        self.sxy += a * (tokens * seconds - self.sxy)
