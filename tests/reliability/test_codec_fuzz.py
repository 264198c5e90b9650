"""Hypothesis fuzzing of the wire protocol: random, mutated and lying bytes decode to a typed
message whose arrays are consistent, or raise `ProtocolError`; nothing else, ever."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aioprefill.errors import ProtocolError
from aioprefill.shm.ring import Ring
from aioprefill.wire import protocol
from aioprefill.wire.protocol import (
    BatchFailed,
    BatchResult,
    PrefillBatch,
    Ready,
    Shutdown,
    StartFailed,
)

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

int64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def prefill_batches(draw: st.DrawFn) -> PrefillBatch:
    lens = draw(st.lists(st.integers(1, 40), max_size=12))
    n = len(lens)
    offsets = np.cumsum([0, *lens], dtype="<i4")
    return PrefillBatch(
        batch_id=draw(st.integers(0, 2**63 - 1)),
        request_ids=np.array(draw(st.lists(int64, min_size=n, max_size=n)), "<i8").tobytes(),
        offsets=offsets.tobytes(),
        tokens=np.array(
            draw(
                st.lists(
                    st.integers(0, 2**31 - 1), min_size=int(offsets[-1]), max_size=int(offsets[-1])
                )
            ),
            "<i4",
        ).tobytes(),
        start_pos=np.array(
            draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), "<i4"
        ).tobytes(),
        flags=bytes(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))),
        free_ids=np.array(draw(st.lists(int64, max_size=4)), "<i8").tobytes(),
        sent_ns=draw(st.integers(0, 2**63 - 1)),
    )


@st.composite
def batch_results(draw: st.DrawFn) -> BatchResult:
    k = draw(st.integers(0, 12))
    return BatchResult(
        batch_id=draw(st.integers(0, 2**63 - 1)),
        forward_start_ns=draw(st.integers(0, 2**63 - 1)),
        forward_end_ns=draw(st.integers(0, 2**63 - 1)),
        request_ids=np.array(draw(st.lists(int64, min_size=k, max_size=k)), "<i8").tobytes(),
        tokens=np.array(
            draw(st.lists(st.integers(0, 2**31 - 1), min_size=k, max_size=k)), "<i4"
        ).tobytes(),
        logprobs=np.array(draw(st.lists(st.floats(), min_size=k, max_size=k)), "<f8").tobytes(),
    )


small_text = st.text(max_size=40)
to_worker = st.one_of(prefill_batches(), st.just(Shutdown()))
from_worker = st.one_of(
    batch_results(),
    st.builds(
        BatchFailed,
        st.integers(0, 2**63 - 1),
        st.integers(0, 2**63 - 1),
        st.integers(0, 2**63 - 1),
        small_text,
        small_text,
    ),
    st.builds(
        Ready,
        st.integers(0, 64),
        st.integers(1, 2**22),
        small_text,
        st.integers(0, 2**63 - 1),
        st.integers(0, 2**63 - 1),
    ),
    st.builds(StartFailed, st.integers(0, 64), small_text, small_text),
)


def check_engine_side(data: bytes | memoryview) -> None:
    """What the engine does with bytes from a worker: decode, then take the arrays apart."""
    try:
        msg = protocol.decode_from_worker(data)
    except ProtocolError:
        return
    assert isinstance(msg, (Ready, StartFailed, BatchResult, BatchFailed))
    assert isinstance(msg, msgspec.Struct)
    if isinstance(msg, BatchResult):
        try:
            ids, tokens, logprobs = msg.arrays()
        except ProtocolError:
            return
        assert len(ids) == len(tokens) == len(logprobs)


def check_worker_side(data: bytes | memoryview) -> None:
    """What a worker does with bytes from the engine."""
    try:
        msg = protocol.decode_to_worker(data)
    except ProtocolError:
        return
    assert isinstance(msg, (PrefillBatch, Shutdown))
    if isinstance(msg, PrefillBatch):
        try:
            ids, offsets, tokens, start_pos, flags = msg.arrays()
            free = msg.free_array()
        except ProtocolError:
            return
        n = len(ids)
        assert len(offsets) == n + 1 and len(start_pos) == n == len(flags)
        assert offsets[0] == 0 and offsets[-1] == len(tokens)
        assert np.all(np.diff(offsets) > 0) and np.all(start_pos >= 0)
        assert free.dtype == np.dtype("<i8")
        for i in range(n):  # every request's slice lies inside the token blob
            assert 0 <= offsets[i] < offsets[i + 1] <= len(tokens)


def mutate(data: bytes, edits: list[tuple[int, int]], cut: int, extra: bytes) -> bytes:
    out = bytearray(data)
    for pos, value in edits:
        if out:
            out[pos % len(out)] = value
    out = out[: len(out) - cut % (len(out) + 1)] if cut else out
    return bytes(out) + extra


@FUZZ
@given(msg=to_worker)
def test_engine_to_worker_round_trip(msg: PrefillBatch | Shutdown):
    assert protocol.decode_to_worker(protocol.encode(msg)) == msg
    buf = bytearray(8)
    assert protocol.decode_to_worker(protocol.encode_into(msg, buf)) == msg
    check_worker_side(protocol.encode(msg))


@FUZZ
@given(msg=from_worker)
def test_worker_to_engine_round_trip(msg: BatchResult | BatchFailed | Ready | StartFailed):
    decoded = protocol.decode_from_worker(protocol.encode(msg))
    assert type(decoded) is type(msg)
    assert protocol.encode(decoded) == protocol.encode(msg)  # NaN logprobs: compare bytes
    check_engine_side(protocol.encode(msg))


@FUZZ
@given(data=st.binary(max_size=512))
def test_random_bytes_decode_or_raise_protocol_error(data: bytes):
    check_engine_side(data)
    check_worker_side(data)
    check_engine_side(memoryview(data))


@FUZZ
@given(
    msg=st.one_of(to_worker, from_worker),
    edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6),
    cut=st.integers(0, 64),
    extra=st.binary(max_size=16),
)
def test_mutated_messages_decode_or_raise_protocol_error(msg, edits, cut, extra):
    data = mutate(protocol.encode(msg), edits, cut, extra)
    check_engine_side(data)
    check_worker_side(data)


def bin_header(n: int) -> bytes:
    return b"\xc6" + n.to_bytes(4, "big")  # msgpack bin32 with a length of n


@pytest.mark.parametrize("claimed", [1, 2**16, 2**31, 2**32 - 1])
def test_lying_length_fields_raise_protocol_error(claimed: int):
    """A bin field that claims more bytes than the frame holds: refused, nothing allocated."""
    good = BatchResult(1, 2, 3, b"\x00" * 8, b"\x00" * 4, b"\x00" * 8)
    encoded = protocol.encode(good)
    at = encoded.index(b"\xc4\x08")  # bin8 of 8 bytes: the request_ids field
    lying = encoded[:at] + bin_header(claimed) + encoded[at + 2 :]
    with pytest.raises(ProtocolError):
        protocol.decode_from_worker(lying)
    # An array header claiming 2**32-1 elements, and a column that disagrees with the others.
    with pytest.raises(ProtocolError):
        protocol.decode_from_worker(b"\xdd\xff\xff\xff\xff" + encoded[1:])
    short = BatchResult(1, 2, 3, b"\x00" * 16, b"\x00" * 4, b"\x00" * 16)
    with pytest.raises(ProtocolError, match="disagree"):
        protocol.decode_from_worker(protocol.encode(short)).arrays()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"request_ids": b"\x00" * 9}, "whole number"),
        ({"offsets": b"\x00" * 4}, "disagree"),
        ({"offsets": np.array([0, 5], "<i4").tobytes()}, "offsets"),  # past the blob
        ({"offsets": np.array([0, -4], "<i4").tobytes()}, "offsets"),  # backwards
        ({"start_pos": np.array([-1], "<i4").tobytes()}, "negative"),
        ({"tokens": b"\x00" * 6}, "whole number"),
        ({"free_ids": b"\x00" * 3}, "whole number"),
    ],
)
def test_lying_batch_columns_raise_protocol_error(fields: dict, match: str):
    base = {
        "batch_id": 1,
        "request_ids": np.array([7], "<i8").tobytes(),
        "offsets": np.array([0, 2], "<i4").tobytes(),
        "tokens": np.array([1, 2], "<i4").tobytes(),
        "start_pos": np.array([0], "<i4").tobytes(),
        "flags": b"\x03",
    }
    msg = protocol.decode_to_worker(protocol.encode(PrefillBatch(**{**base, **fields})))
    assert isinstance(msg, PrefillBatch)
    with pytest.raises(ProtocolError, match=match):
        msg.arrays()
        msg.free_array()


def _i32(*values: int) -> bytes:
    return np.array(values, "<i4").tobytes()


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"tail_offsets": _i32(0, 2), "tail_hashes": b"\x01" * 8}, "tail offsets"),  # 2 named
        ({"tail_offsets": _i32(0, 1), "tail_hashes": b"\x01" * 12}, "tail columns"),
        ({"tail_offsets": _i32(0), "tail_hashes": b""}, "tail columns"),  # not n + 1
        ({"tail_offsets": b"", "tail_hashes": b"\x01" * 8}, "tail columns"),
        ({"tail_offsets": _i32(1, 1), "tail_hashes": b"\x01" * 8}, "tail offsets"),
    ],
)
def test_lying_tail_columns_raise_protocol_error(fields: dict, match: str):
    base = {
        "batch_id": 1,
        "request_ids": np.array([7], "<i8").tobytes(),
        "offsets": _i32(0, 40),
        "tokens": bytes(160),
        "start_pos": _i32(0),
        "flags": b"\x03",
        **{"read_offsets": _i32(0, 0), "write_offsets": _i32(0, 0), "write_first": _i32(0)},
    }
    good = PrefillBatch(**base, tail_offsets=_i32(0, 2), tail_hashes=_i32(5, 0, 6, 0))
    msg = protocol.decode_to_worker(protocol.encode(good))
    assert isinstance(msg, PrefillBatch)
    cols = msg.cache_arrays()
    assert cols is not None and list(cols[6]) == [0, 2] and list(cols[7]) == [5, 6]
    msg = protocol.decode_to_worker(protocol.encode(PrefillBatch(**{**base, **fields})))
    assert isinstance(msg, PrefillBatch)
    with pytest.raises(ProtocolError, match=match):
        msg.cache_arrays()


@FUZZ
@given(
    frames=st.lists(
        st.tuples(
            st.one_of(from_worker, st.binary(max_size=200)),
            st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=3),
        ),
        max_size=12,
    )
)
def test_ring_frames_of_mutated_messages(frames):
    """The engine's whole read path: frames through a real ring, then the typed decoder."""
    ring = Ring.create(4096, tag="fuzz-codec")
    reader = Ring.attach(ring.name)
    try:
        sent = []
        for payload, edits in frames:
            data = payload if isinstance(payload, bytes) else protocol.encode(payload)
            data = mutate(data, edits, 0, b"")
            if ring.try_write(data):
                sent.append(data)
        for data in sent:
            view = reader.try_read()
            assert view is not None and bytes(view) == data
            try:
                check_engine_side(view)
            finally:
                reader.release()
        assert reader.try_read() is None
    finally:
        reader.close()
        ring.close()
        ring.unlink()
