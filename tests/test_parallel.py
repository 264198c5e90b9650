"""Parallel settings: what EngineConfig refuses (naming the field), and how processes map to
groups and ranks."""

from __future__ import annotations

import pytest

from aioprefill.config import EngineConfig, PaddleModel, SimModel
from aioprefill.engine.pool.process import WorkerHandle
from aioprefill.errors import InvalidConfig
from aioprefill.parallel import ParallelInfo, ParallelLayout
from aioprefill.wire import protocol

MOE = PaddleModel(num_experts=8, num_experts_per_tok=2)


def test_defaults_are_one_lone_rank_per_replica() -> None:
    cfg = EngineConfig(num_workers=3)
    assert (cfg.tp_size, cfg.expert_parallel) == (1, False)
    assert EngineConfig(model=PaddleModel(), num_workers=2, tp_size=4).tp_size == 4
    assert EngineConfig(model=MOE, num_workers=4, expert_parallel=True).expert_parallel
    assert EngineConfig(model=MOE, tp_size=2).tp_size == 2  # TP over every expert's slices
    assert EngineConfig(model=SimModel(), num_workers=2, expert_parallel=True).expert_parallel
    assert EngineConfig(num_workers=2, expert_parallel=True, policy="ep-timer").policy == "ep-timer"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tp_size": 0}, "tp_size: must be an int >= 1"),
        ({"tp_size": 2.0}, "tp_size: must be an int"),
        ({"tp_size": True}, "tp_size: must be an int"),
        ({"expert_parallel": 1}, "expert_parallel: must be a bool"),
        ({"expert_parallel": True}, "expert_parallel: needs num_workers >= 2"),
        (
            {"expert_parallel": True, "num_workers": 2, "tp_size": 2},
            "expert_parallel: tensor parallelism inside an expert-parallel group",
        ),
        (
            {"model": PaddleModel(), "tp_size": 3},
            r"tp_size: 3 does not divide PaddleModel.num_kv_heads=4",
        ),
        (
            {"model": PaddleModel(num_kv_heads=8, intermediate_size=700), "tp_size": 8},
            r"tp_size: 8 does not divide PaddleModel.intermediate_size=700",
        ),
        (
            {"model": PaddleModel(vocab_size=32001), "tp_size": 2},
            r"tp_size: 2 does not divide PaddleModel.vocab_size=32001",
        ),
        (
            {"model": PaddleModel(), "num_workers": 2, "expert_parallel": True},
            "expert_parallel: the PaddleModel is dense",
        ),
        (
            {"num_workers": 2, "expert_parallel": True, "policy": "eager"},
            "policy: expert-parallel ranks step in lockstep",
        ),
        ({"policy": "ep-timer"}, "policy: 'ep-timer' is an expert-parallel baseline"),
        (
            {"model": MOE, "num_workers": 3, "expert_parallel": True},
            r"num_workers=3 ranks cannot share PaddleModel.num_experts=8 equally",
        ),
    ],
)
def test_refused_combinations_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(InvalidConfig, match=match):
        EngineConfig(**kwargs)


def test_moe_spec_validation() -> None:
    with pytest.raises(InvalidConfig, match="num_experts_per_tok: 3 exceeds num_experts=2"):
        PaddleModel(num_experts=2, num_experts_per_tok=3)
    with pytest.raises(InvalidConfig, match="num_experts: must be >= 0"):
        PaddleModel(num_experts=-1)
    with pytest.raises(InvalidConfig, match="deterministic"):
        PaddleModel(num_experts=4, deterministic=True)


def test_layouts() -> None:
    tp = ParallelLayout(num_replicas=2, tp_size=3)
    assert (tp.world_size, tp.mode) == (6, "tp")
    assert tp.groups() == [[0, 1, 2], [3, 4, 5]]
    assert [tp.place(p) for p in (0, 2, 4)] == [(0, 0, 3), (0, 2, 3), (1, 1, 3)]
    ep = ParallelLayout(num_replicas=3, expert_parallel=True)
    assert (ep.world_size, ep.mode, ep.groups()) == (3, "ep", [[0, 1, 2]])
    assert ep.place(2) == (0, 2, 3)
    solo = ParallelLayout(num_replicas=2)
    assert (solo.mode, solo.groups(), solo.place(1)) == ("none", [[0], [1]], (1, 0, 1))


def test_each_rank_gets_one_parallel_info_that_reaches_the_worker_unchanged() -> None:
    """ParallelInfo: made once per rank from the layout, the same fields (and one mode
    vocabulary) in the WorkerSpec the worker decodes."""
    tp = ParallelLayout(num_replicas=2, tp_size=2)
    assert tp.info(3, "127.0.0.1:1") == ParallelInfo(
        mode="tp", rank=1, size=2, group=1, master="127.0.0.1:1"
    )
    ep = ParallelLayout(num_replicas=3, expert_parallel=True)
    assert ep.info(2, "m") == ParallelInfo(mode="ep", rank=2, size=3, group=0, master="m")
    assert ParallelLayout(num_replicas=2).info(1, "") == ParallelInfo(group=1)  # alone: "none"
    config = EngineConfig(model=SimModel(), num_workers=2, tp_size=2)
    handle = WorkerHandle(3, config, tp.info(3, "127.0.0.1:1"))
    try:
        spec = protocol.decode_worker_spec(protocol.encode(handle.spec))  # what the worker reads
    finally:
        handle.close()
    assert spec.parallel == tp.info(3, "127.0.0.1:1")
