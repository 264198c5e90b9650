"""Open-loop workloads: when each request arrives and how long its prompt is.

Arrivals are a renewal process with gamma-distributed gaps, as in vLLM's `bench serve`: shape
`burstiness` (1 = Poisson; below 1 burstier, above 1 more regular) and mean gap `1/rate`.
Prompt lengths come from `fixed`, `uniform` or `lognormal`, or from a trace (`traces.py`).
Everything is drawn from a seeded `numpy.random.Generator`, so every policy sees the same
schedule and the same token ids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["LengthSpec", "RateSpec", "Schedule", "make_prompts", "make_schedule", "parse_rates"]


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """A prompt-length distribution: `fixed:N`, `uniform:LO:HI` or `lognormal:MEDIAN:SIGMA`."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        parts = text.strip().lower().split(":")
        if len(parts) == 1 and parts[0].isdigit():
            parts = ["fixed", parts[0]]
        kind, args = parts[0], parts[1:]
        want = {"fixed": 1, "uniform": 2, "lognormal": 2}
        if kind not in want:
            raise ValueError(
                f"unknown distribution {kind!r}; "
                "use fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA"
            )
        if len(args) != want[kind]:
            raise ValueError(f"{kind} takes {want[kind]} number(s), got {text!r}")
        try:
            nums = [float(x) for x in args]
        except ValueError:
            raise ValueError(f"not a number in {text!r}") from None
        if not all(math.isfinite(x) for x in nums):
            raise ValueError(f"numbers must be finite in {text!r}")
        if kind in ("fixed", "uniform") and not all(x >= 1 and x == int(x) for x in nums):
            raise ValueError(f"lengths must be integers >= 1 in {text!r}")
        if kind == "uniform" and nums[0] > nums[1]:
            raise ValueError(f"uniform needs LO <= HI, got {text!r}")
        if kind == "lognormal" and not (nums[0] >= 1 and nums[1] >= 0):
            raise ValueError(f"lognormal needs MEDIAN >= 1 and SIGMA >= 0, got {text!r}")
        return cls(kind, *nums)

    def sample(self, rng: np.random.Generator, n: int, max_len: int) -> np.ndarray:
        """`n` lengths, clipped to [1, max_len]."""
        if self.kind == "fixed":
            out = np.full(n, self.a)
        elif self.kind == "uniform":
            out = rng.integers(int(self.a), int(self.b), endpoint=True, size=n)
        else:
            out = np.rint(rng.lognormal(math.log(self.a), self.b, size=n))
        return np.clip(out, 1, max_len).astype(np.int64)

    def mean(self, max_len: int) -> float:
        """The mean length before clipping is applied, capped at `max_len` (a planning figure)."""
        if self.kind == "fixed":
            m = self.a
        elif self.kind == "uniform":
            m = (self.a + self.b) / 2
        else:
            m = self.a * math.exp(self.b**2 / 2)
        return min(m, max_len)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True, slots=True)
class RateSpec:
    """One point of the sweep: requests/s, or (`relative`) a fraction of eager's capacity."""

    value: float
    relative: bool = False

    @property
    def label(self) -> str:
        return f"{self.value:g}x" if self.relative else f"{self.value:g}/s"

    def resolve(self, capacity_rps: float | None) -> float:
        if not self.relative:
            return self.value
        if capacity_rps is None:
            raise ValueError(f"rate {self.label} needs eager's measured capacity")
        return self.value * capacity_rps


def parse_rates(text: str) -> list[RateSpec]:
    """`"2,4,8"` or `"0.5x,0.8x"` (mixing is allowed): each a positive finite number."""
    out: list[RateSpec] = []
    for raw in text.split(","):
        item = raw.strip().lower()
        if not item:
            raise ValueError(f"empty rate in {text!r}")
        relative = item.endswith("x")
        try:
            value = float(item[:-1] if relative else item.removesuffix("/s"))
        except ValueError:
            raise ValueError(f"not a rate: {raw.strip()!r} (use e.g. 8 or 0.8x)") from None
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"rate must be finite and > 0, got {raw.strip()!r}")
        out.append(RateSpec(value, relative))
    return out


@dataclass(frozen=True, slots=True)
class Schedule:
    """Requests of one run: arrival offsets (s, sorted, from 0) and prompt lengths.

    A trace with prefix reuse (Mooncake's `hash_ids`) also carries each request's block ids:
    request i's prompt is blocks `hash_ids[i]` of `block_tokens` tokens each (the last one
    partial), and two requests whose lists start alike share that prefix (`prefix.py`).
    """

    arrivals_s: np.ndarray  # float64[n]
    lengths: np.ndarray  # int64[n]
    hash_ids: tuple[np.ndarray, ...] | None = None  # int64[blocks] per request
    block_tokens: int = 0  # tokens per hash id (0: no hash ids)

    def __post_init__(self) -> None:
        if len(self.arrivals_s) != len(self.lengths):
            raise ValueError("arrivals and lengths differ in length")
        if self.hash_ids is not None and len(self.hash_ids) != len(self.lengths):
            raise ValueError("hash_ids and lengths differ in length")

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def span_s(self) -> float:
        return float(self.arrivals_s[-1]) if len(self) else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the span (n-1 gaps), inf for a single instant."""
        return (len(self) - 1) / self.span_s if self.span_s > 0 else math.inf

    def _with(self, arrivals_s: np.ndarray, keep: slice | np.ndarray | None = None) -> Schedule:
        if keep is None:
            return Schedule(arrivals_s, self.lengths, self.hash_ids, self.block_tokens)
        ids = self.hash_ids
        if ids is not None:
            ids = tuple(ids[i] for i in np.arange(len(self))[keep])
        return Schedule(arrivals_s[keep], self.lengths[keep], ids, self.block_tokens)

    def scaled_to_rate(self, rate: float) -> Schedule:
        """The same pattern sped up or slowed down so its mean rate is `rate`."""
        if len(self) < 2 or self.span_s <= 0:
            return self
        return self._with(self.arrivals_s * (self.mean_rate / rate))

    def sped_up(self, factor: float) -> Schedule:
        """Arrivals `factor` times closer together (2: the trace replayed at twice its pace)."""
        return self._with(self.arrivals_s / factor)

    def clipped(self, max_len: int) -> Schedule:
        """Prompt lengths capped at `max_len` (arrivals unchanged; a clipped prompt keeps its
        prefix, so its shared blocks stay shared)."""
        return Schedule(
            self.arrivals_s, np.clip(self.lengths, 1, max_len), self.hash_ids, self.block_tokens
        )

    def truncated(self, duration_s: float) -> Schedule:
        return self._with(self.arrivals_s, self.arrivals_s < duration_s)

    def first(self, n: int) -> Schedule:
        """The first `n` requests."""
        return self._with(self.arrivals_s, slice(0, n))


def make_schedule(
    rng: np.random.Generator,
    rate: float,
    duration_s: float,
    lengths: LengthSpec,
    *,
    burstiness: float = 1.0,
    max_len: int,
) -> Schedule:
    """`round(rate * duration_s)` arrivals in `[0, duration_s)` with gamma(shape=burstiness) gaps.

    The gaps are rescaled to fill the duration exactly, so a point's realised rate is its
    nominal rate (short runs would otherwise differ by several percent). For burstiness 1 this
    is exactly a Poisson process conditioned on its count; otherwise a gamma renewal process
    conditioned on its count and span.
    """
    if not (rate > 0 and burstiness > 0 and duration_s > 0):
        raise ValueError("rate, burstiness and duration must be > 0")
    n = max(1, round(rate * duration_s))
    gaps = rng.gamma(burstiness, 1.0, size=n + 1)
    arrivals = np.cumsum(gaps)[:n] / gaps.sum() * duration_s
    return Schedule(arrivals, lengths.sample(rng, n, max_len))


def make_prompts(
    rng: np.random.Generator, lengths: np.ndarray, vocab_size: int
) -> list[np.ndarray]:
    """One int32 token array per request (views into one blob), ids in [1, vocab_size)."""
    blob = rng.integers(1, max(2, vocab_size), size=int(lengths.sum()), dtype=np.int32)
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    return [blob[bounds[i] : bounds[i + 1]] for i in range(len(lengths))]
