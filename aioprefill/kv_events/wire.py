"""vLLM's KV event wire format, as vllm-router 0.1.17's `--policy kv_aware` reads it.

One ZMQ message per batch of events, three frames::

    frame 0  topic     b"" (the router subscribes to every topic)
    frame 1  seq       8 bytes, big-endian signed; 0, 1, 2, ... per publisher; -1 ends a replay
    frame 2  payload   msgpack array [ts: float, events: [event...], data_parallel_rank: int]

Each event is a msgpack *map* whose "type" names it. The router refuses a whole batch over a
missing or unknown key, so every field below is always written (None as nil):

    BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                      lora_name
    BlockRemoved      block_hashes, medium
    AllBlocksCleared  (no field)

Block hashes are unsigned 64-bit ints (the router refuses a negative one). The router does not
trust them for matching: it hashes `token_ids` itself in blocks of `--kv-event-block-size` and
uses `block_hashes` only to link a block to its parent, so `block_size` must equal the router's
flag (a mismatch matches nothing: measured, see docs/kv-events.md).

A replay (the router's DEALER asks a ROUTER socket after a gap in `seq`) is answered with the
same frames behind the asker's identity and an empty delimiter, then `[identity, b"", topic,
-1, b""]`.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "END_SEQ",
    "MASK64",
    "TOPIC",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "decode_batch",
    "encode_batch",
    "seq_bytes",
]

TOPIC = b""
END_SEQ = -1
MASK64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, tag=True, tag_field="type"):
    """A chain of full blocks now held: `block_hashes[0]`'s parent is `parent_block_hash`
    (None: the chain starts the prompt), each next block's parent the one before it;
    `token_ids` holds the blocks' tokens, `block_size` per block."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type"):
    """Blocks no longer held."""

    block_hashes: list[int]
    medium: str | None = "GPU"


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type"):
    """Every block this publisher announced is gone (a restart)."""


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
    """The payload frame: `[ts, events, data_parallel_rank]`."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """The inverse of `encode_batch` (tests and tools; the router has its own)."""
    return _decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
