"""Shared by the store tests: skip without Mooncake, a tier on a master, blocks to put, a raw
client to tamper with the store, and a gate that holds a store call until released."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from aioprefill.kvstore import KVStoreOptions
from aioprefill.kvstore.identity import StoreIdentity
from aioprefill.kvstore.tier import StoreTier

B = 16
PAYLOAD = 80 * 1024  # about one tiny-Llama block
IDENT = StoreIdentity("tests-model", "float32", "layers=4;kv=4x32;hidden=256", B)


def need_store() -> None:
    """Skip the calling module when Mooncake's store cannot be imported (`python3 dev.py test`
    installs it and Debian's libibverbs1, so CI runs these)."""
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        pytest.skip(
            f"Mooncake's store is not importable ({exc}): pip install 'aioprefill[transfer]' "
            "and apt-get install libibverbs1",
            allow_module_level=True,
        )


def options(master: str, **kw: Any) -> KVStoreOptions:
    base: dict[str, Any] = {
        "master": master,
        "segment_bytes": 32 << 20,
        "put_buffer_bytes": 2 << 20,
        "load_buffer_bytes": 2 << 20,
        "retry_min_s": 0.2,
        "retry_max_s": 0.5,
        "read_latency_s": 0.0,
    }
    return KVStoreOptions(**(base | kw))


def tier(master: str, ident: StoreIdentity = IDENT, up: bool = True, **kw: Any) -> StoreTier:
    t = StoreTier(options(master, **kw), ident, PAYLOAD)
    t.start()
    if up:
        assert t.wait_up(30), "the tier never connected"
    return t


class Blocks:
    """A chain of blocks with random tokens and payloads (seeded; the seed is printed)."""

    def __init__(self, n: int, seed: int, first_hash: int = 1) -> None:
        print(f"Blocks seed={seed}")
        rng = np.random.default_rng(seed)
        self.hashes = [int(x) for x in rng.integers(1, 2**63, n)] if first_hash else []
        self.tokens = [rng.integers(0, 32000, B, dtype=np.int32) for _ in range(n)]
        self.payloads = [rng.integers(0, 256, PAYLOAD, dtype=np.uint8) for _ in range(n)]

    def chain(self) -> list[tuple[int, np.ndarray]]:
        return list(zip(self.hashes, self.tokens, strict=True))

    def offer_all(self, t: StoreTier) -> int:
        return sum(
            t.offer(h, self.tokens[i], [self.payloads[i]]) for i, h in enumerate(self.hashes)
        )

    def load(self, t: StoreTier, n: int | None = None) -> tuple[int, dict[int, bytes]]:
        got: dict[int, bytes] = {}

        def sink(c: int, i: int, payload: memoryview) -> None:
            assert c == 0
            got[i] = bytes(payload)

        (k,) = t.load([self.chain()[:n]], sink)
        assert sorted(got) == list(range(k))
        for i in range(k):
            assert got[i] == self.payloads[i].tobytes(), f"block {i} differs"
        return k, got


def drain(t: StoreTier) -> None:
    """Wait until every staged block was put or refused (every staging slot free again)."""
    q = t.puts
    with q.cond:
        ok = q.cond.wait_for(
            lambda: len(q.free) == len(q.slots) and not q.deferred and q.copying < 0, 30
        )
    assert ok, f"puts never finished: {t.stats}"


class Gate:
    """Wraps one method of the tier's store client: calls wait until `open()`."""

    def __init__(self, t: StoreTier, name: str) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        real: Callable[..., Any] = getattr(t.link.store, name)
        store = t.link.store

        class Proxy:
            def __getattr__(self, attr: str) -> Any:
                return getattr(store, attr)

        def gated(*args: Any, **kw: Any) -> Any:
            self.entered.set()
            self.release.wait(60)
            return real(*args, **kw)

        proxy = Proxy()
        setattr(proxy, name, gated)
        t.link.store = proxy

    def open(self) -> None:
        self.release.set()
