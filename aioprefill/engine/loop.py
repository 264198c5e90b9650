"""`Engine`: forward-aware prefill batching on one asyncio event loop.

A thin facade (lifecycle, admission, wiring) over the `Scheduler` (queue, staged batch,
counters), a `DispatchPolicy` (when a group gets a batch), the `WorkerPool` (processes, rings,
fds, timers), `Outcomes` (callers' futures) and `Recovery` (after a death); see
docs/architecture.md. All of it lives on the engine's loop: no threads, locks or polling:

- a caller's `prefill()` (the request joins the queue; an idle group may get it at once),
- a group's forward-done eventfd (with policy ``forward`` the group is handed its next batch
  *before* its answer is decoded, so the gap between its forwards is one wake-up),
- a group's death (its requests retried or failed, it restarted), and the timers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aioprefill.config import EngineConfig
from aioprefill.engine.affinity import LoopAffinity
from aioprefill.engine.controls import EngineControls, Lifecycle
from aioprefill.engine.outcomes import Outcomes, tagged
from aioprefill.engine.pool.pool import WorkerPool
from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.engine.pool.slot import PoolEvents, WorkerSlot
from aioprefill.engine.recovery import Recovery
from aioprefill.engine.stats import EngineStats, StatsRecorder
from aioprefill.engine.timer import LoopTimer
from aioprefill.engine.validate import validate_controls, validate_prompt
from aioprefill.errors import AioprefillError, EngineClosed, EngineOverloaded, WorkerStartFailed
from aioprefill.kv_events import kv_events_for
from aioprefill.result import PrefillResult
from aioprefill.sched.policies import policy_class
from aioprefill.sched.prefix.cache import prefix_cache_for
from aioprefill.sched.scheduler import Scheduler
from aioprefill.sched.units import Budget, InFlightBatch, Request
from aioprefill.shm.segments import cleanup_stale_segments
from aioprefill.text.resolve import encode_text
from aioprefill.transfer.registry import TransferRegistry
from aioprefill.wire.kv import KVExports
from aioprefill.wire.outputs import parse_outputs
from aioprefill.wire.protocol import BatchFailed

__all__ = ["Engine"]


class Engine(EngineControls):
    """A prefill node: `async with Engine(config) as engine: await engine.prefill(tokens)`."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            raise TypeError("pass either an EngineConfig or keyword fields, not both")
        self.config = config
        budget = Budget(
            config.max_batch_tokens, config.max_batch_size, config.enable_chunked_prefill
        )
        self._affinity = LoopAffinity()  # the loop (and thread) that starts it owns it
        self._stats = StatsRecorder()
        events = PoolEvents(
            self._on_forward_done, self._on_exit, self._on_restarted, self._on_gave_up
        )
        self._pool = WorkerPool(config, self._stats, events)
        self._timer = LoopTimer(self._on_timer)
        # chosen once: no event branches on its name
        policy = policy_class(config.policy, expert_parallel=config.expert_parallel)
        cache = prefix_cache_for(config, self._pool.slots)  # what every group's cache holds
        self._sched = Scheduler(budget, staging=policy.staging, cache=cache)
        self._events = kv_events_for(config, cache)  # vllm-router's KV events
        transfer = TransferRegistry(config.kv_transfer_options) if config.kv_transfer else None
        self._kv = KVExports(config.model, config.max_kv_export_bytes, transfer)
        self._outcomes = Outcomes(self._sched, self._pool.free_later, self._stats, self._kv)
        self._recovery = Recovery(self._sched, self._outcomes, config.max_retries)
        self._policy = policy(
            self._sched, self._pool, self._timer, batch_timeout_ms=config.batch_timeout_ms
        )
        self._early = policy.early
        self._life = Lifecycle(self._sched, config.max_pending)  # the state's one writer

    # ---- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until each reports ready."""
        self._life.starting(self._affinity.bind())
        self._timer.loop = self._life.loop
        cleanup_stale_segments()
        try:
            self._events.start()  # binds first: a taken address fails the start at once
            await self._pool.start()
        except BaseException:
            self._events.close()
            self._life.started(ok=False)
            raise
        self._life.started(ok=True)

    async def close(self, *, drain: bool = True) -> None:
        """Stop accepting work, finish (or fail) what was accepted, stop the workers.

        With `drain`, accepted requests get up to `shutdown_timeout_s` to finish; whatever is
        left then fails with `EngineClosed`. Leaves no worker process and no shared memory.
        """
        self._affinity.check("close()")
        if not self._life.closing():
            return
        self._pool.restarts.allowed = False
        if drain and self._life.broken is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._life.idle(), self.config.shutdown_timeout_s)
        self._fail_everything(EngineClosed("engine closed before this request finished"))
        await self._pool.close(timeout=5.0)
        self._events.close()
        self._kv.close_all()
        self._timer.cancel()
        self._life.closed()

    # ---- public API ----------------------------------------------------------------------

    async def prefill(
        self,
        tokens: Any,
        *,
        wait: bool = False,
        prompt_logprobs: bool = False,
        top_k: int = 0,
        prompt_top_k: bool = False,
        embed: str | None = None,
        normalize: bool | None = None,
        return_kv: bool = False,
        label_token_ids: Any = None,
        deadline_s: float | None = None,
        request_id: str | int | None = None,
        cache_salt: str | None = None,
        token_type_ids: Any = None,
    ) -> PrefillResult:
        """Run the prefill of one prompt; return its greedy next token and timings.

        `tokens`: a list of ids, a 1-D integer array, or a `str` (`engine.tokenizer`'s ids).

        Output options (each computed only for the requests that ask; their shapes: see
        `PrefillResult`): `prompt_logprobs`, `top_k` (`prompt_top_k=True`: at every position),
        `embed="last"|"mean"` (`normalize=True`: unit L2 norm), `return_kv` (a `KVExport` on
        `result.kv`: close it; docs/kv-export.md), `label_token_ids`; encoders: docs/embedding.md.

        Raises `InvalidRequest` for a bad prompt or option and, past `max_pending` waiting requests,
        `EngineOverloaded` — or, with `wait=True`, waits for room instead; `KVBudgetExceeded` when
        KV exports fill `max_kv_export_bytes`. A request not handed to a worker within `deadline_s`
        fails with `DeadlineExceeded` and never runs; `request_id` (the caller's) names the request
        in errors and logs; different `cache_salt`s share no cached block (docs/prefix-cache.md).
        """
        submitted_ns = time.monotonic_ns()  # TTFT counts any wait for room below
        self._affinity.check("prefill()")
        validate_controls(deadline_s, request_id, cache_salt)
        try:  # a caller's request_id names the request in these errors too
            if isinstance(tokens, str):  # long texts are tokenized off the loop
                tokens = await encode_text(self.tokenizer, tokens)
            self._life.check_open()
            vocab_size = self.config.model.vocab_size
            prompt = validate_prompt(tokens, vocab_size, self.config.max_prompt_tokens or 0)
            outputs = parse_outputs(
                prompt_logprobs=prompt_logprobs,
                top_k=top_k,
                prompt_top_k=prompt_top_k,
                embed=embed,
                normalize=normalize,
                return_kv=return_kv,
                vocab_size=vocab_size,
                label_token_ids=label_token_ids,
                encoder=(self.config.model, token_type_ids, len(prompt) >> 2),
            )
            sched = self._sched
            if sched.num_pending >= self.config.max_pending:
                if not wait:
                    self._stats.rejected += 1
                    raise EngineOverloaded(
                        f"{sched.num_pending} requests already pending (max_pending="
                        f"{self.config.max_pending}); retry later or pass wait=True"
                    )
                await self._life.wait_for_room()
            assert self._life.loop is not None
            future: asyncio.Future[PrefillResult] = self._life.loop.create_future()
            if outputs is not None and return_kv:  # KVBudgetExceeded: nothing queued
                outputs.kv = self._kv.reserve_for(future, len(prompt) >> 2)
        except AioprefillError as exc:
            if request_id is None:
                raise
            raise tagged(exc, request_id) from None
        req = sched.submit(prompt, submitted_ns, future, outputs, request_id, cache_salt)
        self._stats.submitted += 1
        if deadline_s is not None:  # armed before dispatch: deadline 0 still lets an idle worker
            loop = self._life.loop
            timer = self._outcomes.arm_deadline(loop, req, deadline_s, self._after_event)
            future.add_done_callback(lambda _: timer.cancel())
        self._policy.on_arrival()
        self._after_event()
        try:
            return await future
        except asyncio.CancelledError:
            self._cancel(req)
            raise

    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes, by worker index."""
        return self._pool.pids()

    def stats(self) -> EngineStats:
        """Counters and recent distributions (batch size/tokens, queue time, bubble)."""
        return self._stats.snapshot(self._sched)

    def _after_event(self) -> None:
        """After every event: wake callers waiting for room; check invariants if asked to."""
        self._life.wake()
        if Scheduler.checking:
            self._sched.check_invariants(self._pool.in_flight_batches())

    def _cancel(self, req: Request) -> None:  # the caller went away: drop it wherever it is
        self._outcomes.cancelled(req)
        self._after_event()

    # ---- events ----------------------------------------------------------------------

    def _on_timer(self) -> None:
        if self._life.serving:
            self._policy.on_timer()
            self._after_event()

    def _on_forward_done(self, slot: WorkerSlot) -> None:
        """A group's eventfd fired: a forward ended and its answer waits in the ring.

        With policy ``forward`` the group gets its next batch *before* the answer is even
        decoded: the answer is safe in the ring, and every microsecond spent before the ring
        write is bubble. `_answered` then sees the new batch in flight and sends no other.
        """
        serving = self._sched.num_pending and self._life.serving
        if serving and self._early and self._pool.answer_waiting(slot):
            self._sched.release(slot.in_flight[0].chunks)  # continuations may ride along
            self._policy.on_answer_waiting(slot.index)
        self._answered(slot, self._pool.read_answers(slot))
        self._after_event()

    def _answered(self, slot: WorkerSlot, done: list[InFlightBatch]) -> None:
        """Batches the group completed: free what they end, send its next batch, resolve."""
        if not done:
            return
        for batch in done:
            free = self._sched.release(batch.chunks)
            if free >= 0 and slot.ready:  # a cancelled prompt's chunk: drop its KV cache
                self._pool.free_later(slot.index, [free])
        # Next batch first: every microsecond spent here before the ring write is bubble.
        if self._sched.num_pending and self._life.serving:
            self._policy.on_forward_done(slot.index)
        for batch in done:
            self._sched.unpin(batch)  # its prefix cache slots: after the next batch went
            msg = batch.answer
            if isinstance(msg, BatchFailed):
                self._outcomes.fail_batch(slot.index, batch, msg)
            elif msg is not None:
                self._outcomes.resolve(slot.index, batch, msg)

    def _on_exit(self, slot: WorkerSlot, dead: WorkerHandle) -> None:
        """A rank died: its group stops; what it answered counts, what it held is retried (up
        to max_retries) or failed."""
        may_retry = self._life.may_retry
        for stopped in self._pool.stop_group(slot, dead):
            self._answered(stopped.slot, stopped.done)
            self._stats.retried += self._recovery.after_death(
                stopped.slot.index, stopped.lost, stopped.why, may_retry=may_retry
            )
        if self._pool.all_gave_up:
            self._on_gave_up(slot)
            return
        if self._life.serving:
            self._policy.on_capacity()
        self._after_event()

    def _on_restarted(self, slot: WorkerSlot) -> None:
        self._stats.worker_restarts += 1
        if self._life.serving:
            self._policy.on_capacity()
        self._after_event()

    def _on_gave_up(self, slot: WorkerSlot) -> None:
        if self._pool.all_gave_up:
            broken = WorkerStartFailed(
                f"every worker died more than max_restarts={self.config.max_restarts} times "
                f"within {self.config.restart_window_s:.0f} s"
            )
            self._life.broke(broken)
            self._fail_everything(broken)
        self._after_event()

    def _fail_everything(self, error: AioprefillError) -> None:
        """Fail every accepted request that has not finished (on close or when broken)."""
        requests = self._sched.drain()
        for batch in self._pool.in_flight_batches():
            requests.extend(c.request for c in batch.chunks)
        self._outcomes.fail(requests, error)
        self._life.wake_all()
