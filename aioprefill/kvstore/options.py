"""`KVStoreOptions`: how an engine with `EngineConfig(kv_store="mooncake")` uses a Mooncake
Store as the second tier behind every worker's prefix cache (`EngineConfig.kv_store_options`).
Validated at construction; every worker (every rank) makes its own client from it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from aioprefill.errors import InvalidConfig

__all__ = ["KV_STORE_BACKENDS", "KVStoreOptions"]

KV_STORE_BACKENDS = ("mooncake",)
_PROTOCOLS = ("tcp", "rdma")


def _bad(name: str, why: str, value: object) -> InvalidConfig:
    return InvalidConfig(f"KVStoreOptions.{name}: {why}; got {value!r}")


def _check_bytes(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(name, f"must be an int >= {minimum}", value)


def _check_seconds(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise _bad(name, "must be a finite number > 0", value)


def _check_address(name: str, value: object, with_port: bool) -> None:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise _bad(name, "must be a non-empty host name or address", value)
    host, sep, port = value.rpartition(":")
    if with_port and not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise _bad(name, "must be HOST:PORT (the master's RPC address)", value)
    if not with_port and sep:
        raise _bad(name, "must be a host name or IPv4 address without a port", value)


@dataclass(slots=True, frozen=True, kw_only=True)
class KVStoreOptions:
    """The Mooncake Store tier of the prefix cache.

    `master`: the `mooncake_master` RPC address (HOST:PORT; port 50051 is its default).
    `host`: the address other clients reach this worker's segment at (loopback by default:
    nothing leaves the host unless asked). `protocol`: "tcp" or "rdma" (`device`: the RDMA
    NICs, comma-separated; "" for all).

    Memory, per worker process (per rank), all allocated once at start:
    `segment_bytes`: what this worker lends to the store (the pool is the sum over every
    client; the master evicts approximately LRU at 90% full). `put_buffer_bytes`: the put
    budget: a block the worker writes is copied here (registered, so the put is zero-copy) and
    put by one background thread; when it is full, the block is not put (counted as dropped):
    a put never blocks a forward. `load_buffer_bytes`: where loads land before they are
    checked and copied into cache slots; it bounds the blocks one forward can load.
    `scratch_blocks`: cache slots each worker adds past the engine's (one block's bytes each,
    allocated lazily, touched as used), for the blocks a batch computes or loads past the
    slots the engine gave it (a prompt longer than the local cache, or whose slots are all
    pinned): written there, they are put like any other, and loads fill them; read by that
    forward only, never indexed. 0: such blocks are computed and never put. (64 SmolLM2
    blocks: 47 MiB.)

    Faults: a forward waits at most `load_timeout_s` for its loads, then computes. After a
    failed call (master killed or unreachable) the worker computes without asking the store,
    warns once, and reconnects in the background after `retry_min_s`, doubling up to
    `retry_max_s`.

    Cost rule: a chain of k blocks is loaded only when reading it (a call's latency + k times
    a block's read time) costs less than computing its k * block_tokens tokens, both measured
    by the worker as it runs; `read_latency_s` and `read_bytes_per_s` are the read side's
    starting values, until its first load (docs/kv-store.md).

    Directory: `peer_events`, the KV event endpoints (`EngineConfig.kv_events_endpoint`,
    `tcp://HOST:PORT`) of every node sharing the store, this one's included: each worker
    subscribes to them and asks the store only for the chains some node announced (computed,
    loaded or evicted: all in the store), which spares the calls that would find nothing
    (`kvstore.directory`). Empty: the cost rule alone decides when to ask.

    Identity: `model_id` names the weights in store keys (default: a digest of the model spec
    and of sampled bytes of its weight files). `secret`: with bytes (>= 16), values carry a
    keyed BLAKE2b MAC instead of an XXH3 checksum, so whoever can write to the store but lacks
    the secret cannot make a node read a block it did not compute.
    """

    master: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    protocol: str = "tcp"
    device: str = ""
    segment_bytes: int = 256 << 20
    put_buffer_bytes: int = 32 << 20
    load_buffer_bytes: int = 32 << 20
    scratch_blocks: int = 64
    load_timeout_s: float = 2.0
    retry_min_s: float = 1.0
    retry_max_s: float = 30.0
    read_bytes_per_s: float = 1.0e9
    read_latency_s: float = 1.0e-3
    model_id: str | None = None
    secret: bytes | None = None
    peer_events: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.peer_events, list):
            object.__setattr__(self, "peer_events", tuple(self.peer_events))
        if not isinstance(self.peer_events, tuple) or not all(
            isinstance(e, str) and e.startswith("tcp://") and ":" in e[6:] for e in self.peer_events
        ):
            raise _bad("peer_events", "must be a tuple of tcp://HOST:PORT", self.peer_events)
        _check_address("master", self.master, with_port=True)
        _check_address("host", self.host, with_port=False)
        if self.protocol not in _PROTOCOLS:
            raise _bad("protocol", f"must be one of {', '.join(_PROTOCOLS)}", self.protocol)
        if not isinstance(self.device, str):
            raise _bad("device", "must be a str", self.device)
        _check_bytes("segment_bytes", self.segment_bytes, 16 << 20)  # Mooncake: -600 below
        _check_bytes("put_buffer_bytes", self.put_buffer_bytes, 0)
        _check_bytes("load_buffer_bytes", self.load_buffer_bytes, 0)
        _check_bytes("scratch_blocks", self.scratch_blocks, 0)
        for name in ("load_timeout_s", "retry_min_s", "retry_max_s", "read_bytes_per_s"):
            _check_seconds(name, getattr(self, name))
        if self.retry_max_s < self.retry_min_s:
            raise _bad(
                "retry_max_s", f"must be >= retry_min_s ({self.retry_min_s})", self.retry_max_s
            )
        lat = self.read_latency_s
        if (
            isinstance(lat, bool)
            or not isinstance(lat, (int, float))
            or not math.isfinite(lat)
            or lat < 0
        ):
            raise _bad("read_latency_s", "must be a finite number >= 0", lat)
        if self.model_id is not None and (
            not isinstance(self.model_id, str) or not self.model_id or len(self.model_id) > 256
        ):
            raise _bad(
                "model_id", "must be None or a non-empty str of at most 256 chars", self.model_id
            )
        if self.secret is not None and (
            not isinstance(self.secret, bytes) or len(self.secret) < 16
        ):
            raise _bad("secret", "must be None or at least 16 bytes", "<redacted>")
