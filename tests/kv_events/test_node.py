"""`NodeBlocks`: per-worker stores, evictions and restarts become the events that keep a
subscriber's view of the node's union exact (plain lists, no sockets)."""

from __future__ import annotations

import random

import pytest

from aioprefill.kv_events import NodeBlocks
from aioprefill.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored

B = 4


def toks(*blocks: int) -> list[int]:
    return [t for b in blocks for t in range(b * 100, b * 100 + B)]


def test_a_chain_new_to_the_node_is_one_event_with_its_tokens():
    node = NodeBlocks(B)
    (ev,) = node.stored(0, [1, 2, 3], None, toks(1, 2, 3))
    assert ev == BlockStored([1, 2, 3], None, toks(1, 2, 3), B, None, "GPU", None)
    assert len(node) == 3


def test_blocks_another_worker_holds_are_not_announced_again():
    node = NodeBlocks(B)
    node.stored(0, [1, 2], None, toks(1, 2))
    # worker 1 stores 1, 2 (already on the node) and 5 (new): only 5, linked to 2
    assert node.stored(1, [1, 2, 5], None, toks(1, 2, 5)) == [
        BlockStored([5], 2, toks(5), B, None, "GPU", None)
    ]
    # a gap in the middle: two runs, each with its own parent
    node.stored(0, [7], 5, toks(7))
    assert node.stored(1, [6, 7, 8], 5, toks(6, 7, 8)) == [
        BlockStored([6], 5, toks(6), B, None, "GPU", None),
        BlockStored([8], 7, toks(8), B, None, "GPU", None),
    ]


def test_a_block_leaves_the_node_with_its_last_holder():
    node = NodeBlocks(B)
    node.stored(0, [1, 2], None, toks(1, 2))
    node.stored(1, [1, 2], None, toks(1, 2))
    assert node.removed(0, [2]) == []
    assert node.removed(1, [2, 99]) == [BlockRemoved([2], "GPU")]  # 99: never held
    assert node.removed(7, [1]) == []  # a worker that holds nothing
    assert node.holds(1) and not node.holds(2)


def test_a_restart_withdraws_only_what_no_other_worker_holds():
    node = NodeBlocks(B)
    node.stored(0, [1, 2], None, toks(1, 2))
    node.stored(1, [1, 3], None, toks(1, 3))
    assert node.cleared(0) == [BlockRemoved([2], "GPU")]
    assert node.cleared(1) == [AllBlocksCleared()]  # nothing left on the node
    assert len(node) == 0
    assert node.cleared(5) == [AllBlocksCleared()]  # idempotent


def test_hashes_are_sent_as_unsigned_64_bit():
    node = NodeBlocks(B)
    (ev,) = node.stored(0, [-1], -2, toks(1))
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [2**64 - 1] and ev.parent_block_hash == 2**64 - 2
    assert node.holds(-1) and node.removed(0, [2**64 - 1]) == [BlockRemoved([2**64 - 1], "GPU")]


def test_token_ids_must_fill_the_blocks():
    with pytest.raises(ValueError, match="need 8 token ids"):
        NodeBlocks(B).stored(0, [1, 2], None, list(range(7)))


def random_step(
    node: NodeBlocks, rng: random.Random, truth: dict[int, set[int]], remove_below: float
):
    """One random event on one of three workers (store, remove below `remove_below`, else a
    restart), applied to `node` and to `truth` (each worker's blocks); the node's events."""
    w = rng.randrange(3)
    op = rng.random()
    if op < 0.5:
        hashes = rng.sample(range(40), rng.randrange(1, 6))
        truth[w].update(hashes)
        return node.stored(w, hashes, None, toks(*hashes))
    if op < remove_below:
        hashes = rng.sample(range(40), rng.randrange(1, 6))
        truth[w].difference_update(hashes)
        return node.removed(w, hashes)
    truth[w].clear()
    return node.cleared(w)


def test_random_histories_keep_the_announced_view_equal_to_the_union():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    node = NodeBlocks(B)
    truth: dict[int, set[int]] = {w: set() for w in range(3)}
    view: set[int] = set()
    for _ in range(2000):
        events = random_step(node, rng, truth, remove_below=0.95)
        for ev in events:
            if isinstance(ev, BlockStored):
                assert not view & set(ev.block_hashes)
                view.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                assert set(ev.block_hashes) <= view
                view.difference_update(ev.block_hashes)
            else:
                view.clear()
        assert view == set().union(*truth.values())


def test_a_snapshot_is_the_union_with_parents_first_and_tokens_kept():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    node = NodeBlocks(B)
    tokens_of: dict[int, list[int]] = {}
    next_hash = 1
    chains: list[list[int]] = []
    for _ in range(300):
        w = rng.randrange(3)
        if chains and rng.random() < 0.4:  # extend or branch an existing chain
            base = rng.choice(chains)
            prefix = base[: rng.randrange(1, len(base) + 1)]
        else:
            prefix = []
        new = list(range(next_hash, next_hash + rng.randrange(1, 4)))
        next_hash += len(new)
        for h in new:
            tokens_of[h] = [rng.randrange(1, 30000) for _ in range(B)]
        chain = prefix + new
        chains.append(chain)
        node.stored(w, chain, None, [t for h in chain for t in tokens_of[h]])
        if rng.random() < 0.3:
            node.removed(rng.randrange(3), rng.sample(chain, 1))
    parents = {}
    for chain in chains:
        for parent, h in zip([None, *chain], chain, strict=False):
            parents[h] = parent
    seen: set[int] = set()
    for ev in node.snapshot():
        assert isinstance(ev, BlockStored)
        first = ev.block_hashes[0]
        assert ev.parent_block_hash == parents[first]
        assert (
            ev.parent_block_hash is None
            or ev.parent_block_hash in seen
            or not node.holds(ev.parent_block_hash)
        )
        for prev, h in zip([ev.parent_block_hash, *ev.block_hashes], ev.block_hashes, strict=False):
            assert parents[h] == prev
        assert ev.token_ids == [t for h in ev.block_hashes for t in tokens_of[h]]
        assert not seen & set(ev.block_hashes)
        seen.update(ev.block_hashes)
    assert seen == {h for h in parents if node.holds(h)} and len(seen) == len(node)


# ---- a KV store behind the node: blocks that leave its caches stay loadable ("CPU") ----


def stored_node(capacity: int = 100) -> NodeBlocks:
    return NodeBlocks(B, store_capacity=lambda: capacity)


def test_an_evicted_block_stays_announced_as_store_backed():
    node = stored_node()
    node.stored(0, [1, 2, 3], None, toks(1, 2, 3))
    # leaf first, as the LRU evicts: GPU withdrawn, then CPU announced parents first
    assert node.removed(0, [3, 2]) == [
        BlockRemoved([3, 2], "GPU"),
        BlockStored([2, 3], 1, toks(2, 3), B, None, "CPU", None),
    ]
    assert node.num_store_backed == 2 and not node.holds(2)
    # cached again (loaded or computed): GPU again, and still in the store (no CPU event)
    assert node.stored(0, [1, 2, 3], None, toks(1, 2, 3)) == [
        BlockStored([2, 3], 1, toks(2, 3), B, None, "GPU", None)
    ]
    assert node.removed(0, [3]) == [BlockRemoved([3], "GPU")]
    # a block another worker still holds stays GPU: nothing to say
    node.stored(1, [1], None, toks(1))
    assert node.removed(0, [1]) == []


def test_blocks_put_past_the_cache_are_announced_store_backed_only():
    node = stored_node()
    node.stored(0, [1, 2], None, toks(1, 2))
    # a chunk's tail: blocks 3, 4 after 2, computed past the slots and put
    assert node.backed([3, 4], 2, toks(3, 4)) == [
        BlockStored([3, 4], 2, toks(3, 4), B, None, "CPU", None)
    ]
    assert not node.holds(3) and node.num_store_backed == 2
    assert node.backed([2, 5], 1, toks(2, 5)) == [  # 2 is cached: announced there already
        BlockStored([5], 2, toks(5), B, None, "CPU", None)
    ]
    assert NodeBlocks(B).backed([3], 2, toks(3)) == []  # no store behind the node


def test_the_store_backed_blocks_are_bounded_oldest_withdrawn_first():
    node = stored_node(capacity=2)
    node.stored(0, [1, 2, 3], None, toks(1, 2, 3))
    assert node.removed(0, [3, 2, 1]) == [
        BlockRemoved([3, 2, 1], "GPU"),
        BlockStored([1, 2, 3], None, toks(1, 2, 3), B, None, "CPU", None),
        BlockRemoved([3], "CPU"),  # (the oldest: the first evicted)
    ]
    assert node.num_store_backed == 2


def test_blocks_a_failed_forward_never_wrote_are_not_store_backed():
    node = stored_node()
    node.stored(0, [1, 2], None, toks(1, 2))
    assert node.removed(0, [2, 1], in_store=False) == [BlockRemoved([2, 1], "GPU")]
    assert node.num_store_backed == 0


def test_a_snapshot_has_the_store_backed_blocks_after_the_cached_ones():
    node = stored_node()
    node.stored(0, [1, 2, 3], None, toks(1, 2, 3))
    node.removed(0, [3])
    assert node.snapshot() == [
        BlockStored([1, 2], None, toks(1, 2), B, None, "GPU", None),
        BlockStored([3], 2, toks(3), B, None, "CPU", None),
    ]
    # the node's last worker restarts: its segment left the store with it
    assert node.cleared(0) == [AllBlocksCleared()]
    assert node.snapshot() == [] and node.num_store_backed == 0


def test_hashes_that_form_a_cycle_are_still_all_announced_store_backed():
    # Chain hashes cannot, but outside hashes can: 2 after 1, then 1 (again) after 2.
    node = stored_node()
    node.stored(0, [1, 2], None, toks(1, 2))
    node.removed(0, [1], in_store=False)
    node.stored(0, [2, 1], None, toks(2, 1))
    events = node.removed(0, [1, 2])
    (cpu,) = [ev for ev in events if ev.medium == "CPU"]
    assert isinstance(cpu, BlockStored) and sorted(cpu.block_hashes) == [1, 2]
    assert node.num_store_backed == 2


def test_random_histories_keep_both_tiers_exact():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    cap = rng.randrange(1, 30)
    node = stored_node(cap)
    truth: dict[int, set[int]] = {w: set() for w in range(3)}
    gpu: set[int] = set()
    cpu: list[int] = []  # announced store-backed, oldest first
    for _ in range(2000):
        before = set().union(*truth.values())
        events = random_step(node, rng, truth, remove_below=0.97)
        held = set().union(*truth.values())
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                gpu.clear()
                cpu.clear()
            elif ev.medium == "GPU" and isinstance(ev, BlockStored):
                assert not gpu & set(ev.block_hashes)
                gpu.update(ev.block_hashes)
            elif ev.medium == "GPU":
                assert set(ev.block_hashes) <= gpu
                gpu.difference_update(ev.block_hashes)
            elif isinstance(ev, BlockStored):  # CPU: only blocks that just left the node
                assert set(ev.block_hashes) <= before - held
                assert not set(cpu) & set(ev.block_hashes)
                cpu.extend(ev.block_hashes)
            else:
                assert set(ev.block_hashes) <= set(cpu)
                cpu = [h for h in cpu if h not in ev.block_hashes]
        assert gpu == held
        assert len(cpu) <= cap and node.num_store_backed == len(cpu)
