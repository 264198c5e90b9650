"""`transfer_params()`: the plain-JSON description of a KV export that a decode node pulls
with, and its strict parsing on the decode side (anything malformed is `InvalidRequest`, before
any network traffic).

    {"backend": "mooncake", "version": 1,
     "session": "127.0.0.1:15122",       the prefill engine's transfer engine (host:port)
     "protocol": "tcp",
     "export_id": "9f3c...",             16 hex digits, random per export, never reused
     "id_addr": 140...,                  the export's entry in the engine's id table (32 bytes)
     "addr": 140..., "nbytes": 8192,     keys at addr, values at addr + values_offset
     "values_offset": 4096,
     "layout": {"num_layers": 2, "num_kv_heads": 2, "num_tokens": 16, "head_dim": 16,
                "dtype": "float32", "keys": "rope_applied"}}

Layout as in docs/kv-export.md: C order `[num_layers, num_kv_heads, num_tokens, head_dim]`,
keys after RoPE (HF rotate-half), bfloat16 as uint16 bits.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from aioprefill.errors import InvalidRequest
from aioprefill.wire.kv import KVLayout

__all__ = ["KEYS_ROPE_APPLIED", "VERSION", "LayoutParams", "TransferParams", "parse_params"]

VERSION = 1
KEYS_ROPE_APPLIED = "rope_applied"
_Positive = Annotated[int, msgspec.Meta(gt=0)]
_Address = Annotated[int, msgspec.Meta(gt=0, lt=1 << 62)]


class LayoutParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    num_layers: _Positive
    num_kv_heads: _Positive
    num_tokens: _Positive
    head_dim: _Positive
    dtype: str
    keys: str = KEYS_ROPE_APPLIED

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv_heads, self.num_tokens, self.head_dim)


class TransferParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    backend: str
    version: int
    session: str
    protocol: str
    export_id: str
    id_addr: _Address
    addr: _Address
    nbytes: _Positive
    values_offset: _Positive
    layout: LayoutParams

    @property
    def id_value(self) -> int:
        return int(self.export_id, 16)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise InvalidRequest(f"transfer params: {what}")


def parse_params(params: Any) -> TransferParams:
    """A `transfer_params()` dict (or its JSON text) checked field by field, or InvalidRequest
    saying which field is wrong."""
    try:
        if isinstance(params, (str, bytes)):
            parsed = msgspec.json.decode(params, type=TransferParams)
        else:
            parsed = msgspec.convert(params, TransferParams)
    except msgspec.MsgspecError as exc:
        raise InvalidRequest(f"transfer params: {exc}") from exc
    p, layout = parsed, parsed.layout
    _check(p.backend == "mooncake", f"backend must be 'mooncake', got {p.backend!r}")
    _check(p.version == VERSION, f"version {p.version} is not {VERSION}")
    host, _, port = p.session.rpartition(":")
    _check(bool(host) and port.isdigit() and 0 < int(port) < 65536, f"session {p.session!r}")
    _check(p.protocol in ("tcp", "rdma"), f"protocol {p.protocol!r}")
    _check(
        len(p.export_id) == 16
        and all(c in "0123456789abcdef" for c in p.export_id)
        and p.id_value != 0,
        f"export_id {p.export_id!r} is not 16 lowercase hex digits",
    )
    _check(layout.dtype in ("float32", "float16", "bfloat16"), f"dtype {layout.dtype!r}")
    _check(layout.keys == KEYS_ROPE_APPLIED, f"keys {layout.keys!r}")
    want = layout.kv_layout.nbytes(layout.num_tokens)
    _check(p.nbytes == want, f"nbytes {p.nbytes} disagrees with the layout ({want})")
    _check(p.values_offset == want // 2, f"values_offset {p.values_offset} is not nbytes / 2")
    _check(p.addr + p.nbytes < 1 << 62, "addr + nbytes is past any address")
    return parsed
