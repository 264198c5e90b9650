"""The one module that imports Mooncake's store client (`mooncake.store`, from the extra
`aioprefill[transfer]`, the same wheel as the transfer engine), with an error that names the
fix, and the store's error codes this package tells apart."""

from __future__ import annotations

from typing import Any

from aioprefill.transfer.backend import import_mooncake

__all__ = ["RPC_FAIL", "load_store", "store_is_down"]

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
