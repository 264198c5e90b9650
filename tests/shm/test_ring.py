"""Ring: round trips, wrap-around at every offset, full/empty edges, limits, corruption."""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import random
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioprefill.errors import FrameTooLarge, ProtocolError
from aioprefill.shm import segments
from aioprefill.shm.ring import DATA_OFFSET, WRAP, Ring, RingClosed

HEAD, TAIL = 64, 128  # byte offsets of the counters (see the layout in ring.py)


@pytest.fixture
def ring():
    r = Ring.create(128, tag="test")
    yield r
    r.close()
    r.unlink()


@contextlib.contextmanager
def raw(ring: Ring):
    """A second, independent mapping of the ring's segment, for poking bytes."""
    mm = segments.attach_segment(ring.name)
    try:
        yield mm
    finally:
        mm.close()


def put_u64(mm: mmap.mmap, offset: int, value: int) -> None:
    mm[offset : offset + 8] = value.to_bytes(8, "little")


def payload(n: int, seed: int) -> bytes:
    return bytes((seed + i * 7) % 251 for i in range(n))


def test_create_header_and_limits(ring: Ring):
    assert ring.capacity == 128
    assert ring.max_frame == 56
    assert ring.name.startswith(f"aioprefill-{os.getpid()}-") and ring.name.endswith("-test")
    with raw(ring) as mm:
        assert mm[:8] == b"AIOPRING"
        assert len(mm) == DATA_OFFSET + 128
    assert ring.try_read() is None


@pytest.mark.parametrize("capacity", [0, 32, 100, 96, 1 << 41, -64])
def test_bad_capacity(capacity: int):
    with pytest.raises(ValueError, match="power of two"):
        Ring.create(capacity)


def test_bad_tag():
    with pytest.raises(ValueError, match="tag"):
        Ring.create(64, tag="no/slash")


def test_round_trip_parts_and_buffers(ring: Ring):
    consumer = Ring.attach(ring.name)
    try:
        arr = np.arange(4, dtype="<i4")
        assert ring.try_write(b"ab", bytearray(b"cd"), memoryview(b"ef"), arr)
        view = consumer.try_read()
        assert view is not None
        assert bytes(view) == b"abcdef" + arr.tobytes()
        assert consumer.try_read() is not None  # same frame again until release
        consumer.release()
        assert consumer.try_read() is None
        with pytest.raises(RuntimeError, match="release"):
            consumer.release()
    finally:
        consumer.close()


def test_empty_frame(ring: Ring):
    assert ring.try_write()
    assert ring.try_write(b"")
    for _ in range(2):
        view = ring.try_read()
        assert view is not None and len(view) == 0
        ring.release()
    assert ring.try_read() is None


def test_full_and_empty_edges(ring: Ring):
    big = payload(ring.max_frame, 1)  # frame size exactly capacity / 2
    assert ring.try_write(big)
    assert ring.try_write(big)  # exactly full: head - tail == capacity
    assert not ring.try_write(b"")  # not even an empty frame (8 bytes) fits
    view = ring.try_read()
    assert view is not None and bytes(view) == big
    assert not ring.try_write(big + b"")  # frame not yet released: still full
    ring.release()
    assert ring.try_write(big)
    for _ in range(2):
        view = ring.try_read()
        assert view is not None and bytes(view) == big
        ring.release()
    assert ring.try_read() is None


def test_frame_too_large_writes_nothing(ring: Ring):
    assert ring.try_write(b"x")
    with raw(ring) as mm:
        before = bytes(mm)
        with pytest.raises(FrameTooLarge):
            ring.try_write(payload(ring.max_frame + 1, 0))
        with pytest.raises(FrameTooLarge):
            ring.try_write(b"x" * 40, b"y" * 17)
        assert bytes(mm) == before
    assert isinstance(FrameTooLarge("x"), ProtocolError)
    assert isinstance(FrameTooLarge("x"), ValueError)


def test_wrap_around_at_every_offset_and_size():
    """For every start offset and every frame size, a frame (wrapping when it must) and the
    frame after it come back intact, and the counters advance by the documented sizes."""
    owner = Ring.create(128, tag="wrap")
    try:
        base = (1 << 40) + 1024  # large counters: no reliance on starting at zero
        for start in range(0, 128, 8):
            for n in range(0, owner.max_frame + 1):
                with raw(owner) as mm:
                    put_u64(mm, HEAD, base + start)
                    put_u64(mm, TAIL, base + start)
                producer, consumer = Ring.attach(owner.name), Ring.attach(owner.name)
                try:
                    first, second = payload(n, start), payload(n % 9, n)
                    assert producer.try_write(first), (start, n)
                    size = 8 + (n + 7) // 8 * 8
                    wraps = start + size > 128
                    assert producer._head == base + start + size + (128 - start if wraps else 0)
                    expected = [first, second]
                    if not producer.try_write(second):  # no room yet: drain the first
                        view = consumer.try_read()
                        assert view is not None and bytes(view) == expected.pop(0)
                        consumer.release()
                        assert producer.try_write(second)
                    for frame in expected:
                        view = consumer.try_read()
                        assert view is not None and bytes(view) == frame, (start, n)
                        consumer.release()
                    assert consumer.try_read() is None
                    assert consumer._tail == producer._head
                finally:
                    producer.close()
                    consumer.close()
    finally:
        owner.close()
        owner.unlink()


def test_wrap_marker_layout(ring: Ring):
    assert ring.try_write(payload(40, 0))  # 48 bytes at 0
    assert ring.try_write(payload(40, 1))  # 48 bytes at 48: head 96
    for _ in range(2):
        assert ring.try_read() is not None
        ring.release()
    assert ring.try_write(payload(40, 2))  # needs 48, only 32 before the end: wraps
    with raw(ring) as mm:
        assert int.from_bytes(mm[DATA_OFFSET + 96 : DATA_OFFSET + 104], "little") == WRAP
        assert int.from_bytes(mm[DATA_OFFSET : DATA_OFFSET + 8], "little") == 40
        assert int.from_bytes(mm[HEAD : HEAD + 8], "little") == 96 + 32 + 48
    view = ring.try_read()
    assert view is not None and bytes(view) == payload(40, 2)
    ring.release()


def test_closed_ring_refuses(ring: Ring):
    ring.close()
    ring.close()  # idempotent
    assert ring.closed
    with pytest.raises(RingClosed):
        ring.try_write(b"x")
    with pytest.raises(RingClosed):
        ring.try_read()


def test_close_with_view_alive_does_not_crash(ring: Ring):
    assert ring.try_write(b"abc")
    view = ring.try_read()
    assert view is not None
    sub = view[1:]  # a slice the caller kept: shares the mapping
    ring.close()
    assert bytes(sub) == b"bc"  # still mapped: no use-after-unmap
    del sub


def test_release_refuses_while_exported(ring: Ring):
    assert ring.try_write(np.arange(4, dtype="<i4"))
    view = ring.try_read()
    assert view is not None
    it = struct.iter_unpack("<i", view)  # holds a buffer export of the view until exhausted
    with pytest.raises(BufferError, match="copy it out"):
        ring.release()
    assert [v for (v,) in it] == [0, 1, 2, 3]
    ring.release()
    assert ring.try_read() is None


def test_arrays_from_a_frame_stay_mapped(ring: Ring):
    """np.frombuffer takes a new view of the mapping, not an export of ours: release() and
    close() succeed and the array stays readable (its bytes may be reused: copy out first)."""
    assert ring.try_write(np.arange(4, dtype="<i4"))
    view = ring.try_read()
    assert view is not None
    arr = np.frombuffer(view, dtype="<i4")
    ring.release()
    ring.close()
    assert arr.tolist() == [0, 1, 2, 3]
    del arr


def test_failed_init_is_safe_to_close():
    r = Ring.__new__(Ring)
    r.close()
    r.unlink()
    assert r.closed


# ---- corruption ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "offset, value, match",
    [
        (0, 0, "magic"),
        (8, 2, "version"),  # version 2, data offset 0
        (16, 96, "capacity"),  # not a power of two
        (16, 1 << 20, "capacity"),  # larger than the segment
        (16, 32, "capacity"),  # below the minimum
        (HEAD, 4, "counters"),  # head < tail is checked with tail 8 below
        (HEAD, 12, "counters"),  # unaligned
        (HEAD, 8 + 128 + 8, "counters"),  # head - tail > capacity
    ],
)
def test_attach_rejects_corrupt_header(ring: Ring, offset: int, value: int, match: str):
    with raw(ring) as mm:
        put_u64(mm, TAIL, 8)
        put_u64(mm, HEAD, 8)
        put_u64(mm, offset, value)
    with pytest.raises(ProtocolError, match=match):
        Ring.attach(ring.name)


def test_attach_rejects_tiny_segment():
    name = segments.segment_name("tiny")
    mm = segments.create_segment(name, 64)
    try:
        with pytest.raises(ProtocolError, match="too small"):
            Ring.attach(name)
    finally:
        mm.close()
        segments.unlink_segment(name)


@pytest.mark.parametrize(
    "setup, match",
    [
        ({"prefix": 57}, "frame length"),  # over max_frame
        ({"prefix": 40}, "overruns"),  # within max_frame, beyond the 16 published bytes
        ({"prefix": (1 << 64) - 2}, "frame length"),
        ({"head": 8}, "overruns"),  # shrunk below the frame
        ({"head": 2000}, "head"),  # beyond capacity
        ({"head": 13}, "head"),  # unaligned
    ],
)
def test_read_rejects_lying_frame(ring: Ring, setup: dict[str, int], match: str):
    consumer = Ring.attach(ring.name)
    try:
        assert ring.try_write(b"12345678")  # 16 bytes at 0, head 16
        with raw(ring) as mm:
            if "prefix" in setup:
                put_u64(mm, DATA_OFFSET, setup["prefix"])
            if "head" in setup:
                put_u64(mm, HEAD, setup["head"])
        with pytest.raises(ProtocolError, match=match):
            consumer.try_read()
    finally:
        consumer.close()


def test_read_rejects_head_going_backwards(ring: Ring):
    consumer = Ring.attach(ring.name)
    try:
        for _ in range(3):
            assert ring.try_write(b"x")
        for _ in range(3):
            assert consumer.try_read() is not None
            consumer.release()
        with raw(ring) as mm:
            put_u64(mm, HEAD, 8 + 16)  # below the 48 already seen
        with pytest.raises(ProtocolError, match="head"):
            consumer.try_read()
    finally:
        consumer.close()


def test_read_rejects_wrap_with_nothing_after(ring: Ring):
    with raw(ring) as mm:
        put_u64(mm, DATA_OFFSET, WRAP)
        put_u64(mm, HEAD, 16)
    consumer = Ring.attach(ring.name)
    try:
        with pytest.raises(ProtocolError, match="wrap"):
            consumer.try_read()
    finally:
        consumer.close()


@pytest.mark.parametrize("tail", [200, 4, 9])
def test_write_rejects_bad_tail(ring: Ring, tail: int):
    assert ring.try_write(payload(40, 0))
    assert ring.try_write(payload(40, 0))  # head 96; the next write must load tail
    with raw(ring) as mm:
        put_u64(mm, TAIL, tail)  # beyond head / below the last tail (8 after) / unaligned
    ring._seen_tail = 8 if tail == 4 else 0
    with pytest.raises(ProtocolError, match="tail"):
        ring.try_write(payload(40, 0))


# ---- properties ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    capacity=st.sampled_from([64, 128, 256, 1024]),
    ops=st.lists(
        st.one_of(st.integers(min_value=0, max_value=1 << 20), st.none()),
        max_size=200,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_interleavings_keep_order_and_content(capacity: int, ops: list[int | None], seed: int):
    """Random frame sizes (int: write that many bytes, modulo max_frame + 1) and reads
    (None) in any interleaving: frames come out in order and intact, a write fails only when
    the unreleased bytes leave too little room, and an empty ring always takes a frame."""
    rng = random.Random(seed)
    producer = Ring.create(capacity, tag="prop")
    consumer = Ring.attach(producer.name)
    model: collections.deque[bytes] = collections.deque()
    try:
        for op in ops:
            if op is None:
                view = consumer.try_read()
                if not model:
                    assert view is None
                    continue
                assert view is not None and bytes(view) == model.popleft()
                consumer.release()
            else:
                data = rng.randbytes(op % (producer.max_frame + 1))
                split = rng.randint(0, len(data))
                if producer.try_write(data[:split], data[split:]):
                    model.append(data)
                else:
                    assert model, "an empty ring refused a frame of at most max_frame"
                    size = 8 + (len(data) + 7) // 8 * 8
                    off = producer._head % capacity
                    need = size if off + size <= capacity else capacity - off + size
                    assert need > capacity - (producer._head - consumer._tail)
                assert 0 <= producer._head - consumer._tail <= capacity
        while model:
            view = consumer.try_read()
            assert view is not None and bytes(view) == model.popleft()
            consumer.release()
        assert consumer.try_read() is None
    finally:
        consumer.close()
        producer.close()
        producer.unlink()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    frames=st.lists(st.integers(0, 56), max_size=6),
    consumed=st.integers(0, 6),
    before=st.lists(st.tuples(st.integers(0, DATA_OFFSET + 127), st.integers(0, 255)), max_size=8),
    after=st.lists(st.tuples(st.integers(0, DATA_OFFSET + 127), st.integers(0, 255)), max_size=8),
)
def test_mutated_bytes_never_crash(
    frames: list[int],
    consumed: int,
    before: list[tuple[int, int]],
    after: list[tuple[int, int]],
):
    """Random byte mutations anywhere in the header, counters or data, before and after
    attaching: attach, reads and writes either work (bounded frames) or raise ProtocolError."""
    owner = Ring.create(128, tag="fuzz")
    rings: list[Ring] = []
    try:
        for n in frames:
            owner.try_write(payload(n, n))
        for _ in range(consumed):
            if owner.try_read() is None:
                break
            owner.release()
        with raw(owner) as mm:
            for offset, value in before:
                mm[offset] = value
            try:
                consumer = Ring.attach(owner.name)
                producer = Ring.attach(owner.name)
            except ProtocolError:
                return
            rings += [consumer, producer]
            for offset, value in after:
                mm[offset] = value
        for _ in range(40):  # at most 128 / 8 frames can be published: the loop ends
            try:
                view = consumer.try_read()
            except ProtocolError:
                break
            if view is None:
                break
            assert len(view) <= consumer.max_frame
            bytes(view)  # readable
            consumer.release()
        else:
            pytest.fail("a corrupt ring yielded more frames than it can hold")
        for n in (0, 8, 56):
            try:
                producer.try_write(payload(n, 3))
            except ProtocolError:
                break
    finally:
        for r in rings:
            r.close()
        owner.close()
        owner.unlink()
