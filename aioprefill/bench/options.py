"""`Options`: one benchmark run as the command line asked for it, already validated."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from aioprefill import PaddleModel, SimModel
from aioprefill.bench.prefix import CacheBudget
from aioprefill.bench.workload import LengthSpec, RateSpec, Schedule

__all__ = ["Options"]


@dataclass(slots=True, kw_only=True)
class Options:
    model: SimModel | PaddleModel
    model_label: str
    policies: list[str]
    rates: list[RateSpec] | None  # None: replay the trace at its own pace
    duration_s: float | None  # per rate point; None: the whole trace
    burstiness: float = 1.0
    lengths: LengthSpec | None = None  # None with a trace
    trace: Schedule | None = None
    trace_path: str | None = None
    trace_format: str | None = None
    max_prompt_len: int = 8192
    num_workers: int = 1
    tp_size: int = 1
    expert_parallel: bool = False
    max_batch_tokens: int = 8192
    max_batch_size: int = 256
    batch_timeout_ms: float = 10.0
    slo_ttft_ms: float | None = None  # None: derived from eager's forward time when measured
    saturation_s: float = 3.0
    warmup: int = 8
    seed: int = 0
    json_path: Path | None = None
    plot_path: Path | None = None
    progress: bool = False
    loop: str = "uvloop"
    argv: list[str] = field(default_factory=list)
    # Prefix cache: one arm per budget; `share` budgets resolve against the trace's distinct
    # blocks of `prefix_block_tokens` tokens and the worker's bytes per block.
    prefix_cache: list[CacheBudget] = field(default_factory=lambda: [CacheBudget.parse("default")])
    prefix_block_tokens: int = 16
    block_bytes: int = 0  # one cached block on a worker (0: unknown)
    distinct_blocks: int | None = None  # of the replayed trace (None: no hash ids)

    @property
    def fresh_engines(self) -> bool:
        """A trace that shares prefixes: every point starts from an empty cache."""
        return self.trace is not None and self.trace.hash_ids is not None

    def cache_bytes(self, budget: CacheBudget) -> int | None:
        """`prefix_cache_bytes` per worker for `budget` (None: leave the engine's default)."""
        if budget.kind == "default":
            return None
        return budget.bytes_per_worker(
            default=0,
            block_bytes=self.block_bytes,
            distinct=self.distinct_blocks,
            workers=self.num_workers,
        )

    @property
    def needs_capacity(self) -> bool:
        """Some rate is a fraction of eager's capacity, so eager's saturation run comes first."""
        return any(r.relative for r in self.rates or [])

    def max_batch_requests(self, mean_len: float) -> int:
        """How many requests of `mean_len` tokens fill one batch."""
        return max(1, min(self.max_batch_size, int(self.max_batch_tokens // max(mean_len, 1.0))))
