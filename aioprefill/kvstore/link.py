"""`StoreLink`: one worker's Mooncake Store client, its registered buffers and its health.

The client is made and connected by the put thread (`kvstore.puts`), never by the forward's
thread: Mooncake's `setup` blocks about 90 s when the master is absent (so the thread first
checks that the master's port accepts), and every call blocks about 4 s per retry while a
master that was there is gone. So the forward only reads `up` (an
`Event`): while it is clear the worker computes everything and puts nothing.

Health: any call that fails with an RPC code (`backend.store_is_down`) or passes its deadline
marks the link down. The first time, one warning names the master and says what happens; the
put thread then tries again after `retry_min_s`, doubling up to `retry_max_s` (it waits on its
condition with that timeout: nothing polls while the master is up), and logs once at info
when the store answers again. One warning per outage, however many calls fail in it.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from aioprefill.kvstore.backend import load_store, store_is_down
from aioprefill.kvstore.options import KVStoreOptions

__all__ = ["StoreLink"]

log = logging.getLogger("aioprefill.kvstore")

# Mooncake wants a local buffer for puts and gets from unregistered memory; every transfer
# here uses the registered buffers, so it stays small.
_LOCAL_BUFFER = 16 << 20
_PROBE_KEY = "aiop1/probe"


class StoreLink:
    """The client (None until connected) and whether it is usable now (`up`)."""

    def __init__(self, options: KVStoreOptions, buffers: list[np.ndarray]) -> None:
        self.options = options
        self.buffers = buffers
        self.store: Any = None
        self.up = threading.Event()
        self.tried = threading.Event()  # the first connect attempt ended (either way)
        self.retry_s = options.retry_min_s
        self.warned = False  # this outage was warned about (one warning per outage)
        self.connects = 0
        self.on_down: list[Callable[[], None]] = []  # wakes the put thread to reconnect

    def connect(self) -> bool:
        """Make the client (first time) or ask the master whether it is back. Put thread only;
        may block for as long as Mooncake takes to give up. Sets `tried` either way."""
        try:
            return self._connect()
        finally:
            self.tried.set()

    def _connect(self) -> bool:
        o = self.options
        if self.store is None:
            # Mooncake's setup waits ~90 s for an absent master: knock first, retry later.
            host, _, port = o.master.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
            except OSError as exc:
                self._down(f"nothing listens there: {exc}")
                return False
            store = load_store()()
            rc = store.setup(
                o.host,
                "P2PHANDSHAKE",
                o.segment_bytes,
                _LOCAL_BUFFER,
                o.protocol,
                o.device,
                o.master,
            )
            if rc != 0:
                self._down(f"setup returned {rc}")
                return False
            for buf in self.buffers:
                if buf.nbytes and store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                    self._down("register_buffer failed")
                    return False
            self.store = store
        else:
            rc = self.store.health_check()
            code = self.store.is_exist(_PROBE_KEY) if rc == 0 else -1
            if rc != 0 or code < 0:
                self._down(f"health check {rc}, probe {code}")
                return False
        self.connects += 1
        self.retry_s = self.options.retry_min_s
        if self.warned:
            log.info("Mooncake Store at %s answers again: loading and putting blocks", o.master)
            self.warned = False
        self.up.set()
        return True

    def failed(self, code: int, what: str) -> None:
        """A call returned `code`; marks the link down when it says the master is gone."""
        if store_is_down(code):
            self._down(f"{what} returned {code}")

    def timed_out(self, what: str) -> None:
        self._down(f"{what} took longer than {self.options.load_timeout_s} s")

    def _down(self, why: str) -> None:
        self.up.clear()
        for wake in self.on_down:
            wake()
        if self.warned:
            log.debug("Mooncake Store at %s still unreachable (%s)", self.options.master, why)
            return
        self.warned = True
        log.warning(
            "Mooncake Store at %s is unreachable (%s): computing every block instead; "
            "reconnecting in the background (every %.0f-%.0f s)",
            self.options.master,
            why,
            self.options.retry_min_s,
            self.options.retry_max_s,
        )

    def next_retry_s(self) -> float:
        """How long to wait before the next connect attempt (doubling, capped)."""
        wait = self.retry_s
        self.retry_s = min(self.retry_s * 2, self.options.retry_max_s)
        return wait

    def close(self) -> None:
        """Unmount this worker's segment (only once no thread is inside a call)."""
        self.up.clear()
        store, self.store = self.store, None
        if store is not None:
            try:
                store.close()
            except Exception:
                log.debug("Mooncake Store client close failed", exc_info=True)
