"""The cost rule: read from the store only when that is expected to beat computing.

One load call serves the whole batch (one `batch_get_into` for every chain), so its fixed cost
is paid once per batch, and it pays only for the blocks the store turns out to hold:

    load the batch's chains (k_1 .. k_n blocks)  iff
        read time per block < compute time per block                          (bandwidth)
        and  read latency < hit fraction * sum(k_i) * (compute - read per block)   (per call)

`compute time per block` is `block_tokens` times what one more computed token costs the
worker, fitted from its own forwards (`ForwardClock`: the slope, not the average, which would
count a forward's fixed cost that a load does not save). The read side is measured from its
own load calls (`ReadClock`): the latency from calls that found nothing, the time per block
from those that did, both smoothed (EWMA) and each observation capped at 4x the estimate, so
that one slow call (the first connection to a peer's segment, a descheduled thread) cannot
switch loads off; they start from the `KVStoreOptions` fields `read_latency_s` and
`read_bytes_per_s`. The hit fraction (`HitRate`: blocks found over blocks asked, smoothed)
says how much of what is asked a call finds: where most prompts are new (the store cannot
hold them), a call mostly costs its latency. `load_pays` and `min_blocks` state the rule for
one chain found whole (docs/kv-store.md).
"""

from __future__ import annotations

import math

__all__ = ["ForwardClock", "HitRate", "LinearClock", "ReadClock", "load_pays", "min_blocks"]


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


class LinearClock:
    """seconds = intercept + slope * x, an exponentially weighted least-squares fit over
    observations (`record(seconds, x)`); until the first one, the guess (`initial_intercept`,
    `initial_slope`); while every x seen is alike, no intercept and the average slope. Used
    for a forward's time against the tokens it computed (`ForwardClock`) and a load call's
    time against the blocks it fetched (`ReadClock`)."""

    __slots__ = ("alpha", "guess", "n", "sx", "sxx", "sxy", "sy")

    def __init__(
        self,
        initial_intercept: float,
        initial_slope: float,
        alpha: float = 0.05,
        *,
        replace_guess: bool = True,
    ) -> None:
        self.alpha = alpha
        self.guess = (initial_intercept, initial_slope)
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = 0.0  # weighted means: x, s, x^2, x*s
        if not replace_guess:
            # The guess counts as the first two observations (at x = 1 and 3) and fades like
            # any other: no single observation (a slow first call) decides alone.
            y1, y3 = initial_intercept + initial_slope, initial_intercept + 3 * initial_slope
            self.n = 2
            self.sx, self.sy, self.sxx, self.sxy = 2.0, (y1 + y3) / 2, 5.0, (y1 + 3 * y3) / 2

    def record(self, seconds: float, x: float) -> None:
        if seconds <= 0 or x < 0:
            return
        a = 1.0 if self.n == 0 else self.alpha
        self.n += 1
        self.sx += a * (x - self.sx)
        self.sy += a * (seconds - self.sy)
        self.sxx += a * (x * x - self.sxx)
        self.sxy += a * (x * seconds - self.sxy)

    def _fit(self) -> tuple[float, float] | None:
        """(intercept, slope), or None while the x seen are too alike to fit both."""
        var = self.sxx - self.sx * self.sx
        if self.n < 2 or var <= 1e-4 * max(1.0, self.sx * self.sx):
            return None
        slope = (self.sxy - self.sx * self.sy) / var
        return self.sy - slope * self.sx, slope

    @property
    def slope(self) -> float:
        if self.n == 0:
            return self.guess[1]
        fit = self._fit()
        if fit is None:
            return self.sy / self.sx if self.sx > 0 else 0.0
        return fit[1]

    @property
    def intercept(self) -> float:
        if self.n == 0:
            return self.guess[0]
        fit = self._fit()
        if fit is None:
            return 0.0 if self.sx > 0 else self.sy
        return fit[0]


class ForwardClock(LinearClock):
    """What one more computed token costs this worker: the slope of its forwards' wall time
    against the tokens they computed (a forward also pays a fixed cost, which a load does not
    save: the average time per token would overstate the gain). Starts at `initial` per token
    and no fixed cost; a fitted slope outside (0, the average] gives the average instead."""

    __slots__ = ()

    def __init__(self, initial: float, alpha: float = 0.05) -> None:
        super().__init__(0.0, initial, alpha)

    def record(self, seconds: float, tokens: float) -> None:
        if tokens > 0:
            super().record(seconds, tokens)

    @property
    def seconds_per_token(self) -> float:
        if self.n == 0:
            return self.guess[1]
        average = self.sy / self.sx
        slope = self.slope
        return slope if 0 < slope <= average else average


class ReadClock:
    """A load call's cost: `latency()` (a call that found nothing) and `per_block()` (each
    block found: transfer, checks, the copy into its slot), exponentially weighted averages
    (`alpha`) starting from the configured values. An observation counts as at most 4x what
    was expected: one slow call decides nothing alone, a real slowdown gets in a few calls
    later."""

    __slots__ = ("_latency", "_per_block", "alpha")

    def __init__(self, latency: float, per_block: float, alpha: float = 0.1) -> None:
        self._latency = latency
        self._per_block = per_block
        self.alpha = alpha

    def record(self, seconds: float, blocks: int) -> None:
        """A call that took `seconds` and found `blocks` blocks."""
        if seconds <= 0 or blocks < 0:
            return
        a = self.alpha
        if blocks == 0:
            seen = min(seconds, 4 * self._latency + 1e-4)
            self._latency += a * (seen - self._latency)
        else:
            each = max(0.0, seconds - self._latency) / blocks
            seen = min(each, 4 * self._per_block + 1e-6)
            self._per_block += a * (seen - self._per_block)

    def latency(self) -> float:
        return self._latency

    def per_block(self) -> float:
        return self._per_block


class HitRate:
    """The fraction of the blocks asked that a load call found, exponentially weighted
    (`alpha`); starts at `initial`."""

    __slots__ = ("alpha", "fraction")

    def __init__(self, initial: float = 0.5, alpha: float = 0.05) -> None:
        self.fraction = initial
        self.alpha = alpha

    def record(self, found: int, asked: int) -> None:
        if asked > 0:
            self.fraction += self.alpha * (found / asked - self.fraction)
