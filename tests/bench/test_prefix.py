"""Prefix reuse of a trace: tokens from hash ids, block names, the offline ceilings, budgets."""

import hashlib
from pathlib import Path

import numpy as np
import pytest

from aioprefill.bench.prefix import (
    CacheBudget,
    block_keys,
    ceilings,
    distinct_blocks,
    hit_tokens,
    prompt_tokens,
    scale_blocks,
    trace_prompts,
)
from aioprefill.bench.traces import TraceError, read_trace, shape_trace
from aioprefill.bench.workload import Schedule

MOONCAKE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"


def sched(ids, lengths, block=8):
    n = len(ids)
    return Schedule(
        np.arange(n, dtype=np.float64),
        np.asarray(lengths, dtype=np.int64),
        tuple(np.asarray(h, dtype=np.int64) for h in ids),
        block,
    )


def test_shared_ids_are_shared_tokens():
    a, b, c = trace_prompts(sched([[0, 1, 2], [0, 1, 3], [4]], [20, 17, 5]), vocab_size=100)
    assert len(a) == 20 and len(b) == 17 and len(c) == 5 and a.dtype == np.int32
    assert np.array_equal(a[:16], b[:16]) and not np.array_equal(a[16:17], b[16:17])
    assert a.min() >= 1 and max(a.max(), b.max(), c.max()) < 100
    # a function of (id, position in its block, seed) only: the same id anywhere, same tokens
    again = prompt_tokens(np.array([0, 1, 2]), 20, 8, 100)
    assert np.array_equal(again, a)
    assert not np.array_equal(prompt_tokens(np.array([0, 1, 2]), 20, 8, 100, seed=1), a)
    assert len(set(prompt_tokens(np.arange(50), 400, 8, 32000).tolist())) > 390


def test_scale_blocks_keeps_the_partial_last_block_in_proportion():
    s = sched([[0, 1], [0], [0, 1, 2]], [1000, 512, 1025], block=512)
    t = scale_blocks(s, 32)
    # 1000 = 512 + 488 -> 32 + ceil(488/16); 512 -> 32; 1025 = 1024 + 1 -> 64 + 1
    assert t.lengths.tolist() == [32 + 31, 32, 65] and t.block_tokens == 32
    assert t.hash_ids is s.hash_ids


def _content_names(prompt: np.ndarray, block: int) -> list[bytes]:
    return [
        hashlib.blake2b(prompt[: (j + 1) * block].tobytes(), digest_size=8).digest()
        for j in range(len(prompt) // block)
    ]


@pytest.mark.parametrize(("trace_block", "block"), [(8, 4), (8, 3), (5, 16), (8, 8)])
def test_block_names_match_the_tokens(trace_block, block):
    """Two engine blocks get one name exactly when their prompts agree up to the block's end,
    whether engine blocks divide the trace's blocks or straddle them."""
    seed = 1234
    rng = np.random.default_rng(seed)
    print("seed", seed)
    ids, lengths, nxt = [], [], 100
    for _ in range(40):  # random prefixes of a few shared chains, then fresh ids
        k = int(rng.integers(1, 7))
        chain = [int(x) for x in rng.integers(0, 3, size=1)]
        h = [chain[0] * 10 + i for i in range(int(rng.integers(0, k + 1)))]
        while len(h) < k:
            h.append(nxt)
            nxt += 1
        ids.append(h)
        lengths.append((k - 1) * trace_block + int(rng.integers(1, trace_block + 1)))
    s = sched(ids, lengths, trace_block)
    prompts = trace_prompts(s, vocab_size=2**31 - 1)  # no chance collisions of one token
    assert s.hash_ids is not None
    seen: dict[int, bytes] = {}
    back: dict[bytes, int] = {}
    for h, n, p in zip(s.hash_ids, s.lengths, prompts, strict=True):
        keys = block_keys(h, int(n), trace_block, block).tolist()
        names = _content_names(p, block)
        assert len(keys) == len(names) == int(n) // block
        for key, name in zip(keys, names, strict=True):
            assert seen.setdefault(key, name) == name
            assert back.setdefault(name, key) == key
    assert distinct_blocks(s, block) == len(back)


def test_hits_never_include_the_last_token_and_lru_drops_a_chain_tail_first():
    # blocks of 4 tokens; each list is a request's full-block names
    keys = [[1, 2, 3], [1, 2, 3], [1, 2], [1, 2, 3]]
    lengths = np.array([12, 12, 9, 13])
    # no eviction: r1 reads 2 blocks (12 tokens: the last token is computed), r2 2, r3 3
    assert hit_tokens(keys, lengths, 4, None).tolist() == [0, 8, 8, 12]
    # room for 2 blocks: after r0, 3 (its tail) goes first; 1 and 2 stay
    assert hit_tokens(keys, lengths, 4, 2).tolist() == [0, 8, 8, 8]
    assert hit_tokens(keys, lengths, 4, 0).tolist() == [0, 0, 0, 0]
    # LRU across requests: [7, 8] pushes 1, 2 out of a 2-block cache; round-robin over two
    # workers of one block each: r1 lands on the other worker, r2 finds its block 1
    keys2 = [[1, 2], [7, 8], [1, 2]]
    assert hit_tokens(keys2, np.array([9, 9, 9]), 4, 2).tolist() == [0, 0, 0]
    assert hit_tokens(keys2, np.array([9, 9, 9]), 4, 4).tolist() == [0, 0, 8]
    assert hit_tokens(keys2, np.array([9, 9, 9]), 4, 2, workers=2).tolist() == [0, 0, 4]
    # by affinity: r1 (nothing cached anywhere) goes to the worker that computed less (w1),
    # r2 back to w0, which holds its first block
    affinity = hit_tokens(keys2, np.array([9, 9, 9]), 4, 2, workers=2, route="affinity")
    assert affinity.tolist() == [0, 0, 4]
    keys3 = [[1, 2], [1, 2], [5, 6], [1, 2]]  # round-robin splits the chain; affinity keeps it
    assert hit_tokens(keys3, np.full(4, 9), 4, None, workers=2).tolist() == [0, 0, 0, 8]
    assert hit_tokens(keys3, np.full(4, 9), 4, None, workers=2, route="affinity").tolist() == [
        0, 8, 0, 8,
    ]  # fmt: skip


def test_ceilings_of_the_sample_trace():
    s = read_trace(MOONCAKE)
    assert s.hash_ids is not None and s.block_tokens == 512
    assert s.hash_ids[3].tolist() == [0, 1, 9]  # kept in step with the sorted arrivals
    c = ceilings(s, 16, None)
    assert 0.1 < c["no_eviction"] < 0.9 and c["lru"] is None and c["round_robin"] is None
    distinct = c["distinct_blocks"]
    assert isinstance(distinct, int) and distinct == distinct_blocks(s, 16)
    small = ceilings(s, 16, distinct // 10, workers=4)
    assert small["lru"] is not None and small["round_robin"] is not None
    assert small["affinity"] is not None
    assert small["round_robin"] <= small["lru"] < c["no_eviction"]
    assert small["round_robin"] <= small["affinity"] <= c["no_eviction"]
    assert ceilings(s, 16, distinct)["lru"] == pytest.approx(c["no_eviction"])


def test_shape_trace():
    s = read_trace(MOONCAKE)
    t = shape_trace(s, 10, 32, 2.0)
    assert len(t) == 10 and t.block_tokens == 32 and t.hash_ids is not None
    assert t.arrivals_s.tolist() == pytest.approx((s.arrivals_s[:10] / 2).tolist())
    assert t.lengths.max() <= 32 * max(len(h) for h in t.hash_ids)
    assert len(t.truncated(1.0)) == int((t.arrivals_s < 1.0).sum())
    with pytest.raises(TraceError, match="no hash_ids"):
        shape_trace(Schedule(s.arrivals_s, s.lengths), None, 32, None)


def test_trace_ids_must_cover_the_prompt(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1100, "hash_ids": [0, 1]}\n')
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: 2 hash_ids of 512 tokens"):
        read_trace(bad)
    lengths_only = tmp_path / "old.jsonl"
    lengths_only.write_text('{"timestamp": 0, "input_length": 1100}\n')
    assert read_trace(lengths_only).hash_ids is None


def test_cache_budgets():
    assert CacheBudget.parse("default").kind == "default"
    assert CacheBudget.parse("off").is_off and CacheBudget.parse("0").is_off
    assert CacheBudget.parse("256MiB").value == 256 * 2**20
    assert CacheBudget.parse("1.5GB").value == 1.5e9
    ten = CacheBudget.parse("10%")
    assert (ten.label, ten.kind, ten.value) == ("10%", "share", 0.1)
    # a share is of the trace's distinct blocks over all workers, rounded up per worker
    assert ten.bytes_per_worker(default=0, block_bytes=100, distinct=1001, workers=4) == 2600
    assert (
        CacheBudget.parse("all").bytes_per_worker(default=0, block_bytes=10, distinct=7, workers=1)
        == 70
    )
    assert (
        CacheBudget.parse("default").bytes_per_worker(
            default=123, block_bytes=10, distinct=None, workers=1
        )
        == 123
    )
    for text in ("ten", "-1", "0%", "5 parsecs"):
        with pytest.raises(ValueError):
            CacheBudget.parse(text)
    with pytest.raises(ValueError, match="only with a trace"):
        ten.bytes_per_worker(default=0, block_bytes=1, distinct=None, workers=1)
