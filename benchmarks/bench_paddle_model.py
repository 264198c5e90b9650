"""The Paddle model's own costs, runner-level (no engine, no processes but in section e).

Runs `PaddleRunner(PaddleModel(seed=0))` (the tiny Llama: 4 layers, hidden 256, 19.6 M params)
in this process on `--threads` CPU threads (default 1) and measures, in one run:

a. Batching: 64 requests of 16 tokens as one packed batch vs 64 one-request forwards, and the
   same for 128-token requests: the throughput ratio batching buys.
b. Throughput at batch-token budgets 512 ... 8192 (requests of 16-256 tokens, seeded), to help
   choose the engine's `max_batch_tokens`.
c. The cost of `deterministic=True` (bitwise batch invariance) against the default, on a
   single short request, 64 x 16 tokens and a full 8192-token batch.
d. A least-squares fit of `a + b*tokens + c*sum(len^2)` over a grid of batch shapes, weighted
   by relative error: the numbers for a `SimModel` preset fitted to this CPU.
e. Worker start: from `Process.start()` to the first forward done in the child, under `spawn`
   and under a `forkserver` with `aioprefill.workers.paddle.runner` preloaded (cold: the first
   start also starts the server; warm: later starts).

Every time is the median of `--repeats` runs; the tables give wall-clock ms and the process's
CPU ms. On a shared machine quote the ratios (each measured within one run); CPU time is less
disturbed by other load than wall time, and the ratios and the fit use it.

    python benchmarks/bench_paddle_model.py [--threads 1] [--repeats 5] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

from aioprefill.config import PaddleModel
from aioprefill.workers.runner import ForwardBatch

Timing = tuple[float, float]  # (wall ms, cpu ms)


def make_batch(lengths: list[int], rng: np.random.Generator, vocab: int = 32000) -> ForwardBatch:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(lengths)
    return ForwardBatch(
        request_ids=np.arange(len(lengths), dtype=np.int64),
        offsets=offsets,
        tokens=rng.integers(0, vocab, int(offsets[-1])).astype(np.int32),
        start_pos=np.zeros(len(lengths), dtype=np.int32),
        is_last=np.ones(len(lengths), dtype=bool),
    )


def timed(fn: Any, repeats: int) -> Timing:
    """Median wall and CPU milliseconds of `fn()` over `repeats` runs, after one warm-up."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        fn()
        cpus.append((time.process_time() - c) * 1e3)
        walls.append((time.perf_counter() - w) * 1e3)
    return statistics.median(walls), statistics.median(cpus)


def fill(budget: int, rng: np.random.Generator, lo: int = 16, hi: int = 256) -> list[int]:
    """Request lengths drawn from [lo, hi] until they fill `budget` tokens exactly."""
    lengths: list[int] = []
    left = budget
    while left > 0:
        n = min(left, int(rng.integers(lo, hi + 1)))
        lengths.append(n)
        left -= n
    return lengths


def section_a(runner: Any, repeats: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    rows = []
    for length in (16, 128):
        batch = make_batch([length] * 64, rng)
        singles = [make_batch([length], rng) for _ in range(64)]
        packed = timed(lambda b=batch: runner.forward(b), repeats)
        one_by_one = timed(lambda s=singles: [runner.forward(b) for b in s], repeats)
        rows.append(
            {
                "shape": f"64 x {length}",
                "packed_ms": packed,
                "sequential_ms": one_by_one,
                "ratio": one_by_one[1] / packed[1],
                "packed_tok_s": 64 * length / packed[1] * 1e3,
            }
        )
    return rows


def section_b(runner: Any, repeats: int, rng: np.random.Generator, budgets: list[int]) -> list:
    rows = []
    for budget in budgets:
        lengths = fill(budget, rng)
        batch = make_batch(lengths, rng)
        t = timed(lambda b=batch: runner.forward(b), repeats)
        rows.append(
            {"budget": budget, "requests": len(lengths), "ms": t, "tok_s": budget / t[1] * 1e3}
        )
    return rows


def section_c(default: Any, det: Any, repeats: int, rng: np.random.Generator) -> list:
    rows = []
    for name, lengths in (
        ("1 x 16", [16]),
        ("64 x 16", [16] * 64),
        ("8192 tokens, 16-256 each", fill(8192, rng)),
    ):
        batch = make_batch(lengths, rng)
        a = timed(lambda b=batch: default.forward(b), repeats)
        d = timed(lambda b=batch: det.forward(b), repeats)
        rows.append({"batch": name, "default_ms": a, "det_ms": d, "ratio": d[1] / a[1]})
    return rows


def section_d(runner: Any, repeats: int, rng: np.random.Generator, quick: bool) -> dict:
    shapes = [(1, 16), (1, 128), (1, 512), (1, 2048), (4, 64), (8, 16), (8, 256), (16, 128)]
    shapes += [(32, 32), (64, 16), (64, 128), (128, 64), (16, 512), (4, 1024), (2, 4096)]
    if quick:
        shapes = shapes[::2]
    points = []
    for n, length in shapes:
        batch = make_batch([length] * n, rng)
        t = timed(lambda b=batch: runner.forward(b), repeats)
        points.append({"requests": n, "len": length, "ms": t})
    tokens = np.array([p["requests"] * p["len"] for p in points], dtype=np.float64)
    square = np.array([p["requests"] * p["len"] ** 2 for p in points], dtype=np.float64)
    requests = np.array([p["requests"] for p in points], dtype=np.float64)
    y = np.array([p["ms"][1] for p in points]) * 1e-3
    fit3 = _fit(np.column_stack([np.ones_like(y), tokens, square]), y)
    fit4 = _fit(np.column_stack([np.ones_like(y), tokens, square, requests]), y)
    return {"points": points, "fit": fit3, "fit_with_requests": fit4}


def _fit(x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
    """Least squares with relative-error weights (times span ~100x), coefficients in s."""
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    rel = (x @ coef - y) / y
    return {"coef": coef.tolist(), "max_rel_err": float(np.abs(rel).max())}


def _child(conn: Any, threads: int) -> None:
    """A worker's start: import, build the model, one forward; report monotonic_ns stamps."""
    from aioprefill.workers.paddle.runner import PaddleRunner

    imported = time.monotonic_ns()
    runner = PaddleRunner(PaddleModel(seed=0, num_threads=threads))
    built = time.monotonic_ns()
    runner.forward(make_batch([16], np.random.default_rng(0)))
    done = time.monotonic_ns()
    conn.send_bytes(json.dumps([imported, built, done]).encode())
    conn.close()


def start_once(ctx: Any, threads: int) -> dict[str, float]:
    parent, child = ctx.Pipe(duplex=False)
    start = time.monotonic_ns()
    proc = ctx.Process(target=_child, args=(child, threads))
    proc.start()
    child.close()
    imported, built, done = json.loads(parent.recv_bytes())
    proc.join()
    return {
        "import_ms": (imported - start) / 1e6,
        "build_ms": (built - imported) / 1e6,
        "first_forward_ms": (done - built) / 1e6,
        "total_ms": (done - start) / 1e6,
    }


def section_e(threads: int, repeats: int) -> dict[str, Any]:
    spawn = mp.get_context("spawn")
    fork_server = mp.get_context("forkserver")
    fork_server.set_forkserver_preload(["aioprefill.workers.paddle.runner"])
    cold = start_once(fork_server, threads)
    warm = [start_once(fork_server, threads) for _ in range(repeats)]
    spawned = [start_once(spawn, threads) for _ in range(repeats)]

    def med(runs: list[dict[str, float]]) -> dict[str, float]:
        return {k: statistics.median(r[k] for r in runs) for k in runs[0]}

    return {"spawn": med(spawned), "forkserver_cold": cold, "forkserver_warm": med(warm)}


def ms(t: Timing) -> str:
    return f"{t[0]:.1f} / {t[1]:.1f}"


def report(res: dict[str, Any]) -> str:
    out = [
        f"PaddleModel(seed=0), {res['threads']} thread(s), median of {res['repeats']} runs; "
        "times are wall / CPU ms, ratios from CPU time.",
        "",
    ]
    out += [
        "### a. One packed batch vs one request per forward",
        "",
        "| requests | packed | 64 sequential | speed-up | packed tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in res["a"]:
        out.append(
            f"| {r['shape']} | {ms(r['packed_ms'])} | {ms(r['sequential_ms'])} | "
            f"{r['ratio']:.2f}x | {r['packed_tok_s']:,.0f} |"
        )
    out += [
        "",
        "### b. Throughput by batch-token budget (requests of 16-256 tokens)",
        "",
        "| budget | requests | forward | tokens/s |",
        "|---:|---:|---:|---:|",
    ]
    for r in res["b"]:
        out.append(f"| {r['budget']} | {r['requests']} | {ms(r['ms'])} | {r['tok_s']:,.0f} |")
    out += [
        "",
        "### c. deterministic=True vs default",
        "",
        "| batch | default | deterministic | cost |",
        "|---|---:|---:|---:|",
    ]
    for r in res["c"]:
        out.append(
            f"| {r['batch']} | {ms(r['default_ms'])} | {ms(r['det_ms'])} | {r['ratio']:.2f}x |"
        )
    d = res["d"]
    a, b, c = d["fit"]["coef"]
    out += [
        "",
        "### d. Cost model fit (CPU time, relative-error weights)",
        "",
        "| requests x len | forward | fit |",
        "|---|---:|---:|",
    ]
    for p in d["points"]:
        n, length = p["requests"], p["len"]
        pred = (a + b * n * length + c * n * length**2) * 1e3
        out.append(f"| {n} x {length} | {ms(p['ms'])} | {pred:.1f} |")
    out += [
        "",
        f"fit: {a * 1e3:.2f} ms + {b * 1e6:.1f} us/token + {c * 1e9:.1f} ns * sum(len^2) "
        f"(worst relative error {d['fit']['max_rel_err']:.0%})",
        f"preset: `SimModel(fixed_ms={a * 1e3:.1f}, per_token_us={b * 1e6:.1f}, "
        f"attn_ns={c * 1e9:.1f}, vocab_size=32000)`",
    ]
    a4, b4, c4, r4 = d["fit_with_requests"]["coef"]
    out.append(
        f"with a per-request term: {a4 * 1e3:.2f} ms + {b4 * 1e6:.1f} us/token + "
        f"{c4 * 1e9:.1f} ns * sum(len^2) + {r4 * 1e6:.0f} us/request "
        f"(worst relative error {d['fit_with_requests']['max_rel_err']:.0%})"
    )
    if "e" in res:
        out += [
            "",
            "### e. Worker start to first forward done (ms)",
            "",
            "| start method | import | build model | first forward | total |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, r in res["e"].items():
            out.append(
                f"| {name} | {r['import_ms']:.0f} | {r['build_ms']:.0f} | "
                f"{r['first_forward_ms']:.0f} | {r['total_ms']:.0f} |"
            )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer repeats and shapes")
    parser.add_argument("--no-start", action="store_true", help="skip section e")
    parser.add_argument("--json", help="also write the raw results here")
    args = parser.parse_args()
    repeats = 2 if args.quick else args.repeats

    from aioprefill.workers.paddle.runner import PaddleRunner

    rng = np.random.default_rng(0)
    runner = PaddleRunner(PaddleModel(seed=0, num_threads=args.threads))
    det = PaddleRunner(PaddleModel(seed=0, num_threads=args.threads, deterministic=True))
    budgets = [512, 2048, 8192] if args.quick else [512, 1024, 2048, 4096, 8192]
    res: dict[str, Any] = {"threads": args.threads, "repeats": repeats}
    res["a"] = section_a(runner, repeats, rng)
    res["b"] = section_b(runner, repeats, rng, budgets)
    res["c"] = section_c(runner, det, repeats, rng)
    res["d"] = section_d(runner, repeats, rng, args.quick)
    if not args.no_start:
        res["e"] = section_e(args.threads, max(2, repeats // 2))
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
