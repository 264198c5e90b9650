"""A stored block's value (`kvstore.value`) round-trips, and every way a value can be wrong
(short, long, foreign model or layout, another block, other tokens, a flipped
bit, an XXH3 value on a node with a secret, a MAC forged without it, a CRC32 value of the
format's first checksum kind) is refused, naming why."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import xxhash

from aioprefill.kvstore.identity import StoreIdentity
from aioprefill.kvstore.value import HEADER_BYTES, ValueCodec, ValueRefused

B, P = 16, 4096
IDENT = StoreIdentity("model-a", "float32", "layers=4;kv=4x32", B)
TOKENS = np.arange(100, 100 + B, dtype=np.int32)
PAYLOAD = np.random.default_rng(7).integers(0, 256, P, dtype=np.uint8)


def encoded(codec: ValueCodec, block_hash: int = 0xABC, tokens: np.ndarray = TOKENS) -> memoryview:
    value = memoryview(bytearray(codec.value_bytes))
    payload = codec.write_header(value, block_hash, tokens)
    payload[:] = PAYLOAD.tobytes()
    codec.seal(value)
    return value


def test_round_trip_gives_the_payload_back():
    codec = ValueCodec(IDENT.digest, B, P)
    assert codec.value_bytes == HEADER_BYTES + 4 * B + P
    got = codec.check(encoded(codec), 0xABC, TOKENS)
    assert bytes(got) == PAYLOAD.tobytes()
    assert bytes(codec.check(encoded(codec), 0xABC, TOKENS)) == PAYLOAD.tobytes()


def test_negative_hashes_are_their_unsigned_form():
    codec = ValueCodec(IDENT.digest, B, P)
    value = encoded(codec, block_hash=-5)
    assert bytes(codec.check(value, 2**64 - 5, TOKENS)) == PAYLOAD.tobytes()
    assert IDENT.key(-5) == IDENT.key(2**64 - 5)


def _flip(value: memoryview, at: int) -> memoryview:
    copy = bytearray(value)
    copy[at] ^= 0x01
    return memoryview(copy)


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda v: v[:-1], "length"),
        (lambda v: memoryview(bytes(v) + b"\0"), "length"),
        (lambda v: _flip(v, 0), "magic"),
        (lambda v: _flip(v, 8), "magic"),  # version
        (lambda v: _flip(v, HEADER_BYTES + 4 * B + 100), "checksum"),  # payload
        (lambda v: _flip(v, HEADER_BYTES - 1), "checksum"),  # the checksum itself
        (lambda v: _flip(v, len(v) - 1), "checksum"),  # the payload's last byte
        (lambda v: _flip(v, 10), "checksum kind"),
        (lambda v: _flip(v, 12), "layout"),  # block tokens
        (lambda v: _flip(v, 16), "another model"),  # identity digest
        (lambda v: _flip(v, 32), "block hash"),
        (lambda v: _flip(v, 40), "layout"),  # payload bytes
        (lambda v: _flip(v, HEADER_BYTES + 4 * B - 1), "token ids"),
    ],
)
def test_damaged_values_are_refused(mutate, why):
    codec = ValueCodec(IDENT.digest, B, P)
    with pytest.raises(ValueRefused, match=why):
        codec.check(mutate(encoded(codec)), 0xABC, TOKENS)


def test_other_blocks_models_and_layouts_are_refused():
    codec = ValueCodec(IDENT.digest, B, P)
    value = encoded(codec)
    with pytest.raises(ValueRefused, match="block hash"):
        codec.check(value, 0xABD, TOKENS)
    with pytest.raises(ValueRefused, match="token ids"):
        codec.check(value, 0xABC, TOKENS + 1)
    for other in (
        StoreIdentity("model-b", "float32", "layers=4;kv=4x32", B),
        StoreIdentity("model-a", "bfloat16", "layers=4;kv=4x32", B),
        StoreIdentity("model-a", "float32", "layers=4;kv=2x32", B),
        StoreIdentity("model-a", "float32", "layers=4;kv=4x32", B, tp_rank=1, tp_size=2),
    ):
        assert other.key(0xABC) != IDENT.key(0xABC)
        with pytest.raises(ValueRefused, match="another model"):
            ValueCodec(other.digest, B, P).check(value, 0xABC, TOKENS)
    with pytest.raises(ValueRefused, match="layout"):
        ValueCodec(IDENT.digest, B, P - 64).check(value[:-64], 0xABC, TOKENS)


def test_the_unkeyed_checksum_is_xxh3_128_over_the_header_and_the_rest():
    codec = ValueCodec(IDENT.digest, B, P)
    value = encoded(codec)
    assert struct.unpack_from("<H", value, 10)[0] == 3  # the checksum kind: XXH3
    want = xxhash.xxh3_128(bytes(value[:48]) + bytes(value[HEADER_BYTES:])).digest()
    assert bytes(value[48:HEADER_BYTES]) == want


def test_a_crc32_value_of_the_first_checksum_kind_is_refused():
    """What nodes before XXH3 wrote (kind 1, CRC32 in the checksum field's first 4 bytes), a
    value otherwise right in every byte: refused by kind, so never trusted on a weaker sum."""
    codec = ValueCodec(IDENT.digest, B, P)
    value = memoryview(bytearray(encoded(codec)))
    struct.pack_into("<H", value, 10, 1)
    crc = zlib.crc32(value[HEADER_BYTES:], zlib.crc32(value[:48]))
    value[48:HEADER_BYTES] = struct.pack("<I12x", crc)
    with pytest.raises(ValueRefused, match="checksum kind 1, this node uses 3"):
        codec.check(value, 0xABC, TOKENS)


def test_a_secret_refuses_xxh3_values_and_macs_made_without_it():
    secret = b"s" * 32
    plain = ValueCodec(IDENT.digest, B, P)
    keyed = ValueCodec(IDENT.digest, B, P, secret)
    assert bytes(keyed.check(encoded(keyed), 0xABC, TOKENS)) == PAYLOAD.tobytes()
    with pytest.raises(ValueRefused, match="checksum kind"):
        keyed.check(encoded(plain), 0xABC, TOKENS)
    forged = ValueCodec(IDENT.digest, B, P, b"f" * 32)  # knows the format, not the secret
    with pytest.raises(ValueRefused, match="checksum mismatch"):
        keyed.check(encoded(forged), 0xABC, TOKENS)
    with pytest.raises(ValueRefused, match="checksum kind"):
        plain.check(encoded(keyed), 0xABC, TOKENS)
