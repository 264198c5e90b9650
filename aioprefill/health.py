"""`engine.health()`: what each worker is doing, and whether the engine can serve at all.

A snapshot for readiness probes and dashboards (the example servers' GET /health, the
Prometheus exporter's `aioprefill_worker_state`), separate from the counters of `stats()`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["EngineHealth", "WorkerHealth", "WorkerState"]

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
