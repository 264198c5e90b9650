"""vllm-router 0.1.17 `--policy kv_aware` reading `KVEventPublisher`s: two real
`python -m aioprefill.serve --model sim` nodes behind it, token-id prompts. Each node's
publisher here runs on an event loop in a thread and is driven by the test (the stand-in for
its engine's block index): a request whose prefix a node published lands on that node; a block
moved, a gap the router fills from the replay socket, and a node's restart (`AllBlocksCleared`)
all move routing as they should; a restarted router learns the cached blocks from the nodes'
snapshots; block size 32 routes when the router's `--kv-event-block-size` says 32."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from aioprefill.kv_events import KVEventPublisher
from tests.kv_events.router import ROUTER, Router, router
from tests.kv_events.util import endpoints
from tests.serve.test_router import answered
from tests.serve.util import Server, serve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (test extra)"),
]


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Server]]:
    with ExitStack() as stack:
        yield [stack.enter_context(serve("--model", "sim")) for _ in range(2)]


class LoopThread:
    """An event loop in a thread, standing in for each node's engine loop: the publishers
    start on it (so they batch per turn and answer a joining router with a snapshot)."""

    def __init__(self, stack: ExitStack) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        stack.callback(self.stop)

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        async def call() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(30)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


class Cluster:
    def __init__(
        self,
        nodes: list[Server],
        block: int,
        stack: ExitStack,
        *flags: str,
        ring: int = 64,
        store_blocks: int | None = None,
    ) -> None:
        self.nodes, self.block, self.flags = nodes, block, flags
        self.on_loop = LoopThread(stack)
        self.pubs = []
        for _ in nodes:
            ep, replay = endpoints()
            capacity = None if store_blocks is None else (lambda: store_blocks)
            pub = KVEventPublisher(
                ep,
                replay_endpoint=replay,
                block_tokens=block,
                ring_batches=ring,
                store_capacity=capacity,
            )
            self.on_loop.run(pub.start)
            stack.callback(self.on_loop.run, pub.close)
            self.pubs.append(pub)
        self.rng = random.Random(1234)
        self.next_hash = 1
        self.routers = ExitStack()
        stack.callback(self.routers.close)
        self.start_router()

    def start_router(self) -> None:
        """A fresh vllm-router (the previous one killed), once it has read every node (it asks
        each for a replay as it starts, and each answers its subscription with a snapshot)."""
        self.routers.close()
        urls = [n.url for n in self.nodes]
        self.router: Router = self.routers.enter_context(
            router(
                urls, "kv_aware", *self.flags,
                sources={u: p.endpoint for u, p in zip(urls, self.pubs, strict=True)},
                replays={u: p.replay_endpoint for u, p in zip(urls, self.pubs, strict=True)},
            )
        )  # fmt: skip
        deadline = time.monotonic() + 30
        for node in self.nodes:
            while not self.router.advanced(node.url):
                assert time.monotonic() < deadline, self.router.output()[-4000:]
                time.sleep(0.05)

    def publish(self, node: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the publishers' loop, then wait until the router applied the
        batch(es) it sent."""
        url = self.nodes[node].url
        before = self.router.applied(url)
        self.on_loop.run(fn, *args)
        self.router.wait_applied(url, before)

    def store(self, node: int, hashes: list[int], parent: int | None, tokens: list[int]) -> None:
        self.publish(node, self.pubs[node].stored, 0, hashes, parent, tokens)

    def prompt(self, n_blocks: int) -> tuple[list[int], list[int]]:
        """(tokens of n full blocks, their hashes)."""
        tokens = [self.rng.randrange(1, 30000) for _ in range(n_blocks * self.block)]
        hashes = list(range(self.next_hash, self.next_hash + n_blocks))
        self.next_hash += n_blocks
        return tokens, hashes

    def landed(self, tokens: list[int], n: int = 4) -> list[int]:
        """Send `n` requests sharing the prefix `tokens` through the router; how many each
        node answered."""
        before = [answered(node.url) for node in self.nodes]
        for i in range(n):
            r = httpx.post(
                self.router.url + "/v1/completions",
                json={"model": "sim", "prompt": [*tokens, 7, i + 1], "max_tokens": 1},
                timeout=30,
            )
            assert r.status_code == 200, r.text
        return [int(answered(node.url) - b) for node, b in zip(self.nodes, before, strict=True)]


def test_requests_land_on_the_node_that_published_their_prefix(nodes):
    with ExitStack() as stack:
        c = Cluster(nodes, 16, stack)
        a = c.pubs[0]
        run = c.on_loop.run
        p1, h1 = c.prompt(3)
        p2, h2 = c.prompt(3)
        c.store(0, h1, None, p1)
        c.store(1, h2, None, p2)
        assert c.landed(p1) == [4, 0]
        assert c.landed(p2) == [0, 4]

        # the blocks move: evicted on A, stored on B
        c.publish(0, a.removed, 0, h1)
        c.store(1, h1, None, p1)
        assert c.landed(p1) == [0, 4]

        # a batch the router never got (dropped, as a PUB does past its high-water mark) is
        # fetched from A's replay socket when the next batch shows the gap in seq
        p3, h3 = c.prompt(3)
        p4, h4 = c.prompt(2)
        run(lose_a_batch, a, h3, p3)
        c.store(0, h4, None, p4)  # applied after the replay of the lost one
        assert c.landed(p3) == [4, 0]
        assert a.num_replays >= 1

        # A restarts: AllBlocksCleared. B holds p4's first block only: before, A's two blocks
        # win; after, B's one
        c.store(1, h4[:1], None, p4[:16])
        assert c.landed(p4) == [4, 0]
        c.publish(0, a.cleared, 0)
        assert c.landed(p4) == [0, 4]


def test_a_restarted_router_learns_the_cached_blocks_from_a_snapshot(nodes):
    with ExitStack() as stack:
        c = Cluster(nodes, 16, stack, ring=2)
        p, h = c.prompt(3)
        c.store(1, h, None, p)  # B holds 3 blocks
        assert c.landed(p) == [0, 4]
        for _ in range(3):  # B's replay ring (2 batches) forgets that store
            other, oh = c.prompt(1)
            c.store(1, oh, None, other)
        c.start_router()  # knows B's blocks only from B's snapshot when it subscribed
        c.store(0, h[:1], None, p[:16])  # A holds the first, announced live
        assert c.landed(p) == [0, 4]  # without the snapshot: [4, 0]
        assert all(pub.num_snapshots >= 2 for pub in c.pubs)


def test_block_size_32_routes_when_the_router_is_told(nodes):
    with ExitStack() as stack:
        c = Cluster(nodes, 32, stack, "--kv-event-block-size", "32")
        p, h = c.prompt(2)
        c.store(1, h, None, p)
        assert c.landed(p) == [0, 4]


def test_store_backed_blocks_route_at_the_host_tier_credit(nodes):
    """With a store behind the nodes, a block A evicted stays loadable by A: announced "CPU",
    which the router credits at --kv-penalty-host (0.8): more than one block B caches, less
    than the same blocks cached ("GPU")."""
    with ExitStack() as stack:
        c = Cluster(nodes, 16, stack, store_blocks=100)
        a, b = c.pubs
        p, h = c.prompt(3)
        c.store(0, h, None, p)
        c.store(1, h[:1], None, p[:16])
        c.publish(0, a.removed, 0, h[::-1])  # A evicts all three, leaf first
        assert a.blocks.num_store_backed == 3 and len(a.blocks) == 0
        assert c.landed(p) == [4, 0]  # A: 3 x 0.8 > B: 1
        c.store(1, h[1:], h[0], p[16:])  # B caches all three
        assert c.landed(p) == [0, 4]  # B: 3 > A: 3 x 0.8
        c.publish(1, b.removed, 0, h[::-1])  # B evicts them too: 3 x 0.8 each
        c.store(0, h[:1], None, p[:16])  # A caches the first again: 1 + 2 x 0.8
        assert c.landed(p) == [4, 0]


def test_without_a_store_an_evicted_block_routes_nowhere(nodes):
    with ExitStack() as stack:
        c = Cluster(nodes, 16, stack)
        p, h = c.prompt(3)
        c.store(0, h, None, p)
        c.store(1, h[:1], None, p[:16])
        c.publish(0, c.pubs[0].removed, 0, h[::-1])
        assert c.landed(p) == [0, 4]


def lose_a_batch(pub: KVEventPublisher, hashes: list[int], tokens: list[int]) -> None:
    """Store a chain whose batch goes into the replay ring but never onto the wire."""
    real, pub._out = pub._out, _Lost()
    pub.stored(0, hashes, None, tokens)
    pub.flush()
    pub._out = real


class _Lost:
    def send_multipart(self, *args: object, **kwargs: object) -> None:
        pass
