"""What every rank group shares, Paddle or not: where its ranks meet, and how it fails.

The engine picks a free localhost port per group (`free_port`) and sends it to every rank as
`WorkerSpec.master`; rank 0 listens there (Paddle's TCP store, or `SocketBarrier`), the others
connect. A collective that cannot finish (a peer died, or hung past the timeout) raises
`CollectiveError`: the group is broken for good, so the rank exits with `EXIT_GROUP_BROKEN` and
the engine restarts the whole group. No import of paddle here: the engine uses this module.
"""

from __future__ import annotations

import socket
import time

__all__ = [
    "EXIT_GROUP_BROKEN",
    "CollectiveError",
    "connect_when_listening",
    "free_port",
    "split_endpoint",
]

# The exit code of a rank whose group broke under it (sysexits' EX_TEMPFAIL: restart it).
EXIT_GROUP_BROKEN = 75


class CollectiveError(RuntimeError):
    """A collective between ranks failed: a peer died or did not join within the timeout."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's pick), for a group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' -> (host, port)."""
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def connect_when_listening(endpoint: str, timeout: float) -> socket.socket:
    """Connect to rank 0's listener, retrying while it is not up yet (start-up only: rank 0 may
    still be importing its model). Raises `CollectiveError` after `timeout` seconds."""
    host, port = split_endpoint(endpoint)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, timeout))
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise CollectiveError(f"rank 0 never listened on {endpoint}: {exc}") from exc
            time.sleep(0.01)
