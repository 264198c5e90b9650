"""How an engine's worker processes are arranged into parallel groups, and which arrangements
make sense.

`num_workers` counts data-parallel replicas. Each replica is a group of `tp_size` rank
processes that run every batch together (tensor parallelism), so the world is
`num_workers * tp_size` processes, numbered replica-major: replica 0's ranks 0..tp_size-1, then
replica 1's. With `expert_parallel=True` every replica is one rank of a single expert-parallel
group: the replicas run different batches but step in lockstep, because each MoE layer
exchanges tokens between them (policy "forward": a step when the last one ended and work is
pending; "ep-timer": the fixed-rate baseline).

`check_parallel` is called once by `EngineConfig` and raises `InvalidConfig` naming the field;
`ParallelLayout` answers "which ranks form a group" for the pool, and gives each rank its
`ParallelInfo`, the one record of its place that travels to the worker unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from aioprefill.errors import InvalidConfig
from aioprefill.models import PaddleModel

__all__ = [
    "LOCKSTEP_POLICIES",
    "ParallelInfo",
    "ParallelLayout",
    "ParallelMode",
    "check_parallel",
]

# Expert-parallel policies. "ep-timer" reproduces the original design's fixed-rate pushes: a
# step every 5 ms whether or not anything is pending (idle ranks get empty batches at ~200 Hz).
LOCKSTEP_POLICIES = ("forward", "ep-timer")


def _refuse(name: str, why: str) -> None:
    raise InvalidConfig(f"{name}: {why}")


def check_parallel(
    model: object,
    num_workers: int,
    tp_size: object,
    expert_parallel: object,
    policy: str = "forward",
) -> None:
    """Refuse tensor/expert-parallel settings the model, the policy or each other cannot
    support."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        _refuse("EngineConfig.tp_size", f"must be an int >= 1, got {tp_size!r}")
    assert isinstance(tp_size, int)
    if not isinstance(expert_parallel, bool):
        _refuse("EngineConfig.expert_parallel", f"must be a bool, got {expert_parallel!r}")
    if expert_parallel and tp_size > 1:
        _refuse(
            "EngineConfig.expert_parallel",
            "tensor parallelism inside an expert-parallel group is not supported: "
            "use tp_size=1 with expert_parallel=True",
        )
    if expert_parallel and num_workers < 2:
        _refuse(
            "EngineConfig.expert_parallel",
            f"needs num_workers >= 2 (each replica is one expert-parallel rank), got {num_workers}",
        )
    if expert_parallel and policy not in LOCKSTEP_POLICIES:
        _refuse(
            "EngineConfig.policy",
            f"expert-parallel ranks step in lockstep: use 'forward' (a step as soon as the "
            f"last one ended and work is pending) or the 'ep-timer' baseline, not {policy!r}",
        )
    if policy == "ep-timer" and not expert_parallel:
        _refuse(
            "EngineConfig.policy",
            "'ep-timer' is an expert-parallel baseline: set expert_parallel=True",
        )
    if not isinstance(model, PaddleModel):
        return  # SimModel ranks only synchronise: any group shape works
    if tp_size > 1:
        for name in ("num_kv_heads", "intermediate_size", "vocab_size"):
            value = getattr(model, name)
            if value % tp_size:
                _refuse(
                    "EngineConfig.tp_size",
                    f"{tp_size} does not divide PaddleModel.{name}={value}: "
                    "every rank needs an equal shard",
                )
    if expert_parallel:
        if model.num_experts == 0:
            _refuse(
                "EngineConfig.expert_parallel",
                "the PaddleModel is dense (num_experts=0): there are no experts to shard",
            )
        if model.num_experts % num_workers:
            _refuse(
                "EngineConfig.expert_parallel",
                f"num_workers={num_workers} ranks cannot share PaddleModel.num_experts="
                f"{model.num_experts} equally",
            )


ParallelMode = Literal["none", "tp", "ep"]


class ParallelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One rank's place in its collective group: made once per rank by the engine
    (`ParallelLayout.info`, from `EngineConfig`), carried in `WorkerSpec.parallel` and read
    unchanged by the worker, its collectives and its `Shard`.

    `mode`: what the ranks share ("tp": every batch, each rank a slice of the model; "ep":
    lockstep steps, each rank its own batch and its share of the experts; "none": a lone
    worker). `rank` of `size` ranks in group `group`, meeting at `master` ("host:port", rank 0
    listens; "" alone).
    """

    mode: ParallelMode = "none"
    rank: int = 0
    size: int = 1
    group: int = 0
    master: str = ""


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """The process arrangement: `num_replicas` groups of `tp_size` ranks, or one EP group."""

    num_replicas: int
    tp_size: int = 1
    expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return self.num_replicas * self.tp_size

    @property
    def mode(self) -> ParallelMode:
        """What the ranks of one collective group share (see `ParallelInfo.mode`)."""
        if self.expert_parallel:
            return "ep"
        return "tp" if self.tp_size > 1 else "none"

    def info(self, process: int, master: str) -> ParallelInfo:
        """Process `process`'s place: the record its worker, its collectives and its shard
        read, unchanged. A group of one is mode "none" whatever the layout."""
        group, rank, size = self.place(process)
        mode = self.mode if size > 1 else "none"
        return ParallelInfo(mode=mode, rank=rank, size=size, group=group, master=master)

    def groups(self) -> list[list[int]]:
        """Global process indices of each collective group (replica-major numbering)."""
        if self.expert_parallel:
            return [list(range(self.world_size))]
        t = self.tp_size
        return [list(range(r * t, (r + 1) * t)) for r in range(self.num_replicas)]

    def place(self, process: int) -> tuple[int, int, int]:
        """(group, rank in the group, group size) of a global process index."""
        if self.expert_parallel:
            return 0, process, self.world_size
        return process // self.tp_size, process % self.tp_size, self.tp_size
