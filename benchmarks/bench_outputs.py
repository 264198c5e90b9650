"""What the output options cost: prompt logprobs, top-k, embeddings, KV export (issue 12).

Runner-level, in this process, on the tiny Llama `PaddleModel(seed=0)` (4 layers, hidden 256,
4 KV heads of 32, vocab 32000; its KV is 4 KiB per token), one CPU thread:

a. Per-request cost of each option (prompt top-k: top_k=5 at every prompt position) against
   the plain prefill of the same request, measured interleaved (A, B, A, B, ...): a lone
   512-token prompt, and one 512-token prompt that asks in a batch of eight that do not (the
   others pay nothing: only the asking rows reach the LM head).
b. KV export of a 4096-token prompt (16 MiB): the forward with and without `return_kv`; and the
   export path alone (open the segment, copy every layer's K and V out of Paddle tensors,
   unmap) in GB/s, into a fresh segment and into a closed export's segment that the engine
   reuses, against a plain `np.copyto` of the same bytes into a warm buffer and into a fresh
   shared-memory segment (first touch), and the caller's side (attach + read it all).
c. The log-softmax over 32000 logits: paddle's float32 sum (before) vs the float64-accumulated
   NumPy sum (now), time and worst error against an exact float64 log-sum-exp.
d. Through the engine (one Paddle worker process, rings, result columns, the KV handle): one
   request at a time, `prompt_logprobs` on 512 tokens and `return_kv` (read, then closed) on
   4096 tokens, each against the plain request, time from `prefill()` to its result.

Times are medians over `--repeats` runs, wall ms (and process CPU ms where it matters); on a
shared machine quote the ratios, each measured side by side in one run.

    python benchmarks/bench_outputs.py [--repeats 7] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from aioprefill.config import PaddleModel
from aioprefill.shm.segments import create_segment, segment_name, unlink_segment
from aioprefill.wire import protocol
from aioprefill.wire.kv import KVExports, kv_layout
from aioprefill.workers.kv_writer import KVSegmentWriter
from aioprefill.workers.runner import ForwardBatch

OPTIONS = {
    "prompt_logprobs": (protocol.OPT_PROMPT_LOGPROBS, 0),
    "+prompt_top_k, top_k=5": (
        protocol.OPT_PROMPT_LOGPROBS | protocol.OPT_PROMPT_TOP_K,
        5,
    ),
    "top_k=5": (0, 5),
    "top_k=1000": (0, 1000),
    "embed=last": (protocol.OPT_EMBED_LAST, 0),
    "embed=mean+normalize": (protocol.OPT_EMBED_MEAN | protocol.OPT_NORMALIZE, 0),
}


def make_batch(prompts: list[np.ndarray], opts: list[int], top_k: list[int], kv=()) -> ForwardBatch:
    offsets = np.zeros(len(prompts) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(p) for p in prompts])
    n = len(prompts)
    return ForwardBatch(
        request_ids=np.arange(n, dtype=np.int64),
        offsets=offsets,
        tokens=np.concatenate(prompts).astype(np.int32),
        start_pos=np.zeros(n, dtype=np.int32),
        is_last=np.ones(n, dtype=bool),
        options=np.asarray(opts, dtype=np.uint8) if any(opts) else None,
        top_k=np.asarray(top_k, dtype=np.int32) if any(top_k) else None,
        kv_names=tuple(kv),
    )


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3


def side_by_side(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple]:
    """Median (wall ms, cpu ms) per function, run interleaved so load drifts hit all alike."""
    for fn in fns.values():
        fn()  # warm-up
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timed(fn))
    return {
        k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v))
        for k, v in samples.items()
    }


def section_a(runner, rng, repeats: int) -> None:
    print("\na. per-request cost of each option vs the plain prefill (512-token prompts)")
    p = rng.integers(0, 32000, 512).astype(np.int32)
    others = [rng.integers(0, 32000, 512).astype(np.int32) for _ in range(7)]
    print("CPU ms (process time, less disturbed by other load than wall time) and x plain")
    print(f"{'option':<22} {'alone':>8} {'x plain':>8} {'in 8x512':>9} {'x plain':>8}")
    for name, (bits, k) in OPTIONS.items():
        fns = {
            "plain": lambda: runner.forward(make_batch([p], [0], [0])),
            "opt": lambda b=bits, k=k: runner.forward(make_batch([p], [b], [k])),
            "plain8": lambda: runner.forward(make_batch([p, *others], [0] * 8, [0] * 8)),
            "opt8": lambda b=bits, k=k: runner.forward(
                make_batch([p, *others], [b] + [0] * 7, [k] + [0] * 7)
            ),
        }
        t = side_by_side(fns, repeats)
        c = {k: v[1] for k, v in t.items()}
        print(
            f"{name:<22} {c['opt']:8.1f} {c['opt'] / c['plain']:8.3f} "
            f"{c['opt8']:9.1f} {c['opt8'] / c['plain8']:8.3f}"
            f"   (plain {c['plain']:.1f} / {c['plain8']:.1f};"
            f" wall x{t['opt'][0] / t['plain'][0]:.3f} / x{t['opt8'][0] / t['plain8'][0]:.3f})"
        )


def section_b(runner, spec: PaddleModel, rng, repeats: int, tokens: int) -> None:
    import paddle

    from aioprefill.workers.paddle.attention import KVCache, export_layer

    layout = kv_layout(spec)
    nbytes = layout.nbytes(tokens)
    print(f"\nb. KV export of a {tokens}-token prompt ({nbytes / 2**20:.1f} MiB)")
    p = rng.integers(0, 32000, tokens).astype(np.int32)
    ledger = KVExports(spec, 1 << 34)

    def with_kv() -> None:  # as through the engine: the closed export's segment is reused
        ticket = ledger.reserve(tokens)
        runner.forward(make_batch([p], [protocol.OPT_RETURN_KV], [0], [ticket.name]))
        ledger.open(ticket).close()

    t = side_by_side(
        {"plain": lambda: runner.forward(make_batch([p], [0], [0])), "kv": with_kv},
        max(3, repeats // 2),
    )
    plain, kv = t["plain"], t["kv"]
    print(
        f"forward plain {plain[1]:.0f} CPU ms, with return_kv {kv[1]:.0f}: x{kv[1] / plain[1]:.3f}"
        f" (wall {plain[0]:.0f} / {kv[0]:.0f} ms: x{kv[0] / plain[0]:.3f})"
    )

    # The export path alone, on tensors shaped like the forward's ([kv_heads, rows, dim] slices
    # of a [heads + kv_heads, rows, dim] product).
    heads = spec.num_heads + spec.num_kv_heads
    qk = [paddle.randn([heads, tokens, spec.head_dim]) for _ in range(spec.num_layers)]
    vs = [paddle.randn([spec.num_kv_heads, tokens, spec.head_dim]) for _ in range(spec.num_layers)]
    cache = KVCache(spec.num_layers)

    def export(name: str | None = None) -> None:
        w = KVSegmentWriter(name or segment_name("bench-kv"), layout, tokens)
        for i in range(spec.num_layers):
            export_layer(w, i, cache, qk[i][spec.num_heads :], vs[i], 0, tokens)
        if name is None:
            w.discard()
        else:
            w.close()

    kept = segment_name("bench-kept")
    export(kept)  # a closed export's segment, kept by the ledger for the next one

    src = np.ones(nbytes, dtype=np.uint8)
    warm = np.zeros(nbytes, dtype=np.uint8)

    def fresh_segment() -> None:
        name = segment_name("bench-cp")
        mm = create_segment(name, nbytes, prefault=False)
        np.copyto(np.frombuffer(mm, dtype=np.uint8), src)
        mm.close()
        unlink_segment(name)

    ticket = ledger.reserve(tokens)
    runner.forward(make_batch([p], [protocol.OPT_RETURN_KV], [0], [ticket.name]))
    handle = ledger.open(ticket)

    def caller_read() -> None:
        handle._mm = None  # map again each time: what a new caller pays
        float(handle.keys.sum() + handle.values.sum())

    t = side_by_side(
        {
            "export (fresh segment)": export,
            "export (reused segment)": lambda: export(kept),
            "memcpy warm": lambda: np.copyto(warm, src),
            "memcpy fresh shm": fresh_segment,
            "caller attach+read": caller_read,
        },
        repeats,
    )
    handle.close()
    ledger.close_all()
    KVSegmentWriter(kept, layout, tokens).discard()
    for name, (wall, _) in t.items():
        print(f"{name:<24} {wall:8.2f} ms  {nbytes / wall / 1e6:6.2f} GB/s")


def section_c(repeats: int) -> None:
    import paddle

    from aioprefill.workers.paddle.logits import _slice_rows

    print("\nc. log-softmax over 32000 logits: paddle float32 sum (before) vs the head's NumPy")
    print("   reduction (paddle.logits: in place, pairwise float32 sum; timed with a copy)")
    rng = np.random.default_rng(0)
    print(f"{'rows':>5} {'old ms':>8} {'new ms':>8} {'x':>6} {'old err':>9} {'new err':>9}")
    for rows in (1, 16, 512):
        logits = (rng.standard_normal((rows, 32000)) * 4).astype(np.float32)
        t = paddle.to_tensor(logits)
        exact = np.log(np.exp(logits.astype(np.float64) - logits.max(-1, keepdims=True)).sum(-1))

        def old(t=t):
            top = paddle.max(t, axis=-1, keepdim=True)
            return paddle.log(paddle.exp(t - top).sum(-1).astype("float64")).numpy()

        def new(t=t):
            r = _slice_rows(t.clone(), 0, None, 0)  # it overwrites its logits
            return r.lse - r.best

        times = side_by_side({"old": old, "new": new}, repeats)
        e_old = np.abs(old() - exact).max()
        e_new = np.abs(new() - exact).max()
        o, n = times["old"][0], times["new"][0]
        print(f"{rows:5d} {o:8.2f} {n:8.2f} {n / o:6.2f} {e_old:9.1e} {e_new:9.1e}")


def section_d(repeats: int, kv_tokens: int) -> None:
    import asyncio

    from aioprefill import Engine, EngineConfig

    print("\nd. through the engine, one request at a time: wall ms, median per case")
    print("   (total = prefill() call to its result, plus the caller's attach + read + close of")
    print("   the KV handle; forward = the worker's own forward, from the result's timestamps)")
    rng = np.random.default_rng(1)
    p512 = rng.integers(0, 32000, 512).tolist()
    pkv = rng.integers(0, 32000, kv_tokens).tolist()

    async def run() -> dict[str, tuple[float, float, float]]:
        config = EngineConfig(model=PaddleModel(seed=0, device="cpu"), max_batch_tokens=8192)
        async with Engine(config) as engine:
            cases = {
                "512 plain": (p512, {}),
                "512 prompt_logprobs": (p512, {"prompt_logprobs": True}),
                f"{kv_tokens} plain": (pkv, {}),
                f"{kv_tokens} return_kv": (pkv, {"return_kv": True}),
            }
            samples: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cases}
            for rep in range(repeats + 1):
                for name, (prompt, opts) in cases.items():
                    t = time.perf_counter()
                    r = await engine.prefill(prompt, **opts)
                    got = time.perf_counter()
                    if r.kv is not None:
                        with r.kv as handle:
                            float(handle.keys.sum())
                    done = time.perf_counter()
                    forward = (r.forward_end_ns - r.forward_start_ns) / 1e6
                    if rep:  # the first round warms up
                        samples[name].append(((done - t) * 1e3, forward, (done - got) * 1e3))
            return {
                k: tuple(statistics.median(x[i] for x in v) for i in range(3))  # type: ignore[misc]
                for k, v in samples.items()
            }

    t = asyncio.run(run())
    names = list(t)
    for base, opt in ((names[0], names[1]), (names[2], names[3])):
        (total, fwd, handle), (btotal, bfwd, _) = t[opt], t[base]
        print(
            f"{opt:<22} total {total:7.1f} vs {btotal:7.1f} plain (x{total / btotal:.3f}); "
            f"forward {fwd:7.1f} vs {bfwd:7.1f} (x{fwd / bfwd:.3f}); caller handle {handle:.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, a 1024-token KV export")
    ap.add_argument("--sections", default="abcd", help="which sections to run (default abcd)")
    args = ap.parse_args()
    repeats = 3 if args.quick else args.repeats
    from aioprefill.workers.paddle.runner import PaddleRunner

    spec = PaddleModel(seed=0, device="cpu", num_threads=1)
    runner = PaddleRunner(spec)
    rng = np.random.default_rng(0)
    kv_tokens = 1024 if args.quick else 4096
    print(f"PaddleModel(seed=0) on 1 CPU thread; medians of {repeats} interleaved runs")
    if "a" in args.sections:
        section_a(runner, rng, repeats)
    if "b" in args.sections:
        section_b(runner, spec, rng, repeats, kv_tokens)
    if "c" in args.sections:
        section_c(repeats)
    if "d" in args.sections:
        section_d(repeats, kv_tokens)


if __name__ == "__main__":
    main()
