"""msgspec mirrors of vLLM 0.32's two side-channel structs (`mooncake_connector.py:603-644`):
the decode node sends one `XferMetadata` (msgpack, a map keyed by field name, defaulted fields
omitted) to the prefill node's ZMQ ROUTER; the prefill node answers `XferResponse`.

Same field names, types and defaults as vLLM's, so each side decodes the other's bytes: the
metadata's `req_blocks` maps the decode's request id to `(transfer_id, block ids per KV group)`
(an empty group list is a release-only message: the decode needs nothing, the prefill frees).
"""

from __future__ import annotations

import msgspec

from aioprefill.errors import InvalidRequest

__all__ = [
    "CONTINUE",
    "ERROR",
    "FINISH",
    "XferMetadata",
    "XferResponse",
    "decode_metadata",
    "decode_response",
    "encode",
]

FINISH, CONTINUE, ERROR = 0, 1, 2  # vLLM's MooncakeXferResponseStatus (an IntEnum: a msgpack int)


class XferMetadata(msgspec.Struct, omit_defaults=True):
    """`MooncakeXferMetadata`: "remote" is the decode node, seen from the prefill node."""

    remote_hostname: str
    remote_port: int  # the decode's transfer engine rpc port: session "hostname:port"
    remote_tp_size: int
    remote_tp_rank: int
    req_blocks: dict[str, tuple[str, list[list[int]]]]
    kv_caches_base_addr: list[int]  # one per registered region (a layer)
    block_lens: list[int]  # bytes between blocks of the region
    kv_block_lens: list[int]  # bytes to write per block (the page)
    registered_layer_names: list[str] = msgspec.field(default_factory=list)
    registered_layer_indices: list[int] = msgspec.field(default_factory=list)
    registered_group_indices: list[int] = msgspec.field(default_factory=list)
    registered_shared_group_ids: list[list[int]] = msgspec.field(default_factory=list)
    registered_row_offsets: list[int] = msgspec.field(default_factory=list)
    remote_pp_size: int = 1


class XferResponse(msgspec.Struct, omit_defaults=True):
    """`MooncakeXferResponse`: `status` FINISH / CONTINUE / ERROR."""

    status: int
    ok_reqs: list[str] | None = None
    err_reqs: list[str] | None = None
    err_msg: str | None = None


_encoder = msgspec.msgpack.Encoder()
_metadata = msgspec.msgpack.Decoder(XferMetadata)
_response = msgspec.msgpack.Decoder(XferResponse)


def encode(message: XferMetadata | XferResponse) -> bytes:
    return _encoder.encode(message)


def decode_metadata(payload: bytes) -> XferMetadata:
    """A decode node's message, or InvalidRequest saying what is wrong with it."""
    try:
        return _metadata.decode(payload)
    except msgspec.MsgspecError as exc:
        raise InvalidRequest(f"malformed MooncakeXferMetadata: {exc}") from None


def decode_response(payload: bytes) -> XferResponse:
    try:
        return _response.decode(payload)
    except msgspec.MsgspecError as exc:
        raise InvalidRequest(f"malformed MooncakeXferResponse: {exc}") from None
