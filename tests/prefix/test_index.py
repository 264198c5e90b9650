"""`BlockIndex` and `BatchPlan` on plain requests: reads, writes, piggyback, LRU eviction
order, pins, abort. No worker, ring or model."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np

from aioprefill.sched.batching import take_batch
from aioprefill.sched.prefix import BlockIndex, PrefixCache, block_hashes
from aioprefill.sched.units import Budget, Request

B = 4  # tokens per block in these tests


def request(rid: int, tokens: list[int], cache: PrefixCache) -> Request:
    data = np.asarray(tokens, dtype="<i4").tobytes()
    return Request(rid, data, rid, known_hashes=block_hashes(data, B))


def groups(num: int, blocks: int, in_flight: tuple[int, ...] = ()) -> list[SimpleNamespace]:
    """Pool slots as the cache reads them (`in_flight`: tokens each group runs now)."""
    busy = list(in_flight) + [0] * num
    return [
        SimpleNamespace(
            cache_blocks=blocks,
            block_bytes=100,
            generation=1,
            usable=True,
            in_flight=[SimpleNamespace(num_tokens=busy[g])] if busy[g] else [],
        )
        for g in range(num)
    ]


def run(cache: PrefixCache, slots, reqs: list[Request], group: int = 0, budget=None):
    """Form, 'send' and commit one batch for `group`; (chunks, plan, pins)."""
    cache.slots = slots
    plan = cache.plan(group, route=True)
    budget = budget or Budget(max_batch_tokens=1000, max_batch_size=100)
    chunks = take_batch(deque(reqs), group, budget, plan)
    columns = plan.columns() if plan is not None else None
    pins = plan.commit() if plan is not None else None
    return chunks, columns, pins


def test_a_second_prompt_reads_the_blocks_the_first_wrote():
    cache = PrefixCache(groups(1, 8), B)
    slots = groups(1, 8)
    first = request(1, list(range(10)), cache)  # blocks 0, 1 full; 2 ids left over
    chunks, columns, pins = run(cache, slots, [first])
    assert [(c.start, c.end, c.cached) for c in chunks] == [(0, 10, 0)]
    read_off, _read_slots, write_off, write_slots, write_first = (
        np.frombuffer(col, "<i4") for col in columns[:5]
    )
    assert list(read_off) == [0, 0] and list(write_off) == [0, 2] and list(write_first) == [0]
    # the written blocks' hashes ride beside their slots (store keys)
    assert list(np.frombuffer(columns[5], "<u8")) == first.hashes[:2]
    cache.release(pins)
    again = request(2, list(range(10)), cache)
    chunks, columns, pins = run(cache, slots, [again])
    assert [(c.start, c.end, c.cached) for c in chunks] == [(8, 10, 8)]
    assert list(np.frombuffer(columns[1], "<i4")) == list(write_slots)  # the same two slots
    assert cache.hit_tokens == 8 and cache.queried_tokens == 20


def test_the_last_token_is_always_computed():
    cache = PrefixCache(groups(1, 8), B)
    slots = groups(1, 8)
    _, _, pins = run(cache, slots, [request(1, list(range(8)), cache)])  # two full blocks
    cache.release(pins)
    chunks, _, _ = run(cache, slots, [request(2, list(range(8)), cache)])
    assert [(c.start, c.cached) for c in chunks] == [(4, 4)]  # (8 - 1) // 4 blocks read


def test_piggyback_a_later_request_of_the_same_batch_reads_what_an_earlier_one_writes():
    cache = PrefixCache(groups(1, 8), B)
    slots = groups(1, 16)
    shared = list(range(100, 112))
    reqs = [request(i, shared + [i] * 3, cache) for i in range(3)]
    budget = Budget(max_batch_tokens=15 + 3 + 3, max_batch_size=100)  # uncached tokens only
    chunks, columns, _ = run(cache, slots, reqs, budget=budget)
    assert [(c.start, c.cached) for c in chunks] == [(0, 0), (12, 12), (12, 12)]
    read_off, read_slots, write_off, write_slots, _ = (np.frombuffer(c, "<i4") for c in columns[:5])
    assert list(read_off) == [0, 0, 3, 6]
    assert list(read_slots) == list(write_slots[:3]) * 2  # the first one's slots
    assert list(write_off) == [0, 3, 3, 3]  # block 3 of each is not full: nothing more


def test_lru_evicts_a_chains_last_block_before_its_parents_and_never_a_pinned_one():
    cache = PrefixCache(groups(1, 8), B)
    slots = groups(1, 4)
    index = cache.indexes[0]
    a = list(range(1, 13))  # blocks a0 a1 a2
    _, _, pins_a = run(cache, slots, [request(1, [*a, 0], cache)])
    cache.release(pins_a)
    ha = block_hashes(np.asarray(a, "<i4").tobytes(), B)
    assert list(index.lru) == [index.slot_of[h] for h in reversed(ha)]  # a2 oldest
    b = list(range(50, 58))  # needs two slots: one free, then a2 goes
    _, _, pins_b = run(cache, slots, [request(2, [*b, 0], cache)])
    assert ha[2] not in index.slot_of and ha[0] in index.slot_of and ha[1] in index.slot_of
    assert cache.evictions == 1
    # While b's batch is in flight its blocks are pinned: a third prompt can only take a's.
    c = list(range(70, 82))
    _chunks, columns, pins_c = run(cache, slots, [request(3, [*c, 0], cache)])
    assert list(np.frombuffer(columns[2], "<i4")) == [0, 2]  # only two slots were unpinned
    assert cache.evictions == 3 and not any(h in index.slot_of for h in ha)
    cache.check([pins_b, pins_c])
    cache.release(pins_b)
    cache.release(pins_c)
    cache.check([])


def test_an_unsent_batch_gives_back_its_slots_and_pins():
    cache = PrefixCache(groups(1, 8), B)
    slots = groups(1, 8)
    _, _, pins = run(cache, slots, [request(1, list(range(9)), cache)])
    cache.release(pins)
    plan = cache.plan(0)
    reqs = [
        request(2, list(range(9)) + [5] * 8, cache),
        request(3, list(range(9)) + [5] * 9, cache),
    ]
    take_batch(deque(reqs), 0, Budget(1000, 100), plan)
    assert len(cache.indexes[0]) == 4  # two more blocks written, read by the second (piggyback)
    plan.abort()
    assert len(cache.indexes[0]) == 2 and cache.queried_tokens == 9
    cache.check([])


def test_a_dead_groups_index_is_dropped_and_its_late_pins_ignored():
    cache = PrefixCache(groups(1, 8), B)
    slots = groups(1, 8)
    _, _, pins = run(cache, slots, [request(1, list(range(9)), cache)])
    cache.drop(0)
    assert len(cache.indexes[0]) == 0 and cache.plan(0) is None  # until it restarts
    cache.release(pins)  # the lost batch's pins: harmless
    slots[0].generation = 2  # restarted
    chunks, _, _ = run(cache, slots, [request(2, list(range(9)), cache)])
    assert chunks[0].cached == 0


def test_several_groups_a_request_waits_for_its_home_unless_that_costs_more_than_it_saves():
    cache = PrefixCache(groups(2, 64), B)
    idle = groups(2, 64)
    prefix = list(range(200, 240))  # 10 blocks
    _, _, pins = run(cache, idle, [request(1, [*prefix, 1], cache)], group=1)
    cache.release(pins)
    r = request(2, [*prefix, 2], cache)
    chunks, _, _ = run(cache, idle, [r], group=0)
    assert chunks == []  # group 1 is idle and holds 40 tokens of it: left to group 1
    other = request(3, [9] * 9, cache)
    # It saves 40 tokens there, counted twice (no second copy stored): it waits while half of
    # group 1's tokens in flight (the expected rest of its forward) stay under 80.
    chunks, _, _ = run(cache, groups(2, 64, in_flight=(0, 159)), [r, other], group=0)
    assert [c.request.request_id for c in chunks] == [3]  # 79 < 80: r waits, even alone
    chunks, _, _ = run(cache, groups(2, 64, in_flight=(0, 159)), [r], group=0)
    assert chunks == []
    chunks, columns, _ = run(cache, groups(2, 64, in_flight=(0, 161)), [r, other], group=0)
    assert [c.request.request_id for c in chunks] == [2, 3]  # 80: computed here
    assert columns is not None
    assert np.frombuffer(columns[2], "<i4")[1] == 10  # r writes its blocks: a second home


def test_index_check_catches_a_slot_in_two_places():
    index = BlockIndex(4, 10)
    slots = index.take(1)
    index.put([7], slots)
    index.check()
    index.free.append(slots[0])
    try:
        index.check()
    except AssertionError as exc:
        assert "free" in str(exc) or "unaccounted" in str(exc)
    else:
        raise AssertionError("check() missed it")


def test_a_failed_batchs_writes_are_forgotten_even_while_a_later_batch_reads_them():
    cache = PrefixCache(groups(1, 8), B)
    slots = groups(1, 8)
    _, _, failed = run(cache, slots, [request(1, list(range(9)), cache)])  # writes 2 blocks
    _, _, later = run(cache, slots, [request(2, list(range(9)), cache)])  # reads them
    cache.release(failed, failed=True)  # the worker may have written neither
    assert len(cache.indexes[0]) == 0
    cache.check([later])  # the two slots stay pinned by the later batch, held by nobody
    cache.release(later)
    cache.check([])
    assert sorted(cache.indexes[0].free) == list(range(8))
    chunks, _, _ = run(cache, slots, [request(3, list(range(9)), cache)])
    assert chunks[0].cached == 0


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stored(self, worker, hashes, parent_hash, token_ids):
        self.events.append(("stored", worker, list(hashes), parent_hash, list(token_ids)))

    def removed(self, worker, hashes, *, in_store=True):
        self.events.append(("removed", worker, list(hashes)) + (() if in_store else ("lost",)))

    def cleared(self, worker):
        self.events.append(("cleared", worker))

    def put_past_cache(self, worker, hashes, parent_hash, token_ids):
        self.events.append(("tail", worker, list(hashes), parent_hash, list(token_ids)))


def test_the_observer_hears_blocks_stored_parents_first_evicted_failed_and_cleared():
    slots = groups(1, 3)
    cache = PrefixCache(slots, B)
    cache.observer = seen = Recorder()
    a = list(range(1, 10))  # blocks a0 a1
    _, _, pins = run(cache, slots, [request(1, a, cache)])
    cache.release(pins)
    ha = block_hashes(np.asarray(a, "<i4").tobytes(), B)
    assert seen.events == [("stored", 0, ha, None, a[:8])]
    seen.events.clear()
    b = [*a[:8], 50, 51, 52, 53, 54]  # reads a0 a1, writes its block 2 (a free slot)
    _, _, pins = run(cache, slots, [request(2, b, cache)])
    hb = block_hashes(np.asarray(b, "<i4").tobytes(), B)
    assert seen.events == [("stored", 0, hb[2:], ha[1], b[8:12])]
    cache.release(pins, failed=True)  # its forward failed: the block it wrote is gone
    assert seen.events[-1] == ("removed", 0, hb[2:], "lost")  # (never written: not in a store)
    seen.events.clear()
    c = [70, 71, 72, 73, 74, 75, 76, 77, 78]
    _, _, pins = run(cache, slots, [request(3, c, cache)])  # needs two slots: one evicted
    assert seen.events[0] == ("removed", 0, [ha[1]])  # a's last block, not its parent
    cache.drop(0)
    assert seen.events[-1] == ("cleared", 0)


def test_the_written_blocks_hashes_travel_only_to_workers_with_a_store():
    for store_keys in (True, False):
        cache = PrefixCache(groups(1, 8), B, store_keys=store_keys)
        first = request(1, list(range(10)), cache)
        _, columns, _ = run(cache, groups(1, 8), [first])
        assert list(np.frombuffer(columns[3], "<i4")) == [0, 1]  # written either way
        expected = first.hashes[:2] if store_keys else []
        assert list(np.frombuffer(columns[5], "<u8")) == expected


def test_with_a_store_blocks_computed_past_the_slots_travel_as_tails():
    """A chunk's full blocks that no slot takes (the prompt is longer than the cache, or every
    slot is pinned) are named with the batch, so that the worker's store can put them."""
    for store_keys in (True, False):
        cache = PrefixCache(groups(1, 3), B, store_keys=store_keys)
        cache.observer = seen = Recorder()
        slots = groups(1, 3)
        long = request(1, list(range(22)), cache)  # 5 full blocks, 3 slots
        _, columns, _ = run(cache, slots, [long])  # (its pins are kept: every slot pinned)
        # the observer hears of the tail too (KV events announce it store-backed)
        h = long.hashes
        assert seen.events[1:] == ([("tail", 0, h[3:5], h[2], list(range(12, 20)))]
                                   if store_keys else [])  # fmt: skip
        assert list(np.frombuffer(columns[3], "<i4")) == [0, 1, 2]
        assert list(np.frombuffer(columns[4], "<i4")) == [0]  # its writes hold blocks 0..2
        tails = long.hashes[3:] if store_keys else []
        assert list(np.frombuffer(columns[6], "<i4")) == ([0, 2] if store_keys else [])
        assert list(np.frombuffer(columns[7], "<u8")) == tails  # blocks 3 and 4
        other = request(2, list(range(100, 110)), cache)  # 2 full blocks, no slot free
        _, columns, _ = run(cache, slots, [other])
        if not store_keys:
            assert columns is None  # nothing read, written, or to put
            continue
        assert list(np.frombuffer(columns[2], "<i4")) == [0, 0]  # no write
        assert list(np.frombuffer(columns[6], "<i4")) == [0, 2]
        assert list(np.frombuffer(columns[7], "<u8")) == other.hashes


def test_blocks_a_next_token_request_wrote_keep_no_hidden_rows_until_one_that_needs_them():
    """Without a KV store, a request asking for nothing over the prompt writes rowless blocks
    (its worker may run the last layer on the last rows alone): another such request reads
    them; one asking for prompt logprobs or mean pooling computes them and writes them again,
    with their rows (the rowless ones forgotten: the observer hears them removed), and from
    then on every request reads them."""
    from aioprefill.wire.outputs import Outputs
    from aioprefill.wire.protocol import OPT_EMBED_LAST, OPT_EMBED_MEAN, OPT_PROMPT_LOGPROBS

    def req(rid: int, tokens: list[int], bits: int = 0) -> Request:
        r = request(rid, tokens, cache)
        r.outputs = Outputs(bits=bits, top_k=0) if bits else None
        return r

    def one(r: Request) -> tuple[list[tuple[int, int]], int]:
        """(start, cached) of its chunk, and how many blocks it writes."""
        chunks, columns, pins = run(cache, slots, [r])
        cache.release(pins)
        writes = 0 if columns is None else len(np.frombuffer(columns[3], "<i4"))
        return [(c.start, c.cached) for c in chunks], writes

    cache = PrefixCache(groups(1, 16), B, store_keys=False)
    heard: list[tuple[str, list[int]]] = []
    cache.shared.observer = SimpleNamespace(
        stored=lambda g, hashes, parent, ids: heard.append(("stored", hashes)),
        removed=lambda g, hashes, in_store=True: heard.append(("removed", hashes)),
        put_past_cache=lambda *args: None,
    )
    slots = groups(1, 16)
    chat = list(range(13))  # three full blocks
    assert one(req(1, chat)) == ([(0, 0)], 3)  # written, rowless
    assert one(req(2, chat, OPT_EMBED_LAST)) == ([(12, 12)], 0)
    assert cache.evictions == 0
    assert one(req(3, chat, OPT_PROMPT_LOGPROBS)) == ([(0, 0)], 3)  # computed, written again
    hashes = block_hashes(np.asarray(chat, "<i4").tobytes(), B)[:3]
    assert heard == [("stored", hashes), ("removed", hashes), ("stored", hashes)]
    assert cache.evictions == 0 and len(cache.indexes[0]) == 3  # (not evictions)
    for rid, bits in enumerate((OPT_EMBED_MEAN, OPT_PROMPT_LOGPROBS, 0, OPT_EMBED_LAST)):
        assert one(req(4 + rid, chat, bits)) == ([(12, 12)], 0), bits
    # a chain whose first block kept its rows and the rest did not: read up to the rowless
    longer = chat + list(range(100, 108))  # five full blocks: the first three held with rows
    assert one(req(9, longer)) == ([(12, 12)], 2)  # blocks 3 and 4 rowless
    assert one(req(10, longer, OPT_EMBED_MEAN)) == ([(12, 12)], 2)
    assert one(req(11, longer, OPT_PROMPT_LOGPROBS)) == ([(20, 20)], 0)
    cache.shared.store_keys = True  # a KV store puts every block whole: none is rowless
    other = list(range(80, 93))
    assert one(req(12, other)) == ([(0, 0)], 3)
    assert one(req(13, other, OPT_PROMPT_LOGPROBS)) == ([(12, 12)], 0)
    cache.indexes[0].check()
