"""Engine <-> worker hand-off over the shared-memory transport, side by side with its floor and
the usual pickle-based peers, in one run.

Each row is one round trip between an asyncio (uvloop) engine process and a spawned worker
process that blocks on its inbound transport: the engine sends a batch, the worker decodes it
and answers with a small result, the engine decodes that. Reported: median and p99 over
`--n` round trips (default 5,000) after 500 warm-up round trips, taken in interleaved blocks so
background load hits every row alike.

Rows and payloads:

* eventfd floor: a bare eventfd ping-pong (loop `add_reader` / blocking read). No payload:
  the wake-up cost any hand-off pays.
* ring, 64-byte frames: `aioprefill.shm.Channel` echoing a 64-byte frame: the transport's
  own cost over the floor (ring bookkeeping, eventfds, Python), without the payload's.
* ring, loop.py pattern: `aioprefill.shm.Channel`; a real `PrefillBatch` of 64 requests x 512
  tokens (columnar int32 blob, ~128 KiB) msgspec-encoded into a reused buffer and written to
  the ring; the worker decodes it (copying out), validates its arrays, answers a 64-result
  `BatchResult`; the engine reads it from an `add_reader` callback, as `loop.py` does.
* ring, await send() / recv(): the same, but the engine awaits `Channel.send()` and
  `Channel.recv()` (the notifier's reader is registered only while waiting).
* Pipe + msgspec: the same encoded bytes over `multiprocessing.Pipe`: isolates the transport.
* Pipe / Queue / ZMQ ipc + pickle: the "natural Python object", a list of 64 lists of 512
  ints, pickled (`Connection.send`, `Queue.put`, `send_pyobj`); the answer is a list of 64
  (token, logprob) tuples.

Then the idle cost: CPU time used by the engine process and by a ring worker while the engine
awaits a result that never comes (`--idle` seconds, default 10), read from getrusage and
/proc/PID/stat.

By default the engine runs on CPU 0 and every worker on CPU 1 (a worker owns its core), so a
round trip pays a cross-CPU wake-up; `--no-pin` lets the scheduler place them.

    python benchmarks/bench_transport.py [--quick] [--n 5000] [--idle 10] [--no-pin]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from multiprocessing.reduction import DupFd

import numpy as np
import uvloop

from aioprefill.shm.channel import Channel, ChannelSpec
from aioprefill.wire import protocol
from aioprefill.wire.protocol import BatchResult, PrefillBatch, Shutdown

NUM_REQUESTS = 64
TOKENS_PER_REQUEST = 512
CAPACITY = 1 << 22  # 4 MiB rings
STOP = 1 << 40  # eventfd value that tells the floor worker to exit


# ---- payloads ---------------------------------------------------------------------------


def make_batch() -> PrefillBatch:
    rng = np.random.default_rng(0)
    n, length = NUM_REQUESTS, TOKENS_PER_REQUEST
    tokens = rng.integers(0, 32000, size=n * length, dtype="<i4")
    return PrefillBatch(
        batch_id=1,
        request_ids=np.arange(n, dtype="<i8").tobytes(),
        offsets=(np.arange(n + 1, dtype="<i4") * length).tobytes(),
        tokens=tokens.tobytes(),
        start_pos=np.zeros(n, dtype="<i4").tobytes(),
        flags=np.full(n, 3, dtype=np.uint8).tobytes(),
    )


def make_result(batch: PrefillBatch) -> BatchResult:
    k = batch.size
    return BatchResult(
        batch_id=batch.batch_id,
        forward_start_ns=0,
        forward_end_ns=0,
        request_ids=batch.request_ids,
        tokens=np.zeros(k, dtype="<i4").tobytes(),
        logprobs=np.zeros(k, dtype="<f8").tobytes(),
    )


def make_lists() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 32000, TOKENS_PER_REQUEST).tolist() for _ in range(NUM_REQUESTS)]


def small_answer(lists: list[list[int]]) -> list[tuple[int, float]]:
    return [(len(x), 0.0) for x in lists]


# ---- workers (spawned) -------------------------------------------------------------------


class PassFd:
    """Reaches the spawned child as the same fd number (DupFd runs while spawn pickles)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (_detach, (DupFd(self.fd),))


def _detach(dup) -> int:  # type: ignore[no-untyped-def]
    return int(dup.detach())


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def floor_worker(fd_in: int, fd_out: int, cpu: int | None) -> None:
    _pin(cpu)
    os.set_blocking(fd_in, True)
    while os.eventfd_read(fd_in) < STOP:
        os.eventfd_write(fd_out, 1)


def ring_worker(
    specs: tuple[ChannelSpec, ChannelSpec], fds: tuple[tuple[int, int], ...], cpu: int | None
) -> None:
    _pin(cpu)
    inbox = Channel.attach(specs[0], *fds[0])
    outbox = Channel.attach(specs[1], *fds[1])
    buffer = bytearray(1 << 12)
    while True:
        view = inbox.recv_blocking()
        assert view is not None
        msg = protocol.decode_to_worker(view)  # copies out of the ring
        inbox.release()
        if isinstance(msg, Shutdown):
            break
        msg.arrays()  # what a worker does first: validate and view the columns
        outbox.send_blocking(protocol.encode_into(make_result(msg), buffer))
    inbox.close()
    outbox.close()


def ring_echo_worker(
    specs: tuple[ChannelSpec, ChannelSpec], fds: tuple[tuple[int, int], ...], cpu: int | None
) -> None:
    _pin(cpu)
    inbox = Channel.attach(specs[0], *fds[0])
    outbox = Channel.attach(specs[1], *fds[1])
    while True:
        view = inbox.recv_blocking()
        assert view is not None
        frame = bytes(view)
        inbox.release()
        if not frame:
            break
        outbox.send_blocking(frame)
    inbox.close()
    outbox.close()


def pipe_bytes_worker(conn, cpu: int | None) -> None:  # type: ignore[no-untyped-def]
    _pin(cpu)
    buffer = bytearray(1 << 12)
    while True:
        msg = protocol.decode_to_worker(conn.recv_bytes())
        if isinstance(msg, Shutdown):
            break
        msg.arrays()
        conn.send_bytes(protocol.encode_into(make_result(msg), buffer))


def pipe_pickle_worker(conn, cpu: int | None) -> None:  # type: ignore[no-untyped-def]
    _pin(cpu)
    while (obj := conn.recv()) is not None:
        conn.send(small_answer(obj))


def queue_worker(q_in, q_out, cpu: int | None) -> None:  # type: ignore[no-untyped-def]
    _pin(cpu)
    while (obj := q_in.get()) is not None:
        q_out.put(small_answer(obj))


def zmq_worker(address: str, cpu: int | None) -> None:
    import zmq

    _pin(cpu)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(address)
    while (obj := sock.recv_pyobj()) is not None:
        sock.send_pyobj(small_answer(obj))
    sock.close(linger=0)
    ctx.term()


# ---- engine side -------------------------------------------------------------------------


class Transport:
    """One row: `start()` spawns its worker, `round_trip()` is timed, `stop()` ends it."""

    name = ""
    payload = ""

    def __init__(self, ctx: mp.context.SpawnContext, cpu: int | None) -> None:
        self.ctx = ctx
        self.cpu = cpu
        self.proc: mp.process.BaseProcess | None = None
        self.loop = asyncio.get_running_loop()

    def spawn(self, target: Callable[..., None], *args: object) -> None:
        self.proc = self.ctx.Process(target=target, args=(*args, self.cpu), daemon=True)
        self.proc.start()

    async def start(self) -> None:
        raise NotImplementedError

    async def round_trip(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    def join(self) -> None:
        if self.proc is not None:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()


class _Readable:
    """A persistent add_reader whose callback resolves the current round trip's future."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, read: Callable[[], object]):
        self.loop, self.fd, self.read = loop, fd, read
        self.fut: asyncio.Future[object] | None = None
        loop.add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        value = self.read()
        if value is not None and self.fut is not None and not self.fut.done():
            self.fut.set_result(value)

    def arm(self) -> asyncio.Future[object]:
        self.fut = self.loop.create_future()
        return self.fut

    def close(self) -> None:
        self.loop.remove_reader(self.fd)


class EventfdFloor(Transport):
    name, payload = "eventfd floor", "none (wake-ups only)"

    async def start(self) -> None:
        self.fd_out = os.eventfd(0)
        self.fd_in = os.eventfd(0, os.EFD_NONBLOCK)
        self.spawn(floor_worker, PassFd(self.fd_out), PassFd(self.fd_in))
        self.reader = _Readable(self.loop, self.fd_in, lambda: os.eventfd_read(self.fd_in))

    async def round_trip(self) -> None:
        fut = self.reader.arm()
        os.eventfd_write(self.fd_out, 1)
        await fut

    async def stop(self) -> None:
        self.reader.close()
        os.eventfd_write(self.fd_out, STOP)
        self.join()
        os.close(self.fd_out)
        os.close(self.fd_in)


class RingCallback(Transport):
    name = "ring, loop.py pattern (add_reader callback)"
    payload = "PrefillBatch 64x512, msgspec"

    async def start(self) -> None:
        self.batch = make_batch()
        self.buffer = bytearray(1 << 18)
        self.inbox = Channel.create(CAPACITY, tag="bench-in")
        self.outbox = Channel.create(CAPACITY, tag="bench-out")
        fds = (
            tuple(PassFd(fd) for fd in self.inbox.fds()),
            tuple(PassFd(fd) for fd in self.outbox.fds()),
        )
        self.spawn(ring_worker, (self.inbox.spec, self.outbox.spec), fds)
        self.reader = _Readable(self.loop, self.outbox.fds()[0], self._read)

    def _read(self) -> object:
        self.outbox.wait_blocking(0)  # consume the eventfd count
        result = None
        while (view := self.outbox.recv_nowait()) is not None:
            try:
                result = protocol.decode_from_worker(view)
            finally:
                self.outbox.release()
        if isinstance(result, BatchResult):
            result.arrays()
        return result

    async def round_trip(self) -> None:
        fut = self.reader.arm()
        if not self.inbox.send_nowait(protocol.encode_into(self.batch, self.buffer)):
            raise RuntimeError("ring full")
        await fut

    async def stop(self) -> None:
        self.reader.close()
        await self.inbox.send(protocol.encode(Shutdown()))
        self.join()
        for ch in (self.inbox, self.outbox):
            ch.close()
            ch.unlink()


class RingAwait(RingCallback):
    name = "ring, await send() / recv()"

    async def start(self) -> None:
        await super().start()
        self.reader.close()

    async def round_trip(self) -> None:
        await self.inbox.send(protocol.encode_into(self.batch, self.buffer))
        view = await self.outbox.recv()
        try:
            result = protocol.decode_from_worker(view)
        finally:
            self.outbox.release()
        assert isinstance(result, BatchResult)
        result.arrays()

    async def stop(self) -> None:
        self.reader = _Readable(self.loop, self.outbox.fds()[0], lambda: None)
        await super().stop()


class RingSmall(Transport):
    name, payload = "ring, 64-byte frames", "64 raw bytes each way"

    async def start(self) -> None:
        self.frame = bytes(range(64))
        self.inbox = Channel.create(1 << 16, tag="bench-small-in")
        self.outbox = Channel.create(1 << 16, tag="bench-small-out")
        fds = (
            tuple(PassFd(fd) for fd in self.inbox.fds()),
            tuple(PassFd(fd) for fd in self.outbox.fds()),
        )
        self.spawn(ring_echo_worker, (self.inbox.spec, self.outbox.spec), fds)
        self.reader = _Readable(self.loop, self.outbox.fds()[0], self._read)

    def _read(self) -> object:
        self.outbox.wait_blocking(0)
        result = None
        while (view := self.outbox.recv_nowait()) is not None:
            result = bytes(view)
            self.outbox.release()
        return result

    async def round_trip(self) -> None:
        fut = self.reader.arm()
        if not self.inbox.send_nowait(self.frame):
            raise RuntimeError("ring full")
        await fut

    async def stop(self) -> None:
        self.reader.close()
        await self.inbox.send(b"")
        self.join()
        for ch in (self.inbox, self.outbox):
            ch.close()
            ch.unlink()


class PipeBytes(Transport):
    name, payload = "Pipe + msgspec", "PrefillBatch 64x512, msgspec"

    async def start(self) -> None:
        self.batch = make_batch()
        self.buffer = bytearray(1 << 18)
        self.conn, child = self.ctx.Pipe()
        self.spawn(pipe_bytes_worker, child)
        child.close()
        self.reader = _Readable(self.loop, self.conn.fileno(), self._read)

    def _read(self) -> object:
        result = protocol.decode_from_worker(self.conn.recv_bytes())
        assert isinstance(result, BatchResult)
        result.arrays()
        return result

    async def round_trip(self) -> None:
        fut = self.reader.arm()
        self.conn.send_bytes(protocol.encode_into(self.batch, self.buffer))
        await fut

    async def stop(self) -> None:
        self.reader.close()
        self.conn.send_bytes(protocol.encode(Shutdown()))
        self.join()
        self.conn.close()


class PipePickle(Transport):
    name, payload = "Pipe + pickle", "64 lists of 512 ints, pickle"

    async def start(self) -> None:
        self.lists = make_lists()
        self.conn, child = self.ctx.Pipe()
        self.spawn(pipe_pickle_worker, child)
        child.close()
        self.reader = _Readable(self.loop, self.conn.fileno(), self.conn.recv)

    async def round_trip(self) -> None:
        fut = self.reader.arm()
        self.conn.send(self.lists)
        await fut

    async def stop(self) -> None:
        self.reader.close()
        self.conn.send(None)
        self.join()
        self.conn.close()


class QueuePickle(Transport):
    name, payload = "multiprocessing.Queue + pickle", "64 lists of 512 ints, pickle"

    async def start(self) -> None:
        import queue

        self.lists = make_lists()
        self.q_in, self.q_out = self.ctx.Queue(), self.ctx.Queue()
        self.spawn(queue_worker, self.q_in, self.q_out)

        def read() -> object:
            try:
                return self.q_out.get_nowait()
            except queue.Empty:
                return None

        self.reader = _Readable(self.loop, self.q_out._reader.fileno(), read)  # type: ignore[attr-defined]

    async def round_trip(self) -> None:
        fut = self.reader.arm()
        self.q_in.put(self.lists)
        await fut

    async def stop(self) -> None:
        self.reader.close()
        self.q_in.put(None)
        self.join()
        for q in (self.q_in, self.q_out):
            q.close()
            q.join_thread()


class ZmqPickle(Transport):
    name, payload = "ZMQ ipc + pickle", "64 lists of 512 ints, pickle"

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        self.lists = make_lists()
        self.ctx_zmq = zmq.asyncio.Context()
        self.sock = self.ctx_zmq.socket(zmq.PAIR)
        address = f"ipc:///tmp/aioprefill-bench-{os.getpid()}.sock"
        self.sock.bind(address)
        self.spawn(zmq_worker, address)

    async def round_trip(self) -> None:
        await self.sock.send_pyobj(self.lists)
        await self.sock.recv_pyobj()

    async def stop(self) -> None:
        await self.sock.send_pyobj(None)
        self.join()
        self.sock.close(linger=0)
        self.ctx_zmq.term()


ROWS: list[type[Transport]] = [
    EventfdFloor,
    RingSmall,
    RingCallback,
    RingAwait,
    PipeBytes,
    PipePickle,
    QueuePickle,
    ZmqPickle,
]


# ---- measurement -------------------------------------------------------------------------


async def timed(rt: Callable[[], Awaitable[None]], n: int, out: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        await rt()
        out.append(clock() - t0)


def proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read()
    fields = raw[raw.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def self_cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def idle_cost(seconds: float, cpu: int | None) -> tuple[float, float]:
    """CPU seconds per second used by the engine and a ring worker while both wait."""
    loop = asyncio.get_running_loop()
    ring = RingAwait(mp.get_context("spawn"), cpu)
    await ring.start()
    await ring.round_trip()  # the worker is up and blocked on its inbox
    assert ring.proc is not None and ring.proc.pid is not None
    waiter = loop.create_task(ring.outbox.wait_async())  # a result that never comes
    await asyncio.sleep(0.2)
    engine0, worker0 = self_cpu_seconds(), proc_cpu_seconds(ring.proc.pid)
    await asyncio.sleep(seconds)
    engine1, worker1 = self_cpu_seconds(), proc_cpu_seconds(ring.proc.pid)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    await ring.stop()
    return (engine1 - engine0) / seconds, (worker1 - worker0) / seconds


async def main(args: argparse.Namespace) -> None:
    ncpu = len(os.sched_getaffinity(0))
    pin = args.pin and ncpu >= 2
    engine_cpu, worker_cpu = sorted(os.sched_getaffinity(0))[:2] if pin else (None, None)
    if engine_cpu is not None:
        os.sched_setaffinity(0, {engine_cpu})
    ctx = mp.get_context("spawn")
    rows = [cls(ctx, worker_cpu) for cls in ROWS]
    for row in rows:
        await row.start()
    samples: dict[str, list[int]] = {row.name: [] for row in rows}
    try:
        for row in rows:  # warm-up, also waits for each worker to be up
            await timed(row.round_trip, args.warmup, [])
        blocks = 10
        for _ in range(blocks):
            for row in rows:
                await timed(row.round_trip, args.n // blocks, samples[row.name])
    finally:
        for row in rows:
            await row.stop()
    engine_idle, worker_idle = await idle_cost(args.idle, worker_cpu)

    placement = f"engine on CPU {engine_cpu}, workers on CPU {worker_cpu}" if pin else "unpinned"
    print(
        f"\nPython {sys.version.split()[0]}, uvloop, {os.cpu_count()} CPUs, {placement}; "
        f"{args.n} round trips per row after {args.warmup} warm-up, interleaved\n"
    )
    floor = statistics.median(samples[EventfdFloor.name])
    ring = statistics.median(samples[RingCallback.name])
    print("| transport | payload | median µs | p99 µs | median / floor | median / ring |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        s = np.array(samples[row.name]) / 1000
        med, p99 = float(np.median(s)), float(np.percentile(s, 99))
        print(
            f"| {row.name} | {row.payload} | {med:.1f} | {p99:.1f} | "
            f"{med * 1000 / floor:.2f}x | {med * 1000 / ring:.2f}x |"
        )
    print(
        f"\nIdle over {args.idle:.0f} s (a ring worker blocked on its inbox, the engine awaiting "
        f"its outbox): engine {engine_idle * 100:.3f}% CPU, worker {worker_idle * 100:.3f}% CPU"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=5000, help="timed round trips per row")
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--idle", type=float, default=10.0, help="seconds of idle measurement")
    p.add_argument("--quick", action="store_true", help="--n 1000 --warmup 100 --idle 2")
    p.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="let the scheduler place engine and workers",
    )
    args = p.parse_args()
    if args.quick:
        args.n, args.warmup, args.idle = 1000, 100, 2.0
    return args


if __name__ == "__main__":
    uvloop.run(main(parse_args()))
