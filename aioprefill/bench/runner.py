"""Drives one `Engine` per arm (a policy with a prefix-cache budget) through a saturation run
and the open-loop rate points.

Every arm gets its own engine, started and warmed up before measuring. (1) Each runs a
closed-loop saturation run whose steady throughput is its capacity; eager's anchors rates like
`0.8x`, so eager goes first. (2) Then, rate by rate, each arm runs the same open-loop schedule
(same arrival times, same token ids, seeded per rate) back to back, so the arms compared at one
rate ran close together in time, under similar background load. Cache budgets of one policy
alternate their order from rate to rate (A B, then B A: a repeated rate is an ABBA pair), and
with several budgets every arm saturates twice, A B then B A.
A trace that shares prefixes (hash ids) is replayed on a fresh engine per point, so every
replay starts from an empty cache.
"""

from __future__ import annotations

import asyncio
import os
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import numpy as np

from aioprefill import Engine, EngineConfig
from aioprefill.bench.interrupt import Interrupt
from aioprefill.bench.loadgen import LoadGen
from aioprefill.bench.metrics import Batches, Records, steady_throughput
from aioprefill.bench.options import Options
from aioprefill.bench.prefix import CacheBudget, trace_prompts
from aioprefill.bench.progress import Progress
from aioprefill.bench.workload import RateSpec, Schedule, make_prompts, make_schedule

__all__ = ["Arm", "Point", "Runner"]


@dataclass(frozen=True, slots=True)
class Arm:
    """What one engine runs: a batching policy with a prefix-cache budget."""

    policy: str
    cache: CacheBudget

    def name(self, opts: Options) -> str:
        return self.policy if len(opts.prefix_cache) < 2 else f"{self.policy}/{self.cache.label}"


_POOL = 2048  # prompts cycled through by warm-up and saturation runs


@dataclass(slots=True)
class Point:
    """One measurement: a policy at a rate (`kind="rate"`) or saturated (`kind="saturation"`)."""

    policy: str
    kind: str
    label: str
    records: Records
    offered_rps: float | None = None
    concurrency: int | None = None
    duration_s: float = 0.0
    partial: bool = False
    steady_window_ns: tuple[int, int] | None = None
    engine_stats: Any = None
    host_load: float = field(default_factory=lambda: os.getloadavg()[0])  # when it ended
    cache: str = "default"  # the prefix-cache budget's label
    cache_bytes: int | None = None  # prefix_cache_bytes per worker (None: the engine default)
    schedule: Schedule | None = None  # a rate point's arrivals (for the offline ceilings)
    index: int | None = None  # a rate point's place in --rate (points of one index: one schedule)


class Runner:
    def __init__(self, opts: Options, progress: Progress, interrupt: Interrupt) -> None:
        self.opts = opts
        self.progress = progress
        self.interrupt = interrupt
        self.points: list[Point] = []
        self.capacity_rps: float | None = None
        self.capacity_point: Point | None = None  # eager's saturation run
        self._schedules: dict[int, tuple[Schedule, list[np.ndarray], float]] = {}
        self._pool = self._make_pool()

    def _make_pool(self) -> list[np.ndarray]:
        o = self.opts
        rng = np.random.default_rng([o.seed, 0])
        if o.trace is not None:
            lengths = rng.choice(o.trace.lengths, size=_POOL)
        else:
            assert o.lengths is not None
            lengths = o.lengths.sample(rng, _POOL, o.max_prompt_len)
        return make_prompts(rng, lengths, o.model.vocab_size)

    @property
    def pool_lengths(self) -> np.ndarray:
        return np.array([len(p) for p in self._pool], dtype=np.int64)

    def _config(self, arm: Arm) -> EngineConfig:
        o = self.opts
        config = EngineConfig(
            model=o.model,
            num_workers=o.num_workers,
            tp_size=o.tp_size,
            expert_parallel=o.expert_parallel,
            policy=arm.policy,
            max_batch_tokens=o.max_batch_tokens,
            max_batch_size=o.max_batch_size,
            batch_timeout_ms=o.batch_timeout_ms,
            max_prompt_tokens=o.max_prompt_len,
            prefix_block_tokens=o.prefix_block_tokens,
        )
        budget = o.cache_bytes(arm.cache)  # None: the engine's default
        return config if budget is None else replace(config, prefix_cache_bytes=budget)

    async def _start(self, stack: AsyncExitStack, arm: Arm) -> Engine:
        name = arm.name(self.opts)
        self.progress.note(f"{name}: starting engine ({self.opts.num_workers} worker(s))")
        engine = await stack.enter_async_context(Engine(self._config(arm)))
        n = self.opts.warmup
        for i in range(n // 2):
            await engine.prefill(self._pool[i])
        await asyncio.gather(*(engine.prefill(p) for p in self._pool[n // 2 : n]))
        return engine

    def _arms(self, index: int = 0) -> list[Arm]:
        """Every arm, eager's first when rates are fractions of its capacity; a policy's cache
        budgets in their given order at even rate indices, reversed at odd ones (ABBA)."""
        o = self.opts
        order = list(o.policies)
        if o.needs_capacity and "eager" in order:
            order.remove("eager")
            order.insert(0, "eager")
        caches = o.prefix_cache if index % 2 == 0 else o.prefix_cache[::-1]
        return [Arm(policy, cache) for policy in order for cache in caches]

    async def run(self) -> None:
        """Start an engine per arm (eager first when rates are fractions of its capacity),
        saturate each, then run every rate for every arm back to back, so the arms compared
        at one rate ran close together in time (and under similar background load)."""
        o = self.opts
        stop = self.interrupt.stop
        arms = self._arms()
        async with AsyncExitStack() as stack:
            if o.needs_capacity and not any(a.policy == "eager" for a in arms):
                async with AsyncExitStack() as eager_stack:  # capacity only, then closed
                    engine = await self._start(eager_stack, Arm("eager", o.prefix_cache[0]))
                    await self._saturation(engine, Arm("eager", o.prefix_cache[0]))
            engines: dict[Arm, Engine] = {}
            for arm in arms:
                if stop.is_set():
                    return
                if not o.fresh_engines:
                    engines[arm] = await self._start(stack, arm)
            # several budgets: saturate A B, then B A (an ABBA pair of saturation runs)
            for arm in arms + (arms[::-1] if len(o.prefix_cache) > 1 else []):
                if o.saturation_s > 0 and not stop.is_set():
                    async with AsyncExitStack() as own:
                        engine = engines.get(arm) or await self._start(own, arm)
                        self.points.append(await self._saturation(engine, arm))
            for index, rate in enumerate(o.rates or [None]):
                for arm in self._arms(index):
                    if stop.is_set():
                        return
                    async with AsyncExitStack() as own:
                        engine = engines.get(arm) or await self._start(own, arm)
                        self.points.append(await self._rate_point(engine, arm, index, rate))

    async def _saturation(self, engine: Engine, arm: Arm) -> Point:
        o, policy = self.opts, arm.policy
        full = o.max_batch_requests(float(self.pool_lengths.mean()))
        # eager only needs a queue at each worker; the others need two full batches waiting
        conc = 2 * o.num_workers + 2 if policy == "eager" else (2 * full + 1) * o.num_workers
        self.progress.start(f"{arm.name(o)} saturation (c={conc})", o.saturation_s)
        load = await LoadGen(engine, self.interrupt, self.progress).closed_loop(
            self._pool, conc, min_s=o.saturation_s, min_forwards=3 * o.num_workers + 1
        )
        assert load.window_ns is not None
        point = Point(
            policy,
            "saturation",
            "sat",
            load.records(),
            concurrency=conc,
            duration_s=(load.window_ns[1] - load.window_ns[0]) / 1e9 + 0.2 * o.saturation_s,
            partial=load.partial,
            steady_window_ns=load.window_ns,
            engine_stats=_stats(engine),
            cache=arm.cache.label,
            cache_bytes=o.cache_bytes(arm.cache),
        )
        if policy == "eager" and self.capacity_rps is None:
            self.capacity_rps, self.capacity_point = _rps(point), point
        self.progress.done(_line(point))
        return point

    def _schedule(
        self, index: int, rate: RateSpec | None
    ) -> tuple[Schedule, list[np.ndarray], float]:
        if index not in self._schedules:
            o = self.opts
            rng = np.random.default_rng([o.seed, 1, index])
            if o.trace is not None:
                sched = (
                    o.trace
                    if rate is None
                    else o.trace.scaled_to_rate(rate.resolve(self.capacity_rps))
                )
                if o.duration_s is not None:
                    sched = sched.truncated(o.duration_s)
                offered = sched.mean_rate if rate is None else rate.resolve(self.capacity_rps)
            else:
                assert rate is not None and o.lengths is not None and o.duration_s is not None
                offered = rate.resolve(self.capacity_rps)
                sched = make_schedule(
                    rng,
                    offered,
                    o.duration_s,
                    o.lengths,
                    burstiness=o.burstiness,
                    max_len=o.max_prompt_len,
                )
            if sched.hash_ids is not None:
                prompts = trace_prompts(sched, o.model.vocab_size, o.seed)
            else:
                prompts = make_prompts(rng, sched.lengths, o.model.vocab_size)
            self._schedules[index] = (sched, prompts, offered)
        return self._schedules[index]

    async def _rate_point(
        self, engine: Engine, arm: Arm, index: int, rate: RateSpec | None
    ) -> Point:
        o = self.opts
        sched, prompts, offered = self._schedule(index, rate)
        label = rate.label if rate else "trace"
        span = o.duration_s if o.trace is None and o.duration_s else sched.span_s
        self.progress.start(f"{arm.name(o)} {label} ({offered:.1f}/s)", span)
        gen = LoadGen(engine, self.interrupt, self.progress)
        load = await gen.open_loop(sched.arrivals_s, prompts)
        point = Point(
            arm.policy,
            "rate",
            label,
            load.records(),
            offered_rps=offered,
            duration_s=span,
            partial=load.partial,
            engine_stats=_stats(engine),
            cache=arm.cache.label,
            cache_bytes=o.cache_bytes(arm.cache),
            schedule=sched,
            index=index,
        )
        self.progress.done(_line(point))
        return point


def _rps(point: Point) -> float | None:
    if point.steady_window_ns is None:
        return None
    return steady_throughput(Batches.from_records(point.records), point.steady_window_ns)[
        "requests_per_s"
    ]


def _stats(engine: Engine) -> Any:
    try:
        return msgspec.to_builtins(
            engine.stats(), enc_hook=lambda x: x.tolist() if hasattr(x, "tolist") else str(x)
        )
    except Exception as exc:  # stats are a bonus; never lose a run over them
        return {"error": repr(exc)}


def _line(p: Point) -> str:
    r = p.records
    if len(r) == 0:
        return f"no results ({dict(r.errors) or 'nothing completed'})"
    ttft = (r.finished_ns - r.submitted_ns) / 1e6
    return (
        f"{len(r)} done, TTFT mean {ttft.mean():.1f} ms p99 {np.percentile(ttft, 99):.1f} ms, "
        f"batch mean {r.batch_size.mean():.1f}" + (" (partial)" if p.partial else "")
    )
