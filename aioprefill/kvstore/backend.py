"""The one module that imports Mooncake's store client (`mooncake.store`, from the extra
`aioprefill[transfer]`, the same wheel as the transfer engine) and `xxhash` (the values'
checksum; both in the extra `aioprefill[kvstore]`), with an error that names the fix, and the
store's error codes this package tells apart."""

from __future__ import annotations

import importlib
from typing import Any

from aioprefill.errors import InvalidConfig
from aioprefill.optional import import_mooncake

__all__ = ["RPC_FAIL", "load_store", "load_xxhash", "store_is_down"]

KVSTORE_EXTRA_HINT = "pip install 'aioprefill[kvstore]' (xxhash and Mooncake's store client)"

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that this package tells apart.
NO_SPACE = -200  # NO_AVAILABLE_HANDLE: the pool is full (the master evicts in the background)
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
TRANSFER_FAIL = -800  # the segment holding the object is gone (its client died)
RPC_FAIL = -900  # the master did not answer


def store_is_down(code: int) -> bool:
    """A code that says the master is unreachable (RPC failure, or one of the -1000s: the
    metadata and high-availability errors), as opposed to a failure of one object."""
    return code == RPC_FAIL or code <= -1000


def load_store() -> Any:
    """`mooncake.store.MooncakeDistributedStore`, or InvalidConfig naming what to install (while
    the master is down Mooncake still logs an error line every few seconds, besides this
    package's one warning)."""
    store = import_mooncake("mooncake.store", "EngineConfig.kv_store: Mooncake's store client")
    return store.MooncakeDistributedStore


def load_xxhash() -> Any:
    """The `xxhash` module (XXH3: the checksum of values without `KVStoreOptions.secret`), or
    InvalidConfig naming the extra."""
    try:
        return importlib.import_module("xxhash")
    except ImportError as exc:
        raise InvalidConfig(f"EngineConfig.kv_store: {exc}: {KVSTORE_EXTRA_HINT}") from exc
