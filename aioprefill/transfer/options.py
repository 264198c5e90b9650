"""`TransferOptions`: how an engine with `EngineConfig(kv_transfer="mooncake")` serves its KV
exports to decode nodes (`EngineConfig.kv_transfer_options`). Validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aioprefill.errors import InvalidConfig

__all__ = ["KV_TRANSFER_BACKENDS", "PROTOCOLS", "TransferOptions"]

KV_TRANSFER_BACKENDS = ("mooncake",)
PROTOCOLS = ("tcp", "rdma")


@dataclass(slots=True, frozen=True, kw_only=True)
class TransferOptions:
    """`host`: the address decode nodes reach this engine at, advertised in every export's
    `transfer_params()` (loopback by default: nothing leaves the host unless asked; note that
    Mooncake's listeners bind every interface whatever this says). `protocol`: "tcp" or "rdma"
    (`device`: the RDMA NICs to use, comma-separated; "" for all). `export_ttl_s`: an open
    export nobody closed or released is closed this long after its result arrived (None:
    never), so a decode node that died mid-pull leaves nothing behind for long."""

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    export_ttl_s: float | None = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host or ":" in self.host:
            raise InvalidConfig(
                f"TransferOptions.host: must be a host name or IPv4 address without a port; "
                f"got {self.host!r}"
            )
        if self.protocol not in PROTOCOLS:
            raise InvalidConfig(
                f"TransferOptions.protocol: must be one of {', '.join(PROTOCOLS)}; "
                f"got {self.protocol!r}"
            )
        if not isinstance(self.device, str):
            raise InvalidConfig(f"TransferOptions.device: must be a str; got {self.device!r}")
        ttl = self.export_ttl_s
        if ttl is not None and (
            isinstance(ttl, bool)
            or not isinstance(ttl, (int, float))
            or not math.isfinite(ttl)
            or ttl <= 0
        ):
            raise InvalidConfig(
                f"TransferOptions.export_ttl_s: must be None or a finite number > 0; got {ttl!r}"
            )
