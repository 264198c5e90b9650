"""`SocketBarrier`: a real barrier between the rank processes of a `SimModel` group.

Simulated ranks run no model, yet a tensor- or expert-parallel step must cost what its slowest
rank costs and a rank that skips a step must block its peers, or scheduling experiments would
lie. Rank 0 listens on the group's master endpoint; every other rank holds one TCP connection to
it (loopback, Nagle off). A barrier is one byte from each peer to rank 0, then one byte back
to each: nobody leaves before the last rank arrived. A peer that died closes its socket (rank 0
reads EOF at once); a peer that never arrives trips the timeout. Either raises
`CollectiveError`. Hand-written instead of gloo/torch.distributed: the point is to need no
Paddle, and a star of sockets is ~60 lines.
"""

from __future__ import annotations

import contextlib
import socket
import struct

from aioprefill.workers.group import CollectiveError, connect_when_listening, split_endpoint

__all__ = ["SocketBarrier"]

_HELLO = struct.Struct("<I")  # a peer's rank, sent once after connecting


class SocketBarrier:
    """Barrier for `size` ranks meeting at `master` ("host:port"); `timeout` bounds every wait."""

    _listener: socket.socket | None = None
    _peers: list[socket.socket] = []

    def __init__(self, rank: int, size: int, master: str, timeout: float) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._peers = []
        try:
            if rank == 0:
                self._accept_peers(master)
            else:
                peer = connect_when_listening(master, timeout)
                self._peers.append(peer)
                self._tune(peer)
                peer.sendall(_HELLO.pack(rank))
        except BaseException:
            self.close()
            raise

    def _accept_peers(self, master: str) -> None:
        host, port = split_endpoint(master)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(self.size)
        self._listener.settimeout(self.timeout)
        by_rank: dict[int, socket.socket] = {}
        try:
            while len(by_rank) < self.size - 1:
                conn, _ = self._listener.accept()
                self._tune(conn)
                (rank,) = _HELLO.unpack(self._recv_exactly(conn, _HELLO.size))
                by_rank[rank] = conn
        except (OSError, CollectiveError) as exc:
            for conn in by_rank.values():
                conn.close()
            raise CollectiveError(f"rank 0 of {self.size}: peers did not all join: {exc}") from exc
        self._peers = [by_rank[r] for r in sorted(by_rank)]

    def _tune(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(self.timeout)

    def _recv_exactly(self, conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise CollectiveError(f"rank {self.rank}: a peer of the group closed its socket")
            data += chunk
        return data

    def wait(self) -> None:
        """Return once every rank of the group called `wait()` for this step."""
        try:
            if self.rank == 0:
                for peer in self._peers:
                    self._recv_exactly(peer, 1)
                for peer in self._peers:
                    peer.sendall(b"\x01")
            elif self._peers:
                self._peers[0].sendall(b"\x01")
                self._recv_exactly(self._peers[0], 1)
        except OSError as exc:  # TimeoutError, ConnectionResetError, BrokenPipeError
            raise CollectiveError(f"rank {self.rank}: barrier failed: {exc!r}") from exc

    def close(self) -> None:
        for conn in self._peers:
            with contextlib.suppress(OSError):
                conn.close()
        self._peers = []
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.close()
            self._listener = None
