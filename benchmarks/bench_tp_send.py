"""What a tensor-parallel group's per-rank rings cost the engine, against a broadcast ring.

`WorkerPool.send` encodes a batch once and, for a group of N ranks, checks every rank's ring for
room and writes the same frame into each (N copies, N eventfd writes). The alternative in issue
10 is one broadcast ring with per-rank read cursors: one copy, N eventfd writes, and room taken
as the minimum over N cursors. This measures, per batch and on the engine's side:

* per-rank rings: exactly what `WorkerPool.send` does for a group (N `has_room` checks, N
  `Channel.send_nowait`), on real shared-memory rings and eventfds;
* broadcast bound: one `Ring.try_write` + N eventfd writes + N room checks, the least a
  broadcast ring could cost (its cursor bookkeeping is left out, so it is a lower bound).

The difference is the most a broadcast ring could save. Frame sizes: a small batch (4 KiB),
a full default batch (max_batch_tokens=8192 int32 tokens plus columns: ~36 KiB) and a 1 MiB
frame. Frames are drained between sends, outside the timed region. Medians over `--n` sends,
taken in interleaved blocks so background load hits both rows alike.

    python benchmarks/bench_tp_send.py [--n 20000] [--ranks 1 2 4 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

from aioprefill.shm import Channel

SIZES = {"4 KiB": 4 << 10, "36 KiB": 36 << 10, "1 MiB": 1 << 20}
CAPACITY = 8 << 20


def per_rank_send(channels: list[Channel], data: bytes) -> None:
    if not all(ch.has_room(len(data)) for ch in channels):
        raise RuntimeError("ring full")
    for ch in channels:
        ch.send_nowait(data)


def broadcast_bound(channels: list[Channel], data: bytes) -> None:
    if not all(ch.has_room(len(data)) for ch in channels):
        raise RuntimeError("ring full")
    ring = channels[0].ring
    assert ring is not None
    ring.try_write(data)
    for ch in channels:
        assert ch.data is not None
        ch.data.notify()


def drain(channels: list[Channel]) -> None:
    for ch in channels:
        while ch.recv_nowait() is not None:
            ch.release()
        assert ch.data is not None and ch.space is not None
        ch.data.drain()
        ch.space.drain()


def measure(send, channels: list[Channel], data: bytes, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        send(channels, data)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        drain(channels)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="sends per row (default 20000)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    blocks = 10
    print(f"engine-side cost of one batch send, median us over {args.n} sends")
    print(f"{'ranks':>5} {'frame':>7} {'per-rank rings':>15} {'broadcast bound':>16} {'saved':>7}")
    for ranks in args.ranks:
        channels = [Channel.create(CAPACITY, tag="tpsend") for _ in range(ranks)]
        try:
            for label, size in SIZES.items():
                data = bytes(size)
                rows: dict[str, list[float]] = {"per-rank": [], "broadcast": []}
                for _ in range(blocks):  # interleaved: noise hits both rows alike
                    rows["per-rank"] += measure(per_rank_send, channels, data, args.n // blocks)
                    rows["broadcast"] += measure(broadcast_bound, channels, data, args.n // blocks)
                a = statistics.median(rows["per-rank"])
                b = statistics.median(rows["broadcast"])
                print(f"{ranks:>5} {label:>7} {a:>15.1f} {b:>16.1f} {a - b:>7.1f}")
        finally:
            for ch in channels:
                ch.close()
                ch.unlink()


if __name__ == "__main__":
    main()
