"""`SimBlocks`: the bulk write of a batch of whole prompts stores exactly the blocks a per-block
write would, and a read continues from exactly the ids it read."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from aioprefill.workers.runner import ForwardBatch
from aioprefill.workers.sim_cache import SimBlocks, only_whole_writes

B = 4


def _batch(lens: list[int], counts: list[int], firsts: list[int], slots: list[int]):
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    tokens = np.arange(1, offsets[-1] + 1, dtype=np.int32) * 7
    n = len(lens)
    return ForwardBatch(
        request_ids=np.arange(n, dtype=np.int64),
        offsets=offsets,
        tokens=tokens,
        start_pos=np.zeros(n, np.int32),
        is_last=np.ones(n, bool),
        read_offsets=np.zeros(n + 1, np.int32),
        read_slots=np.zeros(0, np.int32),
        write_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
        write_slots=np.asarray(slots, np.int32),
        write_first=np.asarray(firsts, np.int32),
    )


def test_the_bulk_write_stores_each_block_in_its_slot():
    # request 0 writes blocks 0-1, request 1 none, request 2 blocks 1-3 (its block 0 held)
    batch = _batch([9, 3, 17], [2, 0, 3], [0, 0, 1], [5, 0, 2, 7, 1])
    assert only_whole_writes(batch)
    bulk, each = SimBlocks(8, B), SimBlocks(8, B)
    bulk.write_whole(batch, B)
    p0, p2 = batch.tokens[0:9], batch.tokens[12:29]
    for slot, ids in ((5, p0[0:4]), (0, p0[4:8]), (2, p2[4:8]), (7, p2[8:12]), (1, p2[12:16])):
        each.write(slot, ids)
    written = [5, 0, 2, 7, 1]
    assert np.array_equal(bulk.tokens[written], each.tokens[written])
    assert bulk.valid.tolist() == each.valid.tolist() == [i in written for i in range(8)]
    ids, crc = bulk.read(np.asarray([5, 0], np.int32))
    assert np.array_equal(ids, p0[:8]) and crc == zlib.crc32(p0[:8].tobytes())
    with pytest.raises(RuntimeError, match="never stored"):
        bulk.read(np.asarray([5, 3], np.int32))
