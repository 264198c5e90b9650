"""`DispatchPolicy`, the base of the three policies, and the views a policy works through."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

from aioprefill.sched.batching import Columns
from aioprefill.sched.scheduler import Scheduler
from aioprefill.sched.units import InFlight

__all__ = ["Batch", "DispatchPolicy", "Group", "Groups", "Timer"]


class Batch(Protocol):
    """What a policy reads of a batch in flight (an `InFlightBatch`)."""

    @property
    def num_tokens(self) -> int: ...


class Group(Protocol):
    """What a policy reads of one worker group (a `WorkerSlot`, or plain data in tests)."""

    @property
    def index(self) -> int: ...
    @property
    def ready(self) -> bool: ...
    @property
    def usable(self) -> bool: ...  # ready and its ring had room at the last send
    @property
    def in_flight(self) -> Sequence[Batch]: ...  # batches sent and not yet answered, oldest first


class Groups(Protocol):
    """The worker pool as a policy sees it: its groups, and where batches are written."""

    @property
    def slots(self) -> Sequence[Group]: ...

    def send(self, group: int, columns: Columns, *, backlogged: bool) -> InFlight | None: ...


class Timer(Protocol):
    """One one-shot timer the engine runs for the policy; it calls `on_timer` when due."""

    @property
    def armed(self) -> bool: ...

    def arm_at(self, due_ns: int) -> None:
        """Fire at `due_ns` (`time.monotonic_ns()` clock; at once if already past)."""


class DispatchPolicy:
    """Decides when each group gets a batch. Subclasses override the events they care about."""

    name: ClassVar[str]
    staging: ClassVar[bool] = False  # the scheduler keeps the next batch's columns ready
    early: ClassVar[bool] = False  # send the next batch before the previous answer is decoded

    def __init__(
        self, sched: Scheduler, groups: Groups, timer: Timer, *, batch_timeout_ms: float
    ) -> None:
        self.sched = sched
        self.groups = groups
        self.timer = timer
        self.batch_timeout_ns = int(batch_timeout_ms * 1e6)

    def on_arrival(self) -> None:
        """A request joined the queue (or work came back to it: a death's retries)."""

    def on_forward_done(self, group: int) -> None:
        """`group` answered a batch (already decoded, its requests still unresolved)."""
        self.on_arrival()

    def on_answer_waiting(self, group: int) -> None:
        """Only with `early`: `group`'s answer is in its ring, not yet decoded."""

    def on_capacity(self) -> None:
        """A group became usable (restarted), or one died and its work went back to the queue."""
        self.on_arrival()

    def on_timer(self) -> None:
        """The timer armed through `self.timer` is due."""

    def least_loaded(self) -> Group | None:
        """The usable group with the fewest batches in flight (lowest index on ties)."""
        best: Group | None = None
        for g in self.groups.slots:
            if g.usable and (best is None or len(g.in_flight) < len(best.in_flight)):
                best = g
        return best
