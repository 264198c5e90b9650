"""The KV export writers of a tensor-parallel group (`kv_writer.KVShare`), on real segments: each
rank writes its own KV heads, rank 0 alone creates, the others attach only once rank 0 said
so, and every failure path leaves nothing behind. Two threads play the ranks here, meeting at a
`threading.Barrier` where the workers use one all_reduce (tests/model/test_tensor_parallel.py
and tests/test_engine_paddle_parallel.py run the real collective)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from aioprefill.shm.segments import SHM_DIR, attach_segment, segment_name
from aioprefill.wire import protocol
from aioprefill.wire.kv import KVLayout
from aioprefill.workers.kv_writer import KVShare, KVWriters, open_writers
from aioprefill.workers.runner import ForwardBatch

LAYOUT = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, dtype="float32")
LENS = (3, 5)


def kv_batch(names: list[str]) -> ForwardBatch:
    """Two whole prompts (LENS tokens), both asking for their KV."""
    return ForwardBatch(
        request_ids=np.array([1, 2], dtype=np.int64),
        offsets=np.array([0, LENS[0], sum(LENS)], dtype=np.int32),
        tokens=np.zeros(sum(LENS), dtype=np.int32),
        start_pos=np.zeros(2, dtype=np.int32),
        is_last=np.array([True, True]),
        options=np.full(2, protocol.OPT_RETURN_KV, dtype=np.uint8),
        kv_names=tuple(names),
    )


def run_group(
    names: list[str], on_agreed: Callable[[int], None] = lambda rank: None
) -> list[KVWriters | BaseException]:
    """open_writers on ranks 0 and 1 of a TP group of 2; `on_agreed(rank)` runs right after
    the ranks met (where the engine might remove a cancelled request's segment)."""
    meet = threading.Barrier(2, timeout=30)
    said = [True]

    def rank_of(rank: int) -> KVWriters | BaseException:
        def agree(ok: bool) -> bool:
            if rank == 0:
                said[0] = ok
            meet.wait()
            on_agreed(rank)
            return said[0]

        try:
            return open_writers(kv_batch(names), LAYOUT, KVShare(rank, 2, agree))
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(rank_of, (0, 1)))


def read_keys(name: str, num_tokens: int) -> np.ndarray:
    mm = attach_segment(name)
    keys = LAYOUT.views(mm, num_tokens)[0].copy()
    mm.close()
    return keys


@contextlib.contextmanager
def segments(n: int):
    names = [segment_name("kv.writer-test") for _ in range(n)]
    try:
        yield names
    finally:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / name).unlink()


def test_each_rank_writes_its_own_kv_heads_of_the_segment_rank_0_made():
    with segments(2) as names:
        ranks = run_group(names)
        for rank, writers in enumerate(ranks):
            assert isinstance(writers, KVWriters)
            for i, writer in writers.items():
                assert writer.owner == (rank == 0)
                assert writer.keys.shape == (2, 2, LENS[i], 8)
                writer.keys[...] = rank + 1
            writers.close()
        for name, n in zip(names, LENS, strict=True):
            keys = read_keys(name, n)
            assert (keys[:, :2] == 1).all() and (keys[:, 2:] == 2).all()


def test_rank_0_unable_to_create_fails_every_rank_and_leaves_nothing():
    with segments(1) as names:
        rank0, rank1 = run_group([names[0], "x" * 300])  # shm_open refuses the second name
        assert isinstance(rank0, OSError)
        assert isinstance(rank1, RuntimeError) and "rank 0" in str(rank1)
        assert not (SHM_DIR / names[0]).exists()  # rank 0 removed the one it had made


def test_a_segment_gone_is_skipped_and_one_unmappable_fails_the_batch_after_the_forward():
    with segments(2) as names:

        def engine_meddles(rank: int) -> None:
            if rank == 1:
                (SHM_DIR / names[0]).unlink()  # the request was cancelled: nobody reads it
                fd = os.open(SHM_DIR / names[1], os.O_RDWR)
                os.ftruncate(fd, 64)  # not what rank 0 made: rank 1 must not write it
                os.close(fd)

        rank0, rank1 = run_group(names, engine_meddles)
        assert isinstance(rank0, KVWriters) and isinstance(rank1, KVWriters)
        assert not rank1 and isinstance(rank1.error, ValueError)
        rank0.close()
        with pytest.raises(ValueError, match="needs"):
            rank1.close()  # the forward ran in step with rank 0, then the batch fails


def test_only_rank_0_removes_on_discard():
    with segments(2) as names:
        rank0, rank1 = run_group(names)
        assert isinstance(rank0, KVWriters) and isinstance(rank1, KVWriters)
        rank1.discard()
        assert all((SHM_DIR / n).exists() for n in names)
        rank0.discard()
        assert not any((SHM_DIR / n).exists() for n in names)


def test_a_tp_sim_rank_above_0_leaves_the_export_to_rank_0():
    from aioprefill.config import SimModel
    from aioprefill.workers.sim import SimRunner

    with segments(2) as names:
        out = SimRunner(SimModel(fixed_ms=0.0), writes_kv=False).forward(kv_batch(names))
        assert out.request_ids.tolist() == [1, 2]
        assert not any((SHM_DIR / n).exists() for n in names)
