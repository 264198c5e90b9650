"""`engine.health()`: what each worker is doing, and whether the engine can serve at all.

A snapshot for readiness probes and dashboards (the example servers' GET /health, the
Prometheus exporter's `aioprefill_worker_state`), separate from the counters of `stats()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import msgspec

if TYPE_CHECKING:
    from aioprefill.engine.pool.slot import WorkerSlot

__all__ = ["EngineHealth", "WorkerHealth", "WorkerState", "health_of"]

# starting: not ready yet (first start); ready: idle, waiting for a batch; busy: running a
# forward (or has batches queued); restarting: died, a restart is scheduled or under way;
# given_up: died more than max_restarts times in restart_window_s, never restarted;
# stopped: the engine is closed (or was never started).
WorkerState = Literal["starting", "ready", "busy", "restarting", "given_up", "stopped"]


class WorkerHealth(msgspec.Struct, frozen=True, kw_only=True):
    index: int
    state: WorkerState
    pid: int  # -1 while no process runs
    in_flight_batches: int
    deaths: int  # deaths within the current restart window


class EngineHealth(msgspec.Struct, frozen=True, kw_only=True):
    """`is_running`: the engine accepts and can serve requests (running, not draining, at
    least one worker not given up). `state`: new, starting, running, draining, closing, closed,
    or broken (every worker given up)."""

    is_running: bool
    state: str
    workers: list[WorkerHealth]

    @property
    def ready_workers(self) -> int:
        return sum(w.state in ("ready", "busy") for w in self.workers)


def health_of(state: str, is_running: bool, slots: Sequence[WorkerSlot]) -> EngineHealth:
    """The snapshot of an engine in `state` whose pool holds `slots`."""
    live = state in ("starting", "running", "draining", "closing", "broken")
    return EngineHealth(
        is_running=is_running,
        state=state,
        workers=[_worker(slot, live) for slot in slots],
    )


def _worker(slot: WorkerSlot, live: bool) -> WorkerHealth:
    state: WorkerState
    if slot.backoff.gave_up:
        state = "given_up"
    elif not live:
        state = "stopped"
    elif slot.ready:
        state = "busy" if slot.in_flight else "ready"
    else:  # no process ready: a first start, or a restart after a death
        state = "restarting" if slot.backoff.deaths else "starting"
    handle = slot.handle
    return WorkerHealth(
        index=slot.index,
        state=state,
        pid=handle.pid if handle is not None else -1,
        in_flight_batches=len(slot.in_flight),
        deaths=len(slot.backoff.deaths),
    )
