"""`PaddleRunner`: a Llama-style decoder's prefill over a packed batch, in PaddlePaddle.

Requests sit back to back in one `[tokens, hidden]` matrix, with no padding between them: the
linear layers, norms and MLP run over every token of the batch at once, and only attention runs
per sequence (a block-diagonal mask over the whole batch costs O(tokens^2) on CPU). A chunk with
`start_pos > 0` continues a prompt whose earlier chunks this runner saw: their keys and values
(after RoPE) wait in `self._cache` until the chunk with `is_last` (or `free()`). With a prefix
cache, a batch's plan reads and writes block slots (`paddle.prefix`, `prefix_blocks`). The weights
come from `paddle.weights`, laid out for this forward (q/k/v heads-major in one tensor, queries
pre-scaled, a sign-folded RoPE sin): that module's docstring is the contract. bfloat16 on a CPU:
bf16 products (`paddle.gemm`), float32 elsewhere; its K/V and invariants: docs/configuration.md.

Batch invariance. A request's result must not depend on its batch-mates. Attention is per
sequence and norms and element-wise ops are per row, so batching leaks in through the matrix
products (and the LM head's reductions): BLAS picks kernels by shape, and MKL computes a row
with other kernels, whose sums round differently, when the product has few rows, when the row
sits in a trailing partial block, or (for some row counts) by its position. By default that is
allowed: a request's log-probability moves by ~1e-7 between batch compositions (the tests hold
it to 1e-5), but a prefix-cache hit or a chunk cut changes no bit: every product has at least
`_floor` rows (zero-padded), from which a row's result does not move with the row count
(checked when the runner starts, `paddle.rows`; where it fails, a warning), and attention
runs on query tiles of `_ATTN_TILE` absolute positions, zero-padded to whole tiles (MKL's
attention products moved a row's bits with a tile's row count on an AMD EPYC).
`deterministic=True` makes results bitwise identical by never letting a shape depend on the
batch: the linear layers multiply fixed tiles of `_TILE_ROWS` rows and the LM head fixed tiles
of `_HEAD_TILE_ROWS` rows, zero-padded (MKL treated every row position of a 64- or 16-row
product alike, not of a 32-row one; tests check it bitwise): ~1.1x the cost on full batches,
up to 2.3x on a lone short request (benchmarks/bench_paddle_model.py).

Imported only in worker processes (a forkserver may preload it): it imports paddle, first setting
MKL's CPU dispatch on AMD; a CPU runner changes how glibc keeps freed memory (`paddle.env`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import warnings

from aioprefill.workers.paddle.env import (
    bf16_float32_gemm,
    configure_math_libraries,
    keep_freed_memory,
    quiet_native_logs,
)

configure_math_libraries()
quiet_native_logs()

import numpy as np  # noqa: E402

# paddle's import warns that ccache (a C++ compiler cache) is missing: noise here.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)
import paddle  # noqa: E402
import paddle.nn.functional as F  # noqa: E402

from aioprefill.errors import InvalidConfig  # noqa: E402
from aioprefill.models import PaddleModel  # noqa: E402
from aioprefill.parallel import ParallelMode  # noqa: E402
from aioprefill.wire.kv import kv_layout  # noqa: E402
from aioprefill.workers.collectives import PaddleGroup  # noqa: E402
from aioprefill.workers.kv_writer import KVWriters, open_writers  # noqa: E402
from aioprefill.workers.paddle.attention import KVCache, attend_rows, export_layer  # noqa: E402
from aioprefill.workers.paddle.checks import check_batch  # noqa: E402
from aioprefill.workers.paddle.gemm import Products, weights_in_out  # noqa: E402
from aioprefill.workers.paddle.head import OutputHead  # noqa: E402
from aioprefill.workers.paddle.last_rows import last_rows_only, put_rows, take_rows  # noqa: E402
from aioprefill.workers.paddle.lo_channels import extend_runner  # noqa: E402
from aioprefill.workers.paddle.norm import rms_norm_for  # noqa: E402
from aioprefill.workers.paddle.onednn import cpu_bf16  # noqa: E402
from aioprefill.workers.paddle.ops import Rope, round_bf16_  # noqa: E402
from aioprefill.workers.paddle.prefix import PrefixForward, keep_tail  # noqa: E402
from aioprefill.workers.paddle.rows import checked_products  # noqa: E402
from aioprefill.workers.paddle.shard import Shard  # noqa: E402
from aioprefill.workers.paddle.weights import Layer, load_to_device, rope_tables  # noqa: E402
from aioprefill.workers.prefix_blocks import BatchPlan, BlockStore  # noqa: E402
from aioprefill.workers.runner import ForwardBatch, ForwardOutput  # noqa: E402

__all__ = ["PaddleRunner"]

# deterministic=True: every linear layer multiplies exactly this many rows at a time, and the
# LM head this many (it is wide: 32000 columns; padding it to 64 rows would cost ~13 ms on CPU).
_TILE_ROWS = 64
_HEAD_TILE_ROWS = 16
# ... and attention runs queries in tiles of this many absolute positions (paddle.attention).
_ATTN_TILE = 64
# bf16 on a CPU: bf16x2 on each product's heaviest input channels (`lo_channels`), or where it
# cannot (MoE) on this many first layers' products and this many first layers' q/k/v
_BF16X2_LAYERS, _BF16X2_QKV_LAYERS = 1, 4


def _pick_device(spec: PaddleModel, worker_index: int, grouped: bool = False) -> str:
    has_cuda = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if spec.device == "gpu" and not has_cuda:
        raise InvalidConfig("PaddleModel.device: 'gpu' but this paddle has no CUDA device")
    if spec.device == "cpu" or not has_cuda:
        return "cpu"
    if grouped:  # checked here, once the device is known
        raise InvalidConfig("tensor/expert parallelism runs on CPU (gloo): use device='cpu'")
    return f"gpu:{worker_index % paddle.device.cuda.device_count()}"


class PaddleRunner:
    """The `ModelRunner` for `PaddleModel`: one device, packed batches, chunked-prefill state.

    `device` is `"cpu"` or `"gpu:N"`. With `spec.device="auto"` worker `i` takes GPU
    `i % device_count` when paddle has CUDA, else the CPU with `spec.num_threads` threads.
    Weights come from `spec.weights` (safetensors, HF names) or `random_weights(spec, spec.seed)`.
    `forward` raises ValueError for a batch it cannot run (bad token ids, a chunk that does not
    continue what this runner holds) before running anything.

    `prefix_cache_bytes` > 0 keeps that many bytes of prefix-cache slots (`prefix_blocks`):
    `cache_blocks` slots of `block_bytes` each, which the batches' plans read and write.
    """

    device: str

    def __init__(
        self,
        spec: PaddleModel,
        worker_index: int = 0,
        group: PaddleGroup | None = None,
        mode: ParallelMode = "none",
        *,
        prefix_cache_bytes: int = 0,
        block_tokens: int = 16,
    ) -> None:
        self.spec = spec
        self._shard = Shard(spec, group, mode)  # parallel: this rank's share (paddle.shard)
        self.device = _pick_device(spec, worker_index, group is not None)
        self._bf16 = cpu_bf16(spec.dtype, self.device)  # InvalidConfig where the CPU cannot
        paddle.set_device(self.device)
        self._rms_norm = rms_norm_for(self.device)
        if self.device == "cpu":
            keep_freed_memory()
            # MKL's thread count (paddle's default is 1; OMP_NUM_THREADS is read too early)
            paddle.base.core.set_num_threads(spec.num_threads)
        elif spec.dtype == "float32":
            # float32 means float32: no TF32 tensor-core products (10-bit mantissas).
            with contextlib.suppress(ValueError):
                paddle.set_flags({"FLAGS_allow_tf32_cublas": False})
        with paddle.no_grad():
            in_out = weights_in_out(self.device, spec.dtype)  # linear weights' layout
            weights = load_to_device(spec, self._shard, in_out=in_out, bf16=self._bf16)
            self._cos, self._sin = rope_tables(spec, spec.max_position_embeddings, self._bf16)
        self._embed, self._layers = weights.embed, weights.layers
        self._cache: dict[int, KVCache] = {}
        self._deterministic = spec.deterministic
        # bf16 K/V rounded where made (hit == miss bitwise), else only as stored: configuration.md
        self._round_kv = self._bf16 and spec.deterministic
        # products: oneDNN on a CPU (paddle.gemm); fixed row tiles, or >= _floor rows (paddle.rows)
        threads, first = spec.num_threads, self._layers[0]
        gemm = bf16_float32_gemm() if self._bf16 else None  # the float32 head's library
        self._mm, self._floor = (
            (Products(self.device, threads, _TILE_ROWS, gemm, in_out=in_out), _TILE_ROWS)
            if self._deterministic
            else checked_products(
                self.device, threads, first, weights.lm_head, in_out=in_out, gemm=gemm
            )
        )
        self._tiled = self._mm.tile_rows is not None
        tile = _HEAD_TILE_ROWS if self._tiled else None
        self._outputs = OutputHead(
            weights.lm_head,
            weights.norm,
            spec.rms_norm_eps,
            rms_norm=self._rms_norm,
            tile_rows=tile,
            min_rows=self._floor,
            shard=self._shard,
            product=self._mm.product,
            pad_last=self._bf16,  # float32 head: rows bitwise from the floor, as bf16 layers
            product_last=self._mm.product_few if self._bf16 else None,
        )
        self._kv_share = self._shard.kv_share()  # parallel: this rank's KV heads of an export
        shape = {
            "num_layers": spec.num_layers,
            "kv_heads": self._shard.kv_heads,
            "head_dim": spec.head_dim,
            "hidden_size": spec.hidden_size,
            "block_tokens": block_tokens,
        }
        self.block_bytes = BlockStore.block_bytes(**shape, kv_dtype=spec.dtype)  # bf16: bits
        self.cache_blocks = max(0, prefix_cache_bytes) // self.block_bytes
        self._store: BlockStore | None = None
        if self.cache_blocks:
            self._store = BlockStore(self.cache_blocks, **shape, kv_dtype=spec.dtype)
        self.cache_slots = self._store  # what the KV store tier loads into (workers.store_hook)
        self._exports = KVWriters()  # KV exports the running forward writes
        self._x2 = (_BF16X2_LAYERS, _BF16X2_QKV_LAYERS) if self._bf16 else (0, 0)
        if self._bf16 and self._shard.ep_size == 1:  # (a mixture of experts: its head only)
            self._x2 = extend_runner(self, weights.lm_head)

    # ------------------------------------------------------------------ public interface

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one packed batch; results for the requests whose `is_last` is set, in order."""
        if self._shard.ep_size > 1 and not self._shard.in_step(batch, self._check, self._forward):
            return ForwardOutput(*(np.empty(0, dtype=t) for t in (np.int64, np.int32, np.float64)))
        self._check(batch)
        try:
            with paddle.no_grad():
                return self._forward(batch)
        except BaseException:
            # attend() extends a request's cache layer by layer: after a failure part-way the
            # layers disagree, so the batch's chunked requests cannot continue.
            self.free(batch.request_ids)
            self._exports.discard()
            raise
        finally:
            self._exports = KVWriters()

    def free(self, request_ids: np.ndarray) -> None:
        """Drop the KV state kept for these requests (unknown ids are ignored)."""
        rids = [int(rid) for rid in np.asarray(request_ids).tolist()]
        for rid in rids:
            self._cache.pop(rid, None)
        self._outputs.free(rids)

    @property
    def num_cached(self) -> int:
        """How many requests have KV state waiting for their next chunk."""
        return len(self._cache)

    # ------------------------------------------------------------------ internals

    def _mlp(self, h: paddle.Tensor, layer: Layer, split: bool = False) -> paddle.Tensor:
        """The dense SwiGLU MLP, or the layer's mixture of experts (partial sums under TP)."""
        if layer.moe is not None:
            return layer.moe.forward(h, self._shard.group if self._shard.ep_size > 1 else None)
        act = self._mm.swiglu_linear(h, layer.gate_up, split=split)  # silu(gate) * up
        return self._linear(act, layer.down, split)

    def _check(self, batch: ForwardBatch) -> None:
        check_batch(batch, self.spec, self._store, self._cache)

    def _linear(self, x: paddle.Tensor, w: paddle.Tensor, split: bool = False) -> paddle.Tensor:
        """x @ w.T (tiled: `_TILE_ROWS` rows at a time); `split`: bf16x2 (`self._x2`)."""
        return self._mm.linear(x, w, split=split)

    def _project(self, x: paddle.Tensor, w: paddle.Tensor, split: bool = False) -> paddle.Tensor:
        """[rows, hidden] x [heads, hidden, dim] -> [heads, rows, dim]; tiled like `_linear`."""
        return self._mm.project(x, w, split=split)

    def _padded(self, rows: int, tile: int) -> int:
        return -(-rows // tile) * tile if self._tiled else max(rows, self._floor)

    def _after_attention(
        self, x: paddle.Tensor, attn: paddle.Tensor, layer: Layer, split: bool
    ) -> paddle.Tensor:
        """A layer from its attention output on: o projection, residual, norm, MLP, residual.
        Alone (no TP) the dense products add into x in place (`Products.add_linear`)."""
        if self._shard.tp_size > 1 or layer.moe is not None:
            x = x + self._shard.reduce(self._linear(attn, layer.o, split))
            h = self._rms_norm(x, layer.post_norm, self.spec.rms_norm_eps)
            return x + self._shard.reduce(self._mlp(h, layer, split))
        x = self._mm.add_linear(x, attn, layer.o, split=split)
        h = self._rms_norm(x, layer.post_norm, self.spec.rms_norm_eps)
        act = self._mm.swiglu_linear(h, layer.gate_up, split=split)  # silu(gate) * up
        return self._mm.add_linear(x, act, layer.down, split=split)

    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        spec = self.spec
        heads, kv_heads, dim = self._shard.heads, self._shard.kv_heads, spec.head_dim
        offsets = batch.offsets.astype(np.int64)
        lens = np.diff(offsets)
        total = int(offsets[-1])
        rows = self._padded(total, _TILE_ROWS)  # padding rows: token 0 at position 0, ignored
        positions = np.zeros(rows, dtype=np.int64)
        positions[:total] = np.arange(total) - np.repeat(offsets[:-1] - batch.start_pos, lens)
        ids = np.zeros(rows, dtype=np.int64)
        ids[:total] = batch.tokens
        x = F.embedding(paddle.to_tensor(ids), self._embed)  # bf16 on a CPU: float32 rows
        starts = batch.start_pos.tolist()
        rope = Rope(self._cos, self._sin, positions)  # this batch's rows of the tables
        qk_heads = heads + kv_heads

        request_ids = batch.request_ids.tolist()
        is_last = batch.is_last.tolist()
        plan = BatchPlan.of(batch)
        fresh = [not s or (plan is not None and len(plan.reads[i])) for i, s in enumerate(starts)]
        caches = [
            KVCache(spec.num_layers) if new else self._cache[rid]
            for rid, new in zip(request_ids, fresh, strict=True)
        ]
        prefix = (
            None if plan is None or self._store is None else PrefixForward(self._store, plan, batch)
        )
        att = functools.partial(attend_rows, tile=_ATTN_TILE, mm=self._mm, bf16=self._bf16)
        # a next-token batch: the last layer from attention on for each last row alone
        trim = self._shard.ep_size == 1 and last_rows_only(batch, plan, self._mm, self._bf16)
        keep = [not last for last in is_last]
        bounds = list(itertools.pairwise(offsets.tolist()))
        exports = self._exports = open_writers(batch, kv_layout(spec), self._kv_share)
        eps, rms_norm = spec.rms_norm_eps, self._rms_norm
        for index, layer in enumerate(self._layers):
            split = index < self._x2[0]
            h = rms_norm(x, layer.in_norm, eps)
            qkv = self._project(h, layer.qkv, index < self._x2[1])  # [heads + 2 kv_heads, rows, d]
            if layer.qkv_bias is not None:
                # Spread over the rows by a rank-1 product, then an equal-shape add: paddle's CPU
                # broadcast add cost 8x more (0.1 vs 0.015 ms over 16 rows, 13 vs 10 at 2048).
                ones = paddle.ones([1, rows, 1], dtype=qkv.dtype)
                qkv = qkv + paddle.matmul(ones, layer.qkv_bias)
            qk = qkv[:qk_heads]
            if layer.q_norm is not None and layer.k_norm is not None:
                qk = paddle.concat(
                    [
                        rms_norm(qk[:heads], layer.q_norm, eps),
                        rms_norm(qk[heads:], layer.k_norm, eps),
                    ]
                )
            qk = rope(qk)  # in place on a CPU
            q = qk[:heads].reshape([kv_heads, heads // kv_heads, rows, dim])
            k, v = qk[heads:], qkv[qk_heads:]
            if self._round_kv:  # K/V as a bf16 slot holds them: a hit reads what was attended to
                k, v = round_bf16_(k), round_bf16_(v)

            def before(i: int, cache: KVCache, index: int = index, k=k, v=v) -> None:
                if prefix is not None:  # cached K/V in, completed blocks out, in batch order
                    prefix.at_layer(index, i, cache, k, v)
                if i in exports:  # before attention extends the cache
                    export_layer(exports[i], index, cache, k, v, *bounds[i])

            if trim and index == len(self._layers) - 1:  # row i: sequence i's last
                n = self._padded(len(bounds), _TILE_ROWS)
                attn = att(q, k, v, bounds, caches, keep, index, n, before, last_only=True)
                ends = offsets[1:] - 1
                put_rows(x, ends, self._after_attention(take_rows(x, ends, n), attn, layer, split))
                break
            attn = att(q, k, v, bounds, caches, keep, index, rows, before)  # [rows, heads * dim]
            x = self._after_attention(x, attn, layer, split)

        prefixes = {} if prefix is None else prefix.after_layers(x, batch, caches, last_rows=trim)
        ends = (batch.start_pos + lens).tolist()
        for i, (rid, cache, last) in enumerate(zip(request_ids, caches, is_last, strict=True)):
            if last:
                self._cache.pop(rid, None)
                continue
            if self._store is not None:  # the unfinished block, for the next chunk's write
                b = self._store.block_tokens
                keep_tail(cache, x, batch.tokens, bounds[i][0], starts[i], ends[i], b)
            cache.length = ends[i]
            self._cache[rid] = cache
        out = self._outputs(x, batch, prefixes)
        if prefix is not None:
            prefix.finish(batch, out)
        exports.close()
        return out
