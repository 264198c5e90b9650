"""The bytes of one stored block, and the check every loaded value passes before a single
byte of it reaches a cache slot. A value that fails any check is refused, and the worker
computes the block instead.

Layout (little-endian; `B` = block_tokens, `P` = payload bytes, fixed per identity):

    offset    size  field
    0         8     magic b"AIOPKVB\\0"
    8         2     version (1)
    10        2     checksum kind: 3 XXH3-128, 2 keyed BLAKE2b-128 (`KVStoreOptions.secret`);
                    1 was CRC32 (before XXH3: refused now, like any kind not this node's)
    12        4     B
    16        16    identity digest (`StoreIdentity.digest`: model, dtype, layout, TP rank/size)
    32        8     block hash (the key's, unsigned)
    40        8     P
    48        16    checksum over bytes [0, 48) and [64, end)
    64        4*B   the block's token ids, int32
    64+4*B    P     payload: the slot's bytes, as the worker's block store lays them out

Checked on load: the length, magic, version, kind (must be this node's: an XXH3 value is
refused by a node that has a secret, a CRC32 value by every node), B, the identity, the hash
(the key's), the token ids (the request's own), P, then the checksum. The header and token ids
are compared whole against the bytes they must be (one comparison each; the fields are told
apart only to name why a value is refused). XXH3 (`xxhash`, the kvstore extra) runs at
65-90 GB/s here, zlib's CRC32 (the first kind) at 4-6: a 32 KiB block's check took 9-13 us
with CRC32 and the field-by-field checks, 2-3 us now
(`benchmarks/studies/kvstore/bench_kvstore_checks.py`). The block hash is chained (it names the
parent's hash, and the salt), so the hash and the tokens
together pin the block's place in its prompt.
Written by the put thread; checked by the load thread.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from aioprefill.kvstore.backend import load_xxhash

__all__ = ["HEADER_BYTES", "ValueCodec", "ValueRefused"]

MAGIC = b"AIOPKVB\0"
VERSION = 1
KIND_MAC = 2
KIND_XXH3 = 3
_HEAD = struct.Struct("<8sHHI16sQQ")  # everything before the checksum: 48 bytes
_SUM_AT = _HEAD.size
HEADER_BYTES = _SUM_AT + 16
_U64 = 0xFFFFFFFFFFFFFFFF


class ValueRefused(Exception):
    """A loaded value failed a check (the message says which); the block is computed."""


class ValueCodec:
    """Encodes and checks the values of one identity (`digest`), block size and payload size."""

    __slots__ = (
        "block_tokens", "digest", "kind", "payload_bytes", "secret", "tokens_at", "tokens_end",
        "value_bytes", "xxh3",
    )  # fmt: skip

    def __init__(
        self, digest: bytes, block_tokens: int, payload_bytes: int, secret: bytes | None = None
    ) -> None:
        self.digest = digest
        self.block_tokens = block_tokens
        self.payload_bytes = payload_bytes
        self.secret = secret
        self.kind = KIND_XXH3 if secret is None else KIND_MAC
        self.xxh3 = load_xxhash().xxh3_128 if secret is None else None
        self.tokens_at = HEADER_BYTES
        self.tokens_end = HEADER_BYTES + 4 * block_tokens
        self.value_bytes = self.tokens_end + payload_bytes

    def _checksum(self, value: memoryview) -> bytes:
        if self.xxh3 is not None:
            h = self.xxh3(value[:_SUM_AT])
        else:
            assert self.secret is not None
            h = hashlib.blake2b(value[:_SUM_AT], digest_size=16, key=self.secret)
        h.update(value[HEADER_BYTES:])
        digest: bytes = h.digest()
        return digest

    def _head(self, block_hash: int) -> bytes:
        """The 48 bytes before the checksum, as a value of `block_hash` must have them."""
        return _HEAD.pack(
            MAGIC, VERSION, self.kind, self.block_tokens, self.digest, block_hash & _U64,
            self.payload_bytes,
        )  # fmt: skip

    def write_header(self, value: memoryview, block_hash: int, tokens: np.ndarray) -> memoryview:
        """Fill the header and token ids of `value` (value_bytes long); returns the payload
        view for the caller to copy the slot into. `seal` adds the checksum afterwards."""
        value[:_SUM_AT] = self._head(block_hash)
        np.frombuffer(value[self.tokens_at : self.tokens_end], dtype="<i4")[:] = tokens
        return value[self.tokens_end :]

    def seal(self, value: memoryview) -> None:
        """Write the checksum (off the forward's path: the put thread calls it)."""
        value[_SUM_AT:HEADER_BYTES] = self._checksum(value)

    def check(self, value: memoryview, block_hash: int, tokens: np.ndarray) -> memoryview:
        """The payload of a loaded value, or ValueRefused naming the first check it failed."""
        if len(value) != self.value_bytes:
            raise ValueRefused(f"length {len(value)}, expected {self.value_bytes}")
        if (
            value[:_SUM_AT] != self._head(block_hash)
            or value[self.tokens_at : self.tokens_end] != np.asarray(tokens, dtype="<i4").tobytes()
        ):
            self._why(value, block_hash, tokens)
        if value[_SUM_AT:HEADER_BYTES] != self._checksum(value):
            raise ValueRefused("checksum mismatch")
        return value[self.tokens_end :]

    def _why(self, value: memoryview, block_hash: int, tokens: np.ndarray) -> None:
        """Raise ValueRefused naming the first header field or token id that differs."""
        magic, version, kind, block_tokens, digest, got_hash, payload = _HEAD.unpack_from(value, 0)
        if magic != MAGIC or version != VERSION:
            raise ValueRefused(f"not an aioprefill v{VERSION} block (magic {magic!r} v{version})")
        if kind != self.kind:
            raise ValueRefused(f"checksum kind {kind}, this node uses {self.kind}")
        if block_tokens != self.block_tokens or payload != self.payload_bytes:
            raise ValueRefused(
                f"layout {block_tokens} tokens/{payload} bytes, expected "
                f"{self.block_tokens}/{self.payload_bytes}"
            )
        if digest != self.digest:
            raise ValueRefused("another model, dtype, layout or TP rank")
        if got_hash != block_hash & _U64:
            raise ValueRefused(f"block hash {got_hash:016x}, key says {block_hash & _U64:016x}")
        raise ValueRefused("token ids differ from the request's")
