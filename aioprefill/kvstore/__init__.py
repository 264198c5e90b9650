"""Mooncake Store as the second tier of the prefix cache (`EngineConfig(kv_store="mooncake",
kv_store_options=KVStoreOptions(master=...))`): blocks a worker computes are put into a
cluster-wide pool off the forward's path, and a worker missing a prefix reads the longest
chain the pool holds into its own cache slots when that is cheaper than computing it.

`KVStoreOptions` is the public name (also `from aioprefill import KVStoreOptions`); the
worker side is `kvstore.tier.StoreTier`. docs/kv-store.md says what it guarantees.
"""

from __future__ import annotations

from aioprefill.kvstore.options import KV_STORE_BACKENDS, KVStoreOptions

__all__ = ["KV_STORE_BACKENDS", "KVStoreOptions"]
