"""vllm-router 0.1.17 `--policy kv_aware` reading `KVEventPublisher`s: two real
`python -m aioprefill.serve --model sim` nodes behind it, token-id prompts. Each node's
publisher here is driven by the test (the stand-in for its engine's block index): a request
whose prefix a node published lands on that node; a block moved, a gap the router fills from
the replay socket, and a node's restart (`AllBlocksCleared`) all move routing as they should;
block size 32 routes when the router's `--kv-event-block-size` says 32."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from contextlib import ExitStack

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


class Cluster:
    def __init__(self, nodes: list[Server], block: int, stack: ExitStack, *flags: str) -> None:
        self.nodes, self.block = nodes, block
        self.pubs = []
        for _ in nodes:
            ep, replay = endpoints()
            pub = KVEventPublisher(ep, replay_endpoint=replay, block_tokens=block)
            pub.start()
            stack.callback(pub.close)
            self.pubs.append(pub)
        urls = [n.url for n in nodes]
        self.router: Router = stack.enter_context(
            router(
                urls, "kv_aware", *flags,
                sources={u: p.endpoint for u, p in zip(urls, self.pubs, strict=True)},
                replays={u: p.replay_endpoint for u, p in zip(urls, self.pubs, strict=True)},
            )
        )  # fmt: skip
        self.rng = random.Random(1234)
        self.next_hash = 1
        self.join()

    def join(self) -> None:
        """Heartbeats (AllBlocksCleared of an empty node) until the router has read each
        publisher: a PUB drops what it sends before the SUB's connection is up."""
        deadline = time.monotonic() + 30
        for node, pub in zip(self.nodes, self.pubs, strict=True):
            while not self.router.advanced(node.url):
                assert time.monotonic() < deadline, self.router.output()[-4000:]
                pub.cleared(999)
                time.sleep(0.05)

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
        time.sleep(0.3)  # let the router's subscriber apply what was just published
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
        a, b = c.pubs
        p1, h1 = c.prompt(3)
        p2, h2 = c.prompt(3)
        a.stored(0, h1, None, p1)
        b.stored(0, h2, None, p2)
        assert c.landed(p1) == [4, 0]
        assert c.landed(p2) == [0, 4]

        # the blocks move: evicted on A, stored on B
        a.removed(0, h1)
        b.stored(0, h1, None, p1)
        assert c.landed(p1) == [0, 4]

        # a batch the router never got (dropped, as a PUB does past its high-water mark) is
        # fetched from A's replay socket when the next batch shows the gap in seq
        p3, h3 = c.prompt(3)
        p4, h4 = c.prompt(2)
        real, a._out = a._out, _Lost()
        a.stored(0, h3, None, p3)
        a._out = real
        a.stored(0, h4, None, p4)
        assert c.landed(p3) == [4, 0]
        assert a.num_replays >= 1

        # A restarts: AllBlocksCleared. B holds p4's first block only: before, A's two blocks
        # win; after, B's one
        b.stored(0, h4[:1], None, p4[:16])
        assert c.landed(p4) == [4, 0]
        a.cleared(0)
        assert c.landed(p4) == [0, 4]


def test_block_size_32_routes_when_the_router_is_told(nodes):
    with ExitStack() as stack:
        c = Cluster(nodes, 32, stack, "--kv-event-block-size", "32")
        p, h = c.prompt(2)
        c.pubs[1].stored(0, h, None, p)
        assert c.landed(p) == [0, 4]


class _Lost:
    def send_multipart(self, *args: object, **kwargs: object) -> None:
        pass
