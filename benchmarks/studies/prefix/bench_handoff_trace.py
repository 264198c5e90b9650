"""Where a bubble goes, step by step, prefix cache on vs off (no reuse), A B B A.

A debugging harness: nothing in the library changes. It wraps, in this process only, the
functions on the path from "the worker's eventfd fires" to "the next batch is in the ring"
(`Engine._on_forward_done`, `WorkerPool.answer_waiting`, `Scheduler.dispatch`,
`StagedBatch.planned`, `Columns.pack`, `protocol.encode_into`, the ring write), stamping each
with `time.monotonic_ns()` (CLOCK_MONOTONIC: the workers' `forward_start_ns` / `forward_end_ns`
are on the same clock), and in the worker (spawned: it re-imports this module as
`__mp_main__`) the moment its answer is in the ring and the moment it wakes for the next batch,
into a preallocated memory-mapped array. Garbage collections of both processes are stamped too
(`gc.callbacks`), so a collection inside a hand-off shows.

Per backlogged hand-off (the next batch waited when the forward ended), the mean and the
median of each step, us (each column: from the stamp before to this one):

    answer   forward end -> answer in the ring (worker: result built, encoded, written)
    wake     -> the engine's callback (eventfd wake-up, or its loop busy elsewhere)
    peek     -> Scheduler.dispatch (answer peeked, `release`, the policy)
    plan     -> StagedBatch.planned returned (cache on only)
    pre      -> Columns.pack called;  pack;  enc (msgspec)
    ring     -> ring copy + eventfd write returned (the woken worker often runs first)
    wwake    -> the worker woke (negative when it ran before the engine's write returned)
    decode   -> the next forward starts (recv + decode)
    commit, rest: after the ring write (the scheduler's commit; the answer's decoding)

Each wrapper costs ~1-3 us of stamps; `plan` is the one step only the cache arm runs.
One `SimModel` worker, the bench's `gpu-class` cost model, prompts lognormal(64, 0.5) tokens,
unique; two loads: Poisson at RATE/s (0.8x of eager capacity: 59/s) and saturation (229
closed-loop clients). uvloop, as the bench.

    python benchmarks/studies/prefix/bench_handoff_trace.py [on,off,off,on] [--seconds 6] \
        [--rate 59]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import time

import numpy as np

from aioprefill.shm.channel import Channel

_TRACE = "AIOPREFILL_HANDOFF_TRACE"  # the worker's stamp file (set by the parent per engine)
_SLOTS = 1 << 16
_PIN = "AIOPREFILL_HANDOFF_PIN"  # pin the worker to this CPU (the experiment below)


def _worker_side() -> None:
    """In a spawned worker: stamp each answer written and each wake-up for a batch."""
    path = os.environ.get(_TRACE)
    if not path:
        return
    stamps = np.memmap(path, dtype=np.int64, mode="r+", shape=(3, _SLOTS))
    if os.environ.get(_PIN):  # the worker on this CPU (the run's parent pinned elsewhere)
        os.sched_setaffinity(0, {int(os.environ[_PIN])})
    count = [0, 0, 0]  # answers, wakes, gcs
    now = time.monotonic_ns
    send_blocking, wait_blocking = Channel.send_blocking, Channel.wait_blocking

    def sent(self: Channel, *parts: object, **kw: object) -> bool:
        ok = send_blocking(self, *parts, **kw)  # type: ignore[arg-type]
        i = count[0] = count[0] + 1
        stamps[0, i % _SLOTS] = now()
        stamps[0, 0] = i
        return ok

    def woke(self: Channel, *args: object) -> object:
        t = now()
        if args == (0,):
            i = count[1] = count[1] + 1
            stamps[1, i % _SLOTS] = t
            stamps[1, 0] = i
        return wait_blocking(self, *args)

    gc_start = [0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_start[0] = now()
            return
        i = count[2] = count[2] + 2
        stamps[2, i - 1], stamps[2, i] = gc_start[0], now()
        stamps[2, 0] = i

    Channel.send_blocking = sent  # type: ignore[method-assign]
    Channel.wait_blocking = woke  # type: ignore[method-assign]
    gc.callbacks.append(on_gc)


if __name__ == "__mp_main__":
    _worker_side()


class EngineStamps:
    """The engine side: one list of (label, ns) per `_on_forward_done`, keyed by the batch it
    sent."""

    def __init__(self) -> None:
        self.cur: list[tuple[str, int]] | None = None
        self.by_batch: dict[int, list[tuple[str, int]]] = {}
        self.gcs: list[tuple[int, int]] = []
        self._gc_start = 0

    def stamp(self, label: str) -> None:
        if self.cur is not None:
            self.cur.append((label, time.monotonic_ns()))

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.monotonic_ns()
        else:
            self.gcs.append((self._gc_start, time.monotonic_ns()))

    def install(self) -> None:
        from aioprefill.engine.loop import Engine
        from aioprefill.engine.pool import pool as pool_mod
        from aioprefill.sched.batching import StagedBatch
        from aioprefill.sched.columns import Columns
        from aioprefill.sched.scheduler import Scheduler
        from aioprefill.wire import protocol

        st = self
        now = time.monotonic_ns

        def wrap(owner: object, name: str, before: str | None, after: str | None) -> None:
            fn = getattr(owner, name)

            def wrapped(*args: object, **kwargs: object) -> object:
                if before is not None:
                    st.stamp(before)
                out = fn(*args, **kwargs)
                if after is not None:
                    st.stamp(after)
                return out

            setattr(owner, name, wrapped)

        on_done = Engine._on_forward_done

        def on_forward_done(self: Engine, slot: object) -> None:
            st.cur = [("callback", now())]
            try:
                on_done(self, slot)
            finally:
                cur, st.cur = st.cur, None
                cur.append(("callback done", now()))
                for label, value in cur:
                    if label == "batch":
                        st.by_batch[value] = cur

        Engine._on_forward_done = on_forward_done  # type: ignore[method-assign]
        wrap(pool_mod.WorkerPool, "answer_waiting", None, "answer peeked")
        wrap(Scheduler, "dispatch", "dispatch", "dispatched")
        wrap(StagedBatch, "planned", None, "planned")
        wrap(Columns, "pack", "pack", "packed")
        wrap(protocol, "encode_into", None, "encoded")
        send_nowait = Channel.send_nowait

        def sent(self: Channel, *parts: object) -> bool:
            ok = send_nowait(self, *parts)
            st.stamp("ring written")
            return ok

        Channel.send_nowait = sent  # type: ignore[method-assign]
        pool_send = pool_mod.WorkerPool.send

        def pool_sent(self: object, *args: object, **kwargs: object) -> object:
            batch = pool_send(self, *args, **kwargs)  # type: ignore[arg-type]
            if batch is not None and st.cur is not None:
                st.cur.append(("batch", batch.batch_id))  # type: ignore[attr-defined]
            return batch

        pool_mod.WorkerPool.send = pool_sent  # type: ignore[method-assign]
        gc.callbacks.append(self.on_gc)


STEPS = (  # (stamp, column): each column is the time from the stamp before to this one
    ("answer in ring", "answer"),  # fwd end -> answer in the ring (worker)
    ("callback", "wake"),  # -> the engine's callback runs
    ("dispatch", "peek"),  # -> Scheduler.dispatch (answer peeked, release, policy)
    ("planned", "plan"),  # -> the staged plan's columns ready (cache on only)
    ("pack", "pre"),  # -> Columns.pack called
    ("packed", "pack"),  # -> PrefillBatch made
    ("encoded", "enc"),  # -> msgspec encode
    ("ring written", "ring"),  # -> ring copy + eventfd write
    ("woke", "wwake"),  # -> the worker woke (may precede "ring written" on a busy host)
    ("start", "decode"),  # -> the next forward starts (recv + decode)
)
AFTER = (("dispatched", "commit"), ("callback done", "rest"))  # after the ring write
WORST = 5  # the longest gaps listed per run


async def run(cache_on: bool, load: str, seconds: float, rate: float, st: EngineStamps) -> str:
    from aioprefill import Engine, EngineConfig, SimModel

    model = SimModel(fixed_ms=10.9, per_token_us=25.7, attn_ns=0.69, vocab_size=32000)
    cfg = EngineConfig(model=model) if cache_on else EngineConfig(model=model, prefix_cache_bytes=0)
    rng = np.random.default_rng(time.time_ns())
    path = f"/tmp/handoff_{os.getpid()}.bin"
    np.memmap(path, dtype=np.int64, mode="w+", shape=(3, _SLOTS)).flush()
    os.environ[_TRACE] = path
    results = []
    st.by_batch.clear()
    st.gcs.clear()

    count = int(max(rate, 600) * seconds) + 500  # unique prompts: enough for saturation too
    lengths = np.clip(rng.lognormal(np.log(64), 0.5, count), 1, 8192).astype(np.int64)
    blob = rng.integers(1, 32000, int(lengths.sum()), dtype=np.int32)
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    pool = iter([blob[bounds[i] : bounds[i + 1]] for i in range(len(lengths))])

    def prompt() -> np.ndarray:
        return next(pool)  # unique: no prompt comes twice

    async with Engine(cfg) as engine:
        await asyncio.gather(*(engine.prefill(prompt()) for _ in range(50)))
        t0 = time.monotonic()
        end = t0 + seconds
        if load == "sat":

            async def client() -> None:
                while time.monotonic() < end:
                    results.append(await engine.prefill(prompt()))

            await asyncio.gather(*(client() for _ in range(229)))
        else:
            arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * seconds)))

            async def one(at: float) -> None:
                await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                results.append(await engine.prefill(prompt()))

            await asyncio.gather(*(one(a) for a in arrivals))
        del os.environ[_TRACE]
    stamps = np.memmap(path, dtype=np.int64, mode="r", shape=(3, _SLOTS))
    sent_at = stamps[0, 2 : int(stamps[0, 0]) + 1]  # (the first is Ready)
    wakes = np.sort(stamps[1, 1 : int(stamps[1, 0]) + 1])
    wgcs = stamps[2, 1 : int(stamps[2, 0]) + 1].reshape(-1, 2)
    os.unlink(path)
    fwd = {r.batch_id: (r.forward_start_ns, r.forward_end_ns) for r in results}
    steps: dict[str, list[float]] = {label: [] for label, _ in STEPS}
    gaps, gc_hit, wgc_hit, clean = [], 0, 0, []
    for batch_id, cur in st.by_batch.items():
        prev = batch_id - 1
        if prev not in fwd or batch_id not in fwd or prev < 1:
            continue
        # batch ids are 1.. in send order; the worker's k-th answer is batch k's
        if prev - 1 >= len(sent_at):
            continue
        start, _ = fwd[batch_id]
        _, prev_end = fwd[prev]
        t = {label: v for label, v in cur}
        t["answer in ring"] = int(sent_at[prev - 1])
        i = int(np.searchsorted(wakes, start, side="right")) - 1
        t["woke"] = int(wakes[i]) if i >= 0 else start
        t["start"] = start
        if not prev_end <= t["answer in ring"] <= t["callback"] <= start:
            continue  # not an early hand-off of this forward's end (an idle worker's batch)
        last = prev_end
        for label, _ in STEPS:
            v = t.get(label, last)
            steps[label].append((v - last) / 1e3)
            last = v
        last = t["ring written"]
        for label, _ in AFTER:
            steps.setdefault(label, []).append((t[label] - last) / 1e3)
            last = t[label]
        gaps.append((start - prev_end) / 1e3)
        hit = any(a < start and b > prev_end for a, b in st.gcs)
        gc_hit += hit
        if not hit:
            clean.append(gaps[-1])
        wgc_hit += any(a < start and b > prev_end for a, b in wgcs)
    n = len(gaps)
    head = (
        f"{'on' if cache_on else 'off'} {load}: {len(results) / seconds:.1f} req/s, "
        f"{n} hand-offs, GC inside: engine {gc_hit} worker {wgc_hit}, "
        f"load {os.getloadavg()[0]:.1f}; engine GCs {len(st.gcs)} "
        f"({sum(b - a for a, b in st.gcs) / 1e6:.1f} ms, max "
        f"{max((b - a for a, b in st.gcs), default=0) / 1e3:.0f} us); "
        f"gap mean without a GC inside {statistics.mean(clean):.0f} us"
    )
    # The longest gaps between consecutive batches while work waited (a request of the later
    # one had arrived before the earlier one ended; any hand-off, not only the early ones
    # above), and what overlapped them.
    arrived: dict[int, int] = {}
    for r in results:
        arrived[r.batch_id] = min(arrived.get(r.batch_id, r.submitted_ns), r.submitted_ns)
    worst, waited = [], []
    for batch_id, (start, _) in fwd.items():
        prev = fwd.get(batch_id - 1)
        if prev is not None and arrived[batch_id] < prev[1]:
            waited.append((start - prev[1]) / 1e3)
        if prev is not None and start - prev[1] > 1_000_000 and arrived[batch_id] < prev[1]:
            a, b = prev[1], start
            gcs = [round((y - x) / 1e3) for x, y in st.gcs if x < b and y > a]
            wgc = [round((y - x) / 1e3) for x, y in wgcs if x < b and y > a]
            worst.append(((b - a) / 1e3, batch_id, batch_id in st.by_batch, gcs, wgc, a))
    worst.sort(reverse=True)
    for gap, batch_id, early, gcs, wgc, a in worst[:WORST]:
        head += (f"\n  gap {gap:8.0f} us before batch {batch_id} (early hand-off: {early}); "
                 f"engine GCs inside (us): {gcs}; worker GCs: {wgc}")  # fmt: skip
        if early:  # the engine's stamps, us after the earlier forward's end
            marks = ", ".join(f"{k} {(v - a) / 1e3:.0f}" for k, v in st.by_batch[batch_id]
                              if k != "batch")  # fmt: skip
            head += f"\n    {marks}"
    head += f"\n  gaps over 1 ms: {len(worst)}"
    if waited:  # every gap while work waited (the bench's bubble), not only early hand-offs
        q = np.percentile(waited, [50, 90, 99])
        head += (f"\n  all gaps while work waited: {len(waited)}, mean {np.mean(waited):.0f} "
                 f"p50 {q[0]:.0f} p90 {q[1]:.0f} p99 {q[2]:.0f} max {max(waited):.0f}")  # fmt: skip
    cols = [("gap", gaps)] + [(name, steps[label]) for label, name in STEPS + AFTER]
    names = " ".join(f"{name:>7s}" for name, _ in cols)
    means = " ".join(f"{statistics.mean(xs):7.1f}" for _, xs in cols)
    p50s = " ".join(f"{statistics.median(xs):7.1f}" for _, xs in cols)
    return f"{head}\n      {names}\nmean  {means}\np50   {p50s}"


async def main(order: list[str], loads: list[str], seconds: float, rate: float) -> None:
    st = EngineStamps()
    st.install()
    for load in loads:
        for arm in order:
            print(await run(arm == "on", load, seconds, rate, st), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("order", nargs="?", default="on,off,off,on")
    ap.add_argument("--loads", default="rate,sat")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--rate", type=float, default=59.0)
    a = ap.parse_args()
    import uvloop

    uvloop.run(main(a.order.split(","), a.loads.split(","), a.seconds, a.rate))
