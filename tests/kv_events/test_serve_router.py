"""Real parts end to end: vllm-router 0.1.17 `--policy kv_aware` in front of two
`python -m aioprefill.serve --model sim --kv-events-endpoint ...` nodes, token-id prompts.
A prefix a node computed (sent to it directly) routes every request sharing it to that node,
which reads it from its cache; the router restarts while the nodes keep serving and, from the
nodes' snapshots, still routes by what they hold; a node's worker killed withdraws its blocks
(`AllBlocksCleared`), so routing follows the other node's."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import httpx
import pytest

from tests.kv_events.router import ROUTER, Router, router
from tests.kv_events.util import endpoints
from tests.serve.test_router import answered
from tests.serve.util import Server, gone, serve

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (test extra)"),
]

B = 16


class Node:
    def __init__(self, stack: ExitStack) -> None:
        self.events, self.replay = endpoints()
        self.server: Server = stack.enter_context(
            serve("--model", "sim", "--kv-events-endpoint", self.events,
                  "--kv-events-replay-endpoint", self.replay)
        )  # fmt: skip
        self.url = self.server.url

    def complete(self, tokens: list[int]) -> None:
        r = httpx.post(
            self.url + "/v1/completions",
            json={"model": "sim", "prompt": tokens, "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code == 200, r.text

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith(f"aioprefill_{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"no metric {name}")

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in httpx.get(self.url + "/health").json()["workers"]]


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Node]]:
    with ExitStack() as stack:
        yield [Node(stack) for _ in range(2)]


def start_router(stack: ExitStack, nodes: list[Node]) -> Router:
    r = stack.enter_context(
        router(
            [n.url for n in nodes], "kv_aware",
            sources={n.url: n.events for n in nodes},
            replays={n.url: n.replay for n in nodes},
        )
    )  # fmt: skip
    deadline = time.monotonic() + 30
    for n in nodes:  # each node's snapshot reaches the router as it subscribes
        while not r.advanced(n.url):
            assert time.monotonic() < deadline, r.output()[-4000:]
            time.sleep(0.05)
    return r


def published(r: Router, node: Node, action: Callable[[], object]) -> None:
    """Do `action` (which makes `node` publish), then wait until the router applied it."""
    before = r.applied(node.url)
    action()
    r.wait_applied(node.url, before)


def landed(r: Router, nodes: list[Node], prefix: list[int], n: int = 4) -> list[int]:
    before = [answered(node.url) for node in nodes]
    for i in range(n):
        resp = httpx.post(
            r.url + "/v1/completions",
            json={"model": "sim", "prompt": [*prefix, 7, i + 1], "max_tokens": 1},
            timeout=30,
        )
        assert resp.status_code == 200, resp.text
    return [int(answered(node.url) - b) for node, b in zip(nodes, before, strict=True)]


rng = random.Random(2026)


def prompt(blocks: int) -> list[int]:
    return [rng.randrange(1, 30000) for _ in range(blocks * B)]


def test_a_prefix_routes_to_the_node_that_computed_it(nodes):
    a, b = nodes
    with ExitStack() as stack:
        r = start_router(stack, nodes)
        p, q = prompt(3), prompt(3)
        published(r, a, lambda: a.complete([*p, 1]))  # A computes, caches, publishes p
        published(r, b, lambda: b.complete([*q, 1]))
        hits = a.metric("prefix_cache_hits_total")
        assert landed(r, nodes, p) == [4, 0]
        assert a.metric("prefix_cache_hits_total") - hits == 4 * 3 * B  # read, not computed
        assert landed(r, nodes, q) == [0, 4]


def test_the_router_restarts_while_the_nodes_serve_and_routes_by_their_snapshots(nodes):
    a, b = nodes
    p = prompt(3)
    with ExitStack() as stack:
        start_router(stack, nodes)
        b.complete([*p, 1])
    # no router now: the nodes serve and publish to nobody
    a.complete([*p[:B], 2])  # A holds p's first block only
    b.complete([*p, 3])
    with ExitStack() as stack:
        r = start_router(stack, nodes)  # learns both caches from the nodes' snapshots
        assert landed(r, nodes, p) == [0, 4]  # B's 3 blocks beat A's 1


def test_a_killed_worker_withdraws_its_nodes_blocks(nodes):
    a, b = nodes
    p = prompt(3)
    a.complete([*p[:B], 2])  # A: p's first block
    b.complete([*p, 1])  # B: all three
    with ExitStack() as stack:
        r = start_router(stack, nodes)
        assert landed(r, nodes, p) == [0, 4]
        pids = b.worker_pids()
        # B's engine restarts the worker, its cache empty: AllBlocksCleared
        published(r, b, lambda: os.kill(pids[0], signal.SIGKILL))
        assert gone(pids)
        deadline = time.monotonic() + 60
        while b.worker_pids() == pids or b.metric("prefix_cache_blocks") != 0:
            assert time.monotonic() < deadline, "B's worker did not come back empty"
            time.sleep(0.1)
        assert landed(r, nodes, p) == [4, 0]  # B published AllBlocksCleared: A's 1 block wins
