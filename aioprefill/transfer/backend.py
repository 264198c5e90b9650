"""The one module that imports Mooncake's transfer engine (`mooncake.engine`, from the extra
`aioprefill[transfer]`): loading it with an error that names the fix, starting an engine in
P2P-handshake mode (no metadata server: a peer's address is its `host:port`), and the memory
addresses the engine wants.

Mooncake's Python engine has no close(): dropping the last reference destroys it (its
listeners close, its peers' reads fail at once). Its calls return 0 or a negative code.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

from aioprefill.errors import TransferError
from aioprefill.optional import TRANSFER_EXTRA_HINT, import_mooncake

__all__ = ["TRANSFER_EXTRA_HINT", "address_of", "import_mooncake", "load_mooncake", "new_engine"]


def load_mooncake() -> Any:
    """`mooncake.engine`, or InvalidConfig naming what to install."""
    return import_mooncake(
        "mooncake.engine", "EngineConfig.kv_transfer: Mooncake's transfer engine"
    )


def new_engine(host: str, protocol: str, device: str = "") -> tuple[Any, str]:
    """A started transfer engine and its session name (`host:port`, what peers dial)."""
    engine = load_mooncake().TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device)
    if rc != 0:
        raise TransferError(
            f"Mooncake transfer engine failed to start on {host} ({protocol}): {rc}"
        )
    return engine, f"{host}:{engine.get_rpc_port()}"


def address_of(buffer: mmap.mmap) -> int:
    """The address of a mapping's first byte (the ctypes view is dropped at once, so the
    mapping can still be closed)."""
    view = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(view)
    finally:
        del view
