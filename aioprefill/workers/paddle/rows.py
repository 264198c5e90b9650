"""Whether a worker's matrix products give a row the same bits whatever the product's row count,
checked once when the worker starts, and the `Products` its default mode runs on.

The default mode (`deterministic=False`) makes a prefix-cache hit answer what the cache-off run
answers by running every product on at least a floor of rows (zero-padded) and attention on tiles
of absolute positions (`paddle.attention`): the row count then changes no row's bits, because BLAS
libraries take one kernel family for all row counts above some size. That size is the library's,
the CPU's and the thread count's: Intel MKL 2019 (Paddle's wheel) keeps a row bitwise from 56 rows
on an AMD EPYC with 1 thread, from 16 on an Intel Xeon with 1 thread, but on that Xeon with 2
threads the MLP's down projection moves rows at 63-128 rows against a 1,050-row product
(benchmarks/results/ctranslate2/mkl_rows.txt, benchmarks/results/prefix/hit_exact.txt). So
the worker checks its own shapes with its own thread count: the last m rows of a 1,050-row product
against an m-row product, m from 16 to 280
(the head: 16-512 rows against 1024, the tiles its prompt log-probabilities run in, on
the CPU against one vocabulary slice, `paddle.logits`), on random inputs
(kernels are chosen by shape, not values), and pads to the smallest of 16, 32, 64 rows above every
count that moved. A sample, not a proof: row counts between or beyond those tried are not. Where
MKL's rows move at 64 or more and MKL is only the default (`AIOPREFILL_CPU_GEMM` unset), the worker
checks oneDNN's products from the same wheel and runs them if their rows hold (the Xeon at 2
threads: floor 16, at MKL's speed on full batches and 1.2x it on a lone short request). Where
neither holds, the worker keeps untiled products on at least 64 rows and logs a warning: hits there
may differ from the cache-off answer by float32 rounding (MKL at 2 threads on the Xeon with a floor
of 64: up to 1.1e-4 on prompt top-k log-probabilities), and `deterministic=True`, or one thread per
worker, is the exact choice. Fixed 64-row tiles would be exact but cost 1.6-1.8x the CPU time of a
full batch at 2 threads (8 x 280: 240-303 against 425-470 tok/CPU-s; 64-row tiles of the down
projection alone: 52 against 21 ms per layer), too much for a default. Mixture-of-experts layers'
expert products are neither checked nor padded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import numpy as np
import paddle

from aioprefill.workers.paddle.env import CPU_GEMM_ENV
from aioprefill.workers.paddle.gemm import Products
from aioprefill.workers.paddle.logits import HEAD_ROWS, VOCAB_CHUNK
from aioprefill.workers.paddle.weights import Layer

__all__ = ["checked_products", "row_floor"]

_FLOORS = (16, 32, 64)  # the row counts a product is padded to, smallest that holds first
_BIG = 1050  # rows of the reference product ...
_SIZES = (16, 20, 24, 32, 40, 48, 56, 64, 100, 128, 280)  # ... whose last rows these compare
_HEAD_SIZES = (16, 32, 64, 128, 256, 512)  # the head's prompt-logprob tiles: 16..HEAD_ROWS rows
_LAST_SIZES = (16, 17, 20, 24, 32, 40, 48, 56, 64, 100, 128)  # its last rows: a batch's requests

log = logging.getLogger("aioprefill.worker")


def row_floor(
    mm: Products, layer: Layer, lm_head: paddle.Tensor, *, head: bool = True
) -> tuple[int | None, dict[str, list[int]]]:
    """The smallest of `_FLOORS` from which no product's rows moved with the row count (None:
    some moved at 64 rows or more), and the row counts at which each product's rows moved.
    `head=False`: the layer's products only."""
    Check = tuple[str, Callable[..., paddle.Tensor], paddle.Tensor, int, tuple[int, ...], int]
    checks: list[Check] = [
        ("qkv", mm.project, layer.qkv, mm.in_features(layer.qkv, heads=True), _SIZES, _BIG),
        ("o", mm.linear, layer.o, mm.in_features(layer.o), _SIZES, _BIG),
    ]
    for name in ("gate_up", "down"):
        w = getattr(layer, name, None)
        if w is not None:  # None: a mixture of experts
            product = mm.swiglu_linear if name == "gate_up" else mm.linear  # as the forward
            checks.append((name, product, w, mm.in_features(w), _SIZES, _BIG))
    top = lm_head[:VOCAB_CHUNK] if lm_head.place.is_cpu_place() else lm_head  # as head_rows
    if head:
        k = int(lm_head.shape[1]) - mm.extra_inputs(top)
        checks.append(("head", mm.product, top, k, _HEAD_SIZES, HEAD_ROWS))
    if head and mm.uses_onednn and lm_head.dtype == paddle.float32:  # last rows: `product_few`
        checks.append(("head_last", mm.product_few, top, lm_head.shape[1], _LAST_SIZES, 256))
    rng = np.random.default_rng(0)
    moved: dict[str, list[int]] = {}
    for name, product, w, k, counts, big in checks:
        x = paddle.to_tensor(rng.standard_normal((big, k)).astype(np.float32))
        if not lm_head.place.is_cpu_place():  # a CPU's activations are float32 (bf16 too)
            x = x.astype(lm_head.dtype)
        whole = _host(product(x, w))
        bad = [
            m
            for m in counts
            if not np.array_equal(_host(product(x[big - m :], w)), whole[..., big - m :, :])
        ]
        if bad:
            moved[name] = bad
    worst = max((m for ms in moved.values() for m in ms), default=0)
    return next((f for f in _FLOORS if f > worst), None), moved


def _host(t: paddle.Tensor) -> np.ndarray:
    """float32 on the host: [rows, n], or [heads, rows, dim] for `qkv`."""
    return t.astype("float32").numpy()


def checked_products(
    device: str,
    threads: int,
    layer: Layer,
    lm_head: paddle.Tensor,
    *,
    in_out: bool,
    gemm: str | None = None,
) -> tuple[Products, int]:
    """The default mode's untiled `Products` (for linear weights laid out as `in_out` says; on
    `gemm`, default `paddle.env.cpu_gemm()`) and the fewest rows a product gets (`row_floor`;
    64 where rows moved at 64 or more, with a warning that hits may then differ by rounding)."""
    mm = Products(device, threads, None, gemm, in_out=in_out)
    floor, moved = row_floor(mm, layer, lm_head)
    if floor is not None:
        return mm, floor
    if device == "cpu" and not os.environ.get(CPU_GEMM_ENV, "").strip() and not mm.uses_onednn:
        # MKL by default, not by the user's choice: oneDNN's products from the same wheel may hold
        # their rows where MKL's do not (an Intel Xeon, 2 threads: MKL's down projection moves
        # at 64-128 rows, oneDNN's at 1 and 8), at MKL's speed there (bench_hit_exact.py cost)
        onednn = Products(device, threads, None, gemm="onednn", in_out=in_out)
        if onednn.uses_onednn:
            floor, also = row_floor(onednn, layer, lm_head)
            if floor is not None:
                log.info(
                    "%s, %d thread(s): MKL's product rows move with the row count at 64 rows "
                    "or more (%s): the products run on oneDNN, whose rows hold from %d rows",
                    device, threads, moved, floor,
                )  # fmt: skip
                return onednn, floor
            moved |= {f"{name} (oneDNN)": counts for name, counts in also.items()}
    log.warning(
        "%s, %d thread(s): product rows move with the row count at 64 rows or more (%s): a "
        "prefix-cache hit may differ from the cache-off answer by float rounding "
        "(deterministic=True, or one thread per worker, keeps hits exact)",
        device,
        threads,
        moved,
    )
    return mm, _FLOORS[-1]
