"""Whether a worker's matrix products give a row the same bits whatever the product's row count,
checked once when the worker starts, and the `Products` its default mode runs on.

The default mode (`deterministic=False`) makes a prefix-cache hit answer what the cache-off run
answers by running every product on at least a floor of rows (zero-padded) and attention on
tiles of absolute positions (`paddle_attention`): the row count then changes no row's bits,
because BLAS libraries take one kernel family for all row counts above some size. That size is
the library's, the CPU's and the thread count's: Intel MKL 2019 (Paddle's wheel) keeps a row
bitwise from 56 rows on an AMD EPYC with 1 thread, from 16 on an Intel Xeon with 1 thread, but
on that Xeon with 2 threads the MLP's down projection moves rows at 63-128 rows against a
1,050-row product (benchmarks/results/mkl_rows.txt, hit_exact.txt). So the worker checks its
own shapes with its own thread count: the last m rows of a 1,050-row product against an m-row
product, m from 16 to 280 (the head: 16-64 rows against 128, the tiles its prompt
log-probabilities run in), on random inputs (kernels are chosen by shape, not values), and pads
to the smallest of 16, 32, 64 rows above every count that moved. A sample, not a proof: row
counts between or beyond those tried are not. Where rows move at 64 or more, a CPU worker runs
the fixed row tiles of `deterministic=True` instead (`Products(tile_rows=64)`: every product
has exactly 64 rows; 4-15% slower on full batches, more on a lone short request) and logs a
warning; a GPU worker only logs it (64-row tiles would waste a GPU; no GPU measured here).
Mixture-of-experts layers' expert products are neither checked nor padded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import paddle

from aioprefill.workers.paddle_gemm import Products
from aioprefill.workers.paddle_weights import Layer

__all__ = ["checked_products", "row_floor"]

_FLOORS = (16, 32, 64)  # the row counts a product is padded to, smallest that holds first
_BIG = 1050  # rows of the reference product ...
_SIZES = (16, 20, 24, 32, 40, 48, 56, 64, 100, 128, 280)  # ... whose last rows these compare
_HEAD, _HEAD_SIZES = 128, (16, 32, 64)  # the head's prompt-logprob tiles: 16..128 rows

log = logging.getLogger("aioprefill.worker")


def row_floor(
    mm: Products, layer: Layer, lm_head: paddle.Tensor
) -> tuple[int | None, dict[str, list[int]]]:
    """The smallest of `_FLOORS` from which no product's rows moved with the row count (None:
    some moved at 64 rows or more), and the row counts at which each product's rows moved."""
    Check = tuple[str, Callable[..., paddle.Tensor], paddle.Tensor, int, tuple[int, ...], int]
    checks: list[Check] = [
        ("qkv", mm.project, layer.qkv, layer.qkv.shape[1], _SIZES, _BIG),
        ("o", mm.linear, layer.o, layer.o.shape[1], _SIZES, _BIG),
    ]
    for name in ("gate_up", "down"):
        w = getattr(layer, name, None)
        if w is not None:  # None: a mixture of experts
            checks.append((name, mm.linear, w, w.shape[1], _SIZES, _BIG))
    checks.append(("head", mm.product, lm_head, lm_head.shape[1], _HEAD_SIZES, _HEAD))
    rng = np.random.default_rng(0)
    moved: dict[str, list[int]] = {}
    for name, product, w, k, counts, big in checks:
        x = paddle.to_tensor(rng.standard_normal((big, k)).astype(np.float32))
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
    device: str, threads: int, layer: Layer, lm_head: paddle.Tensor, tile: int
) -> tuple[Products, int]:
    """The default mode's `Products` and the fewest rows a product gets (`row_floor`): untiled,
    or on a CPU where rows moved at 64 rows or more, fixed tiles of `tile` rows. A GPU keeps
    its untiled products at 64 rows or more either way (64-row tiles would waste it; not
    measured on one), and says so when its rows move."""
    mm = Products(device, threads, None)
    floor, moved = row_floor(mm, layer, lm_head)
    if floor is not None:
        return mm, floor
    tiled = device == "cpu"
    log.warning(
        "%s, %d thread(s): product rows move with the row count at 64 rows or more (%s): %s",
        device,
        threads,
        moved,
        f"the default mode runs fixed tiles of {tile} rows (as deterministic=True)"
        if tiled
        else "a prefix-cache hit may differ from the cache-off answer by float rounding",
    )
    return (Products(device, threads, tile), tile) if tiled else (mm, _FLOORS[-1])
