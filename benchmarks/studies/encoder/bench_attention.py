"""The fused encoder forward's attention (`aioprefill.workers.paddle.fused.attend_`) against the
other ways the libraries on this machine offer to compute it, on all-MiniLM-L6-v2's shape (12
heads of 32, hidden 384): is there a cheaper attention to be had without hand-written kernels?

Every variant computes every prompt's bidirectional attention with q, k and v read in place from
packed qkv rows [rows, 3 x 384] and the context written into its rows [rows, 384], as the forward
does, for 300 prompts of 8-256 tokens (seeded; the lengths `profile_forward.py` uses), in
batches of at most 8,192 rows, six times (MiniLM's layers):

- `onednn`: `fused.attend_` itself (oneDNN's sgemm per head for q k^T and for p v, one oneDNN
  softmax over every head of the prompt);
- `per_head`: the same calls, each head's scores, softmax and product in turn (one head's
  scores in cache at a time);
- `mkl`: the same as `onednn` with MKL's `cblas_sgemm` per head (Paddle's
  `libmklml_intel.so`), MKL's kernels chosen as a worker chooses them
  (`paddle.env.configure_math_libraries`: on an AMD CPU `MKL_DEBUG_CPU_TYPE=5`, its AVX2
  kernels, unless the environment says otherwise);
- `mkl_batch`: MKL's `cblas_sgemm_batch` (the group API): one call for every head of every
  prompt of the batch (q k^T: a group per prompt, a group member per head, alpha = 1/sqrt(32)),
  one softmax per prompt, one call for every p v;
- `matmul_rt`: one oneDNN matmul primitive per product batched over the heads with runtime M,
  N, K (one primitive for every prompt length: the kernels a primitive per length would
  JIT-compile are what kept the forward on sgemm, fused.py);
- `torch_sdpa`: torch's `F.scaled_dot_product_attention` (its fused CPU kernel) on strided
  views of the same qkv rows, in the sentence-transformers venv (.st-venv, a child process; the
  row skipped where there is none; torch is never aioprefill's dependency).

The process is set up as a worker is (`paddle.env`: MKL's kernels, malloc keeping freed
memory). Each variant runs once to warm up, then the variants alternate for `--rounds` rounds;
printed: CPU seconds of the six layers (thread time, 1 thread: min and median over the rounds), the
largest difference of each variant's context from `onednn`'s and whether it is bitwise equal
(and whether `mkl_batch`'s equals `mkl`'s: MKL's batch call gives each product its lone bits),
and the floor: the products' FLOPs at the core's float32 sgemm rate (measured here on an
[8192, 384] x [384, 1536] product). Then, per prompt length (8 to 256 tokens, one layer), the
time of `onednn` and of `matmul_rt`, and oneDNN's softmax alone in ns a score.

    python benchmarks/studies/encoder/bench_attention.py [--rounds 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/: common.py
from common import ROOT

from aioprefill.workers.paddle.env import configure_math_libraries, keep_freed_memory

configure_math_libraries()  # as a worker does, before paddle (MKL reads it once)
keep_freed_memory()  # as a worker does: freed buffers are reused, not page-faulted in again

import paddle  # noqa: E402, F401  (loads the libraries the variants call)

from aioprefill.workers.paddle.dnnl import (  # noqa: E402
    ARG_DST,
    ARG_SRC,
    ARG_WEIGHTS,
    F32,
    P,
    check,
    dnnl,
    memory_desc,
    primitive_desc,
)
from aioprefill.workers.paddle.env import paddle_libs  # noqa: E402
from aioprefill.workers.paddle.fused import attend_  # noqa: E402
from aioprefill.workers.paddle.gemm import Products  # noqa: E402
from aioprefill.workers.paddle.onednn import load_sgemm  # noqa: E402
from aioprefill.workers.paddle.softmax import softmax_rows_  # noqa: E402

H, HD, HIDDEN = 12, 32, 384
WIDTH = 3 * HIDDEN
SCALE = 1.0 / math.sqrt(HD)
LAYERS = 6
F = 4  # bytes of a float32
ST_PYTHON = ROOT / ".st-venv" / "bin" / "python"
if not ST_PYTHON.exists():
    ST_PYTHON = Path("/work/main/.st-venv/bin/python")

Batch = tuple[np.ndarray, list[tuple[int, int]], np.ndarray]  # qkv, bounds, ctx


def prompt_lengths(n: int = 300, seed: int = 0) -> list[int]:
    """profile_forward.py's lengths: the same generator, the same draws."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(8, 257, n)]


def batches(lengths: list[int], budget: int = 8192, seed: int = 1) -> list[Batch]:
    """The prompts cut into batches of at most `budget` rows, each with random qkv rows."""
    rng = np.random.default_rng(seed)
    groups: list[list[int]] = [[]]
    for n in lengths:
        if sum(groups[-1]) + n > budget:
            groups.append([])
        groups[-1].append(n)
    out = []
    for g in groups:
        rows, bounds, s = sum(g), [], 0
        for n in g:
            bounds.append((s, s + n))
            s += n
        qkv = rng.standard_normal((rows, WIDTH), dtype=np.float32)
        out.append((qkv, bounds, np.zeros((rows, HIDDEN), np.float32)))
    return out


def onednn_variant(mm: Products):
    def run(qkv: np.ndarray, bounds: list[tuple[int, int]], ctx: np.ndarray) -> None:
        longest = max(e - s for s, e in bounds)
        scores = np.empty(H * longest * longest, np.float32)
        for s, e in bounds:
            attend_(mm, qkv, ctx, s, e, H, SCALE, scores)

    return run


def per_head_variant(mm: Products):
    """`onednn` with each head's scores, softmax and product in turn (one head's scores in
    cache at a time: 12 softmax calls a prompt instead of one)."""

    def run(qkv: np.ndarray, bounds: list[tuple[int, int]], ctx: np.ndarray) -> None:
        longest = max(e - s for s, e in bounds)
        scores = np.empty(longest * longest, np.float32)
        sp = scores.ctypes.data
        for s, e in bounds:
            n = e - s
            row, out = qkv.ctypes.data + s * WIDTH * F, ctx.ctypes.data + s * HIDDEN * F
            for h in range(H):
                q, k = row + h * HD * F, row + (HIDDEN + h * HD) * F
                mm.strided(n, n, HD, SCALE, q, WIDTH, k, WIDTH, sp, n, transpose_b=True)
                softmax_rows_(scores[: n * n].reshape(n, n))
                v, c = row + (2 * HIDDEN + h * HD) * F, out + h * HD * F
                mm.strided(n, HD, n, 1.0, sp, n, v, WIDTH, c, HIDDEN, transpose_b=False)

    return run


def _mkl() -> ctypes.CDLL:
    return ctypes.CDLL(str(paddle_libs() / "libmklml_intel.so"))


ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def mkl_variant():
    gemm = _mkl().cblas_sgemm
    i, p, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    gemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    gemm.restype = None

    def run(qkv: np.ndarray, bounds: list[tuple[int, int]], ctx: np.ndarray) -> None:
        longest = max(e - s for s, e in bounds)
        scores = np.empty(H * longest * longest, np.float32)
        sp = scores.ctypes.data
        for s, e in bounds:
            n = e - s
            row, out = qkv.ctypes.data + s * WIDTH * F, ctx.ctypes.data + s * HIDDEN * F
            for h in range(H):
                q, k = row + h * HD * F, row + (HIDDEN + h * HD) * F
                a = sp + h * n * n * F
                gemm(ROW_MAJOR, NO_TRANS, TRANS, n, n, HD, SCALE, q, WIDTH, k, WIDTH, 0.0, a, n)
            softmax_rows_(scores[: H * n * n].reshape(H * n, n))
            for h in range(H):
                a, v = sp + h * n * n * F, row + (2 * HIDDEN + h * HD) * F
                c = out + h * HD * F
                gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, n, HD, n, 1.0, a, n, v, WIDTH, 0.0, c, HIDDEN)

    return run


def mkl_batch_variant():
    batch = _mkl().cblas_sgemm_batch
    p = ctypes.c_void_p
    batch.argtypes = [ctypes.c_int, *[p] * 13, ctypes.c_int, p]
    batch.restype = None

    def run(qkv: np.ndarray, bounds: list[tuple[int, int]], ctx: np.ndarray) -> None:
        g = len(bounds)
        ns = np.array([e - s for s, e in bounds], np.int32)
        n64 = ns.astype(np.int64)
        starts = np.array([s for s, _ in bounds], np.int64)
        sizes = n64 * n64 * H
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        scores = np.empty(int(sizes.sum()), np.float32)
        heads = np.arange(H, dtype=np.int64)
        q = (qkv.ctypes.data + starts * WIDTH * F)[:, None] + heads[None] * HD * F
        k, v = q + HIDDEN * F, q + 2 * HIDDEN * F
        a = scores.ctypes.data + offsets[:, None] * F + heads[None] * (n64 * n64)[:, None] * F
        c = (ctx.ctypes.data + starts * HIDDEN * F)[:, None] + heads[None] * HD * F
        q, k, v, a, c = (np.ascontiguousarray(x.ravel()) for x in (q, k, v, a, c))

        def full(x: object, dtype: type) -> np.ndarray:
            return np.full(g, x, dtype)

        nt, tt = full(NO_TRANS, np.int32), full(TRANS, np.int32)
        hd, width, hidden = full(HD, np.int32), full(WIDTH, np.int32), full(HIDDEN, np.int32)
        scale, one, zero = full(SCALE, np.float32), full(1.0, np.float32), full(0.0, np.float32)
        members = full(H, np.int32)
        d = [x.ctypes.data for x in (nt, tt, ns, hd, scale, q, width, k, zero, a, members)]
        nt_, tt_, ns_, hd_, scale_, q_, width_, k_, zero_, a_, members_ = d
        batch(ROW_MAJOR, nt_, tt_, ns_, ns_, hd_, scale_, q_, width_, k_, width_, zero_, a_,
              ns_, g, members_)  # fmt: skip
        for i, n in enumerate(ns.tolist()):
            softmax_rows_(scores[offsets[i] : offsets[i] + H * n * n].reshape(H * n, n))
        batch(ROW_MAJOR, nt_, nt_, ns_, hd_, ns_, one.ctypes.data, a_, ns_, v.ctypes.data,
              width_, zero_, c.ctypes.data, hidden.ctypes.data, g, members_)  # fmt: skip

    return run


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", P)]


RUNTIME = -(1 << 63)  # DNNL_RUNTIME_DIM_VAL
ARG_SCALES = 4096  # DNNL_ARG_ATTR_SCALES


def matmul_rt_variant():
    d = dnnl()
    assert d is not None
    lib = d.lib
    rt = RUNTIME

    def pd(src, wei, dst, attr=None):
        args = (d.engine, src.handle, wei.handle, None, dst.handle, attr)
        return primitive_desc("dnnl_matmul_primitive_desc_create", [P, P, P, P, P, P], *args)

    attr = P()
    check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)))
    lib.dnnl_primitive_attr_set_scales_mask.argtypes = [P, ctypes.c_int, ctypes.c_int]
    check(lib.dnnl_primitive_attr_set_scales_mask(attr, ARG_WEIGHTS, 0))
    # q k^T: q [H, n, 32] and k^T [H, 32, n] in place in the qkv rows; scores [H, n, n]
    keep = [
        memory_desc([H, rt, HD], F32, [HD, WIDTH, 1]),
        memory_desc([H, HD, rt], F32, [HD, 1, WIDTH]),
        memory_desc([H, rt, rt], F32, [rt, rt, 1]),
        memory_desc([H, rt, rt], F32, [rt, rt, 1]),
        memory_desc([H, rt, HD], F32, [HD, WIDTH, 1]),
        memory_desc([H, rt, HD], F32, [HD, HIDDEN, 1]),
        memory_desc([1], F32),
    ]
    prims = []
    for src, wei, dst, at in ((*keep[0:3], attr), (*keep[3:6], None)):
        prim = P()
        check(lib.dnnl_primitive_create(ctypes.byref(prim), pd(src, wei, dst, at)))
        prims.append(prim)
    qk, pv = prims
    scale = np.array([SCALE], np.float32)
    scale_mem = P()
    check(lib.dnnl_memory_create(ctypes.byref(scale_mem), keep[6].handle, d.engine, None))
    check(lib.dnnl_memory_set_data_handle(scale_mem, scale.ctypes.data))
    per_length: dict[int, tuple] = {}

    def memories(n: int) -> tuple:
        if n not in per_length:
            mds = [
                memory_desc([H, n, HD], F32, [HD, WIDTH, 1]),
                memory_desc([H, HD, n], F32, [HD, 1, WIDTH]),
                memory_desc([H, n, n], F32, [n * n, n, 1]),
                memory_desc([H, n, n], F32, [n * n, n, 1]),
                memory_desc([H, n, HD], F32, [HD, WIDTH, 1]),
                memory_desc([H, n, HD], F32, [HD, HIDDEN, 1]),
            ]
            mems = []
            for md in mds:
                m = P()
                check(lib.dnnl_memory_create(ctypes.byref(m), md.handle, d.engine, None))
                mems.append(m)
            first = (_Arg * 4)(
                _Arg(ARG_SRC, mems[0]),
                _Arg(ARG_WEIGHTS, mems[1]),
                _Arg(ARG_DST, mems[2]),
                _Arg(ARG_SCALES | ARG_WEIGHTS, scale_mem),
            )
            second = (_Arg * 3)(
                _Arg(ARG_SRC, mems[3]), _Arg(ARG_WEIGHTS, mems[4]), _Arg(ARG_DST, mems[5])
            )
            per_length[n] = (mds, mems, first, second)
        return per_length[n]

    point, execute, stream = lib.dnnl_memory_set_data_handle, lib.dnnl_primitive_execute, d.stream

    def run(qkv: np.ndarray, bounds: list[tuple[int, int]], ctx: np.ndarray) -> None:
        longest = max(e - s for s, e in bounds)
        scores = np.empty(H * longest * longest, np.float32)
        sp = scores.ctypes.data
        for s, e in bounds:
            n = e - s
            row, out = qkv.ctypes.data + s * WIDTH * F, ctx.ctypes.data + s * HIDDEN * F
            _, mems, first, second = memories(n)
            point(mems[0], row)
            point(mems[1], row + HIDDEN * F)
            point(mems[2], sp)
            check(execute(qk, stream, 4, first))
            softmax_rows_(scores[: H * n * n].reshape(H * n, n))
            point(mems[3], sp)
            point(mems[4], row + 2 * HIDDEN * F)
            point(mems[5], out)
            check(execute(pv, stream, 3, second))
            check(lib.dnnl_stream_wait(stream))

    run.keep = (keep, attr, scale, scale_mem, prims)  # type: ignore[attr-defined]
    return run


TORCH_CHILD = r"""
import json, math, sys, time
import numpy as np, torch
import torch.nn.functional as F
torch.set_num_threads(1)
lengths, rounds = json.loads(sys.argv[1]), int(sys.argv[2])
H, HD, HIDDEN = 12, 32, 384
rng = np.random.default_rng(1)
qkv = torch.from_numpy(rng.standard_normal((sum(lengths), 3 * HIDDEN), dtype=np.float32))
ctx = torch.empty(sum(lengths), HIDDEN)
bounds, s = [], 0
for n in lengths:
    bounds.append((s, s + n)); s += n
def run():
    for s, e in bounds:
        n = e - s
        x = qkv[s:e].view(n, 3, H, HD).permute(1, 2, 0, 3)  # q, k, v: [H, n, 32] strided views
        o = F.scaled_dot_product_attention(x[0:1], x[1:2], x[2:3])
        ctx[s:e] = o[0].transpose(0, 1).reshape(n, HIDDEN)
times = []
with torch.inference_mode():
    run()
    for _ in range(rounds):
        t = time.thread_time()
        for _ in range(6):
            run()
        times.append(time.thread_time() - t)
print(json.dumps({"torch": torch.__version__, "times": times}))
"""


def sgemm_rate() -> float:
    """GFLOP/s of oneDNN's sgemm on an [8192, 384] x [384, 1536] product (1 thread)."""
    sgemm = load_sgemm()
    assert sgemm is not None
    m, k, n = 8192, 384, 1536
    rng = np.random.default_rng(2)
    a, b = (
        rng.standard_normal((m, k), dtype=np.float32),
        rng.standard_normal((k, n), dtype=np.float32),
    )
    c = np.empty((m, n), np.float32)
    best = float("inf")
    for _ in range(4):
        t = time.thread_time()
        sgemm(b"N", b"N", m, n, k, 1.0, a.ctypes.data, k, b.ctypes.data, n, 0.0, c.ctypes.data, n)
        best = min(best, time.thread_time() - t)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    lines = [
        f"# {' '.join(sys.argv)}",
        f"# {platform.node()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at start; "
        f"1 thread; MKL_DEBUG_CPU_TYPE={os.environ.get('MKL_DEBUG_CPU_TYPE', '')}",
    ]

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for line in lines:
        print(line)
    mm = Products("cpu", 1, None, "onednn", in_out=True)  # also sets the OpenMP pool to 1
    lengths = prompt_lengths()
    data = batches(lengths)
    flops = LAYERS * sum(4 * n * n * HIDDEN for n in lengths)
    rate = sgemm_rate()
    say(f"# {len(lengths)} prompts of {min(lengths)}-{max(lengths)} tokens in {len(data)} batches "
        f"x {LAYERS} layers: {flops / 1e9:.1f} GFLOP of attention products; sgemm {rate:.0f} "
        f"GFLOP/s here: floor {flops / rate / 1e9:.2f} CPU-s")  # fmt: skip
    variants = {
        "onednn": onednn_variant(mm),
        "per_head": per_head_variant(mm),
        "mkl": mkl_variant(),
        "mkl_batch": mkl_batch_variant(),
        "matmul_rt": matmul_rt_variant(),
    }
    outputs: dict[str, list[np.ndarray]] = {}
    for name, run in variants.items():  # warm: every primitive and kernel made once
        for qkv, bounds, ctx in data:
            run(qkv, bounds, ctx)
        outputs[name] = [ctx.copy() for _, _, ctx in data]
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, run in variants.items():
            t = time.thread_time()
            for _ in range(LAYERS):
                for qkv, bounds, ctx in data:
                    run(qkv, bounds, ctx)
            times[name].append(time.thread_time() - t)
    if ST_PYTHON.exists():
        child = subprocess.run(
            [str(ST_PYTHON), "-c", TORCH_CHILD, json.dumps(lengths), str(args.rounds)],
            capture_output=True, text=True, timeout=900, check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        answer = json.loads(child.stdout.strip().splitlines()[-1])
        times["torch_sdpa"] = answer["times"]
        say(f"# torch {answer['torch']} (.st-venv), 1 thread")
    say("variant      CPU-s (min, median)  vs onednn (median)  context vs onednn's")
    base = statistics.median(times["onednn"])
    for name, ts in times.items():
        med = statistics.median(ts)
        if name in outputs:
            diff = max(
                float(np.abs(a - b).max())
                for a, b in zip(outputs[name], outputs["onednn"], strict=True)
            )
            same = all(
                np.array_equal(a, b) for a, b in zip(outputs[name], outputs["onednn"], strict=True)
            )
            agree = "bitwise equal" if same else f"max |d| {diff:.1e}"
        else:
            agree = "(not compared: its own random qkv)"
        say(f"{name:12s} {min(ts):6.2f} {med:6.2f}         x{med / base:4.2f}         {agree}")
    same = all(
        np.array_equal(a, b) for a, b in zip(outputs["mkl_batch"], outputs["mkl"], strict=True)
    )
    say(f"mkl_batch's context bitwise mkl's (each gemm the same alone and in a batch call): {same}")
    say("rounds: " + "; ".join(f"{k} " + " ".join(f"{x:.2f}" for x in v) for k, v in times.items()))
    say(
        "per prompt length, one layer (min of 5 rounds): us of `onednn` and `matmul_rt`, and of "
        "oneDNN's softmax alone (ns a score)"
    )
    qkv = data[0][0]
    for n in (8, 16, 32, 64, 128, 192, 256):
        reps, us = max(20, 100_000 // (n * n)), {}
        for name in ("onednn", "matmul_rt"):
            ctx = np.zeros((n, HIDDEN), np.float32)
            best = float("inf")
            for _ in range(5):
                t = time.thread_time()
                for _ in range(reps):
                    variants[name](qkv, [(0, n)], ctx)
                best = min(best, (time.thread_time() - t) / reps)
            us[name] = best * 1e6
        scores = np.random.default_rng(3).standard_normal((H * n, n), dtype=np.float32)
        work = scores.copy()
        best = float("inf")
        for _ in range(5):
            t = time.thread_time()
            for _ in range(reps):
                work[:] = scores
                softmax_rows_(work)
            best = min(best, (time.thread_time() - t) / reps)
        copy = float("inf")
        for _ in range(5):
            t = time.thread_time()
            for _ in range(reps):
                work[:] = scores
            copy = min(copy, (time.thread_time() - t) / reps)
        say(f"  {n:3d} tokens: onednn {us['onednn']:7.1f} us, matmul_rt {us['matmul_rt']:7.1f} "
            f"us; softmax {(best - copy) / (H * n * n) * 1e9:.2f} ns a score")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
