"""Dispatch policies: *when* a batch goes and *to which* worker group, one class per policy.

The engine picks one from `EngineConfig.policy` at construction (`policy_class`), so no event
branches on the policy's name. A policy answers three events, "a request arrived", "a group's
forward is done" and "my timer fired", by choosing groups; the `Scheduler` forms each batch and
the pool (`Groups.send`) writes it. A policy holds no request state, touches no ring, fd or
timer handle, and runs as well against a fake pool of plain data (tests/policies/).
"""

from __future__ import annotations

from aioprefill.sched.policies.base import DispatchPolicy, Groups, Timer
from aioprefill.sched.policies.eager import EagerPolicy
from aioprefill.sched.policies.forward import ForwardPolicy, GreedyForwardPolicy
from aioprefill.sched.policies.lockstep import LockstepPolicy, TimerLockstepPolicy
from aioprefill.sched.policies.timeout import TimeoutPolicy

__all__ = [
    "DispatchPolicy",
    "EagerPolicy",
    "ForwardPolicy",
    "GreedyForwardPolicy",
    "Groups",
    "LockstepPolicy",
    "TimeoutPolicy",
    "Timer",
    "TimerLockstepPolicy",
    "policy_class",
]

_POLICIES: dict[str, type[DispatchPolicy]] = {
    "forward": ForwardPolicy,
    "forward-greedy": GreedyForwardPolicy,  # a baseline: the forward policy without sharing
    "eager": EagerPolicy,
    "timeout": TimeoutPolicy,
}


_LOCKSTEP: dict[str, type[DispatchPolicy]] = {
    "forward": LockstepPolicy,
    "ep-timer": TimerLockstepPolicy,
}


def policy_class(name: str, *, expert_parallel: bool = False) -> type[DispatchPolicy]:
    """The policy called `name` (a name `EngineConfig` validated); expert-parallel ranks step
    in lockstep, so there the names pick a lockstep policy."""
    return (_LOCKSTEP if expert_parallel else _POLICIES)[name]
