"""What publishing KV events costs the engine's loop, at the bench's request rates.

The engine's block index calls `KVEventPublisher.stored` / `removed` on the loop as it plans a
batch; the publisher turns them into the node's events (`NodeBlocks`) and flushes once per loop
turn (one msgpack encode, one non-blocking ZMQ send). This drives exactly that path on an
asyncio loop, a real subscriber draining the PUB socket in another process, and times each loop
turn on the loop's own thread (`time.thread_time`: the ZMQ I/O thread's share is reported
apart), against the same turn with no publisher calls (ABBA blocks; the difference is the cost).

Shapes, one per row:

* `gpu-class sat`: the GPU-class sim's saturation point in
  benchmarks/results/policies/bench_gpu.txt,
  ~500 requests/s in forwards of ~100 requests of ~64 tokens: 4 new blocks per request, each
  stored block evicting one (a full cache), one turn per forward;
* `trace`: the Mooncake synthetic trace's shape (prompts of ~10k tokens: ~600 blocks, of which
  ~half new), one request per turn, evicting as many as it stores.

    python benchmarks/bench_kv_events.py [--turns 300]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import numpy as np

from aioprefill.kv_events import KVEventPublisher

DRAIN = """
import sys, zmq
s = zmq.Context().socket(zmq.SUB); s.setsockopt(zmq.SUBSCRIBE, b""); s.connect(sys.argv[1])
print("ready", flush=True)
while True:
    s.recv_multipart()
"""

SHAPES = {
    # name: (requests per turn, blocks per request, of them new)
    "gpu-class sat": (100, 4, 4),
    "trace": (1, 625, 300),
}
B = 16


class Workload:
    def __init__(self, pub: KVEventPublisher, per_turn: int, blocks: int, new: int) -> None:
        self.pub, self.per_turn, self.blocks, self.new = pub, per_turn, blocks, new
        self.next = 1
        self.live: list[list[int]] = []  # chains in store order (evicted oldest first)
        self.tokens = np.arange(blocks * B, dtype=np.int32)
        self.shared: list[int] = []  # the cached part of each prompt (a shared prefix)

    def turn(self) -> int:
        """One loop turn's publisher calls; returns the events' block count."""
        pub, n = self.pub, 0
        for _ in range(self.per_turn):
            old = self.blocks - self.new
            if len(self.shared) != old:
                self.shared = list(range(self.next, self.next + old))
                self.next += old
                pub.stored(0, self.shared, None, self.tokens[: old * B])
            chain = list(range(self.next, self.next + self.new))
            self.next += self.new
            parent = self.shared[-1] if self.shared else None
            pub.stored(0, chain, parent, self.tokens[old * B :])
            self.live.append(chain)
            n += self.new
            if len(self.live) > 64:  # a full cache: evict as much as was stored
                pub.removed(0, self.live.pop(0))
                n += self.new
        return n


async def measure(per_turn: int, blocks: int, new: int, turns: int, endpoint: str) -> dict:
    pub = KVEventPublisher(endpoint, block_tokens=B, ring_batches=4096)
    pub.start()  # inside the loop: one flush per turn
    drain = subprocess.Popen(
        [sys.executable, "-c", DRAIN, endpoint], stdout=subprocess.PIPE, text=True
    )
    try:
        assert drain.stdout is not None and drain.stdout.readline().strip() == "ready"
        work = Workload(pub, per_turn, blocks, new)
        on: list[float] = []
        off: list[float] = []
        events = 0
        cpu0 = time.process_time()
        thread0 = time.thread_time()
        for i in range(turns):
            publish = i % 4 in (0, 3)  # ABBA
            t = time.thread_time()
            if publish:
                events += work.turn()
            await asyncio.sleep(0)  # the turn ends: the publisher's flush runs
            (on if publish else off).append(time.thread_time() - t)
        loop_cpu = time.thread_time() - thread0
        io_cpu = (time.process_time() - cpu0) - loop_cpu
    finally:
        drain.kill()
        drain.wait()
        pub.close()
    extra = statistics.mean(on) - statistics.mean(off)
    per_block = extra / (events / len(on))
    return {"turn_us": extra * 1e6, "block_us": per_block * 1e6, "io_ms": io_cpu * 1e3,
            "turns": len(on), "blocks": events, "seq": pub.seq}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=400)
    ap.add_argument("--port", type=int, default=39557)
    args = ap.parse_args()
    ep = f"tcp://127.0.0.1:{args.port}"
    print(f"loop-thread cost of KV events, mean over {args.turns // 2} turns vs as many without")
    print(f"{'shape':<15}{'blocks/turn':>12}{'us/turn':>9}{'us/block':>9}{'io-thread ms':>13}")
    for name, (per_turn, blocks, new) in SHAPES.items():
        r = asyncio.run(measure(per_turn, blocks, new, args.turns, ep))
        print(
            f"{name:<15}{r['blocks'] / r['turns']:>12.0f}{r['turn_us']:>9.1f}"
            f"{r['block_us']:>9.2f}{r['io_ms']:>13.1f}"
        )


if __name__ == "__main__":
    main()
