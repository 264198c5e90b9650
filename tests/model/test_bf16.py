"""bfloat16 on the CPU (`PaddleModel.dtype="bfloat16"`): bf16 weights and products (oneDNN's
`dnnl_gemm_bf16bf16f32`, float32 accumulation; the first layer's activations as bf16x2), the
next-token rows' LM head and the embedding in float32, K/V rounded to bf16 after RoPE with
deterministic=True (by default only as they leave for a slot or an export), everything else
float32. Its answers against the float32 model's, batch invariance (bitwise in both modes), the
output options, the `host()` widening, the KV export's and the slots' rounding, the slots' sizes,
and the dtype policy (`auto`, refusals). The prefix-cache hit == miss checks (bitwise with
deterministic=True, within bf16 rounding by default) run in tests/model/test_prefix_cache.py's
bf16 modes."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import paddle
import pytest

from aioprefill.errors import InvalidConfig
from aioprefill.hf import dtype as hf_dtype
from aioprefill.wire import protocol
from aioprefill.workers.paddle import gemm, onednn
from aioprefill.workers.paddle.attention import _copy_kv
from aioprefill.workers.paddle.head import host
from aioprefill.workers.paddle.last_rows import last_rows_only
from aioprefill.workers.paddle.lo_channels import LO_CHANNELS, _extend_head
from aioprefill.workers.paddle.logits import VOCAB_CHUNK, head_rows
from aioprefill.workers.paddle.ops import round_bf16_
from aioprefill.workers.paddle.runner import PaddleRunner
from aioprefill.workers.prefix_blocks import BlockStore, bf16_bits
from tests.model.batches import make_batch, prompts, small
from tests.model.prefix import ALL, LAST, with_options

# Where the CPU has no bf16 units the worker refuses bfloat16 (test_cpu_dtype_policy, which
# runs everywhere); the tests that compute in bf16 need them.
needs_bf16 = pytest.mark.skipif(
    not (hf_dtype.cpu_bf16_units() and onednn.has_gemm_bf16()),
    reason="this CPU has no avx512_bf16 / AMX, or this paddle wheel no dnnl_gemm_bf16bf16f32",
)
PLP_TOP = protocol.OPT_PROMPT_LOGPROBS | protocol.OPT_PROMPT_TOP_K


@functools.cache
def runner(dtype: str, deterministic: bool = False) -> PaddleRunner:
    return PaddleRunner(small(dtype=dtype, deterministic=deterministic, seed=5))


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round to nearest even, in float64 arithmetic on the values (an independent check)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@needs_bf16
def test_bf16_products_are_float32_sums_of_bf16_inputs() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 96)).astype(np.float32)
    w = rng.standard_normal((80, 96)).astype(np.float32)
    xr, wr = _widen(_bf16_bits(x)).astype(np.float64), _widen(_bf16_bits(w)).astype(np.float64)
    want = xr @ wr.T
    wb = paddle.to_tensor(w).astype("bfloat16")
    for tile in (None, 16):
        mm = gemm.Products("cpu", 1, tile, in_out=False)
        xt = paddle.to_tensor(np.concatenate([x, np.zeros((11, 96), np.float32)]) if tile else x)
        got = np.from_dlpack(mm.linear(xt, wb))[:37]
        assert got.dtype == np.float32
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
        assert np.array_equal(np.from_dlpack(mm.product(paddle.to_tensor(x), wb)), got)
    heads = paddle.to_tensor(w.reshape(2, 40, 96).transpose(0, 2, 1).copy()).astype("bfloat16")
    proj = np.from_dlpack(gemm.Products("cpu", 1, None).project(paddle.to_tensor(x), heads))
    assert np.abs(proj - want.reshape(37, 2, 40).transpose(1, 0, 2)).max() <= 1e-4


@needs_bf16
def test_bf16x2_products_carry_the_activations_to_float32() -> None:
    """`split=True`: x as hi + lo, two bf16 products added in place: the weights' rounding is
    left, the activations' (2^-9 of each value) is not; rows as batch-invariant as one product."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((48, 96)).astype(np.float32)
    w = rng.standard_normal((80, 96)).astype(np.float32)
    wb = paddle.to_tensor(w).astype("bfloat16")
    want = x.astype(np.float64) @ _widen(_bf16_bits(w)).astype(np.float64).T  # weights rounded
    mm = gemm.Products("cpu", 1, None, in_out=False)
    one = np.from_dlpack(mm.linear(paddle.to_tensor(x), wb))
    two = np.from_dlpack(mm.linear(paddle.to_tensor(x), wb, split=True))
    assert np.abs(two - want).max() <= 1e-5 * np.abs(want).max() < np.abs(one - want).max()
    assert np.array_equal(np.from_dlpack(mm.product(paddle.to_tensor(x), wb, split=True)), two)
    tail = np.from_dlpack(mm.linear(paddle.to_tensor(x[-16:]), wb, split=True))
    assert np.array_equal(tail, two[-16:])  # a row's bits whatever the row count (from 16)
    heads = paddle.to_tensor(w.reshape(2, 40, 96).transpose(0, 2, 1).copy()).astype("bfloat16")
    proj = np.from_dlpack(mm.project(paddle.to_tensor(x), heads, split=True))
    assert (
        np.abs(proj - want.reshape(48, 2, 40).transpose(1, 0, 2)).max() <= 1e-5 * np.abs(want).max()
    )


@needs_bf16
def test_bf16_heads_product_and_residual_adds() -> None:
    """q/k/v as one matmul primitive over every head (`onednn.heads_product`): within float32
    rounding of the bf16 sums, a row's bits the same at any row count (1 to 300) and split
    (bf16x2) or not; `add_linear` adds the product into its float32 sum in place, within
    float32 rounding of the separate add, rows as invariant."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 96)).astype(np.float32)
    w = rng.standard_normal((3, 96, 40)).astype(np.float32)
    heads = paddle.to_tensor(w).astype("bfloat16")
    xr, wr = _widen(_bf16_bits(x)).astype(np.float64), _widen(_bf16_bits(w)).astype(np.float64)
    mm = gemm.Products("cpu", 1, None)
    for split in (False, True):
        want = np.einsum("rk,hkd->hrd", x.astype(np.float64) if split else xr, wr)
        whole = np.from_dlpack(mm.project(paddle.to_tensor(x), heads, split=split))
        assert np.abs(whole - want).max() <= 1e-5 * np.abs(want).max()
        for m in (1, 2, 7, 16, 33, 100, 299):
            part = mm.project(paddle.to_tensor(x[-m:]), heads, split=split)
            assert np.array_equal(np.from_dlpack(part), whole[:, -m:]), (split, m)
    wo = paddle.to_tensor(rng.standard_normal((64, 96)).astype(np.float32)).astype("bfloat16")
    acc = rng.standard_normal((300, 64)).astype(np.float32)
    apart = acc + np.from_dlpack(mm.linear(paddle.to_tensor(x), wo))
    into = paddle.to_tensor(acc)
    assert mm.add_linear(into, paddle.to_tensor(x), wo) is into  # in place
    got = np.from_dlpack(into)
    assert np.abs(got - apart).max() <= 1e-5 * np.abs(apart).max()
    tail = paddle.to_tensor(acc[-16:])
    mm.add_linear(tail, paddle.to_tensor(x[-16:]), wo)
    assert np.array_equal(np.from_dlpack(tail), got[-16:])


@needs_bf16
def test_extended_products_carry_their_channels_to_float32() -> None:
    """An extended weight (`Products.extended`: its last s inputs repeat channels `cols`)
    multiplies x's bf16 rounding plus those channels' rest: the f64 sum of exactly that, rows
    bitwise at any row count, in `linear`, `add_linear`, `swiglu_linear`'s planes and
    `project`; and a channel that carries x's outsized values brings the product near float32."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((300, 96)).astype(np.float32)
    x[:, 5] *= 300.0  # an outlier channel, as an LLM's residual stream has
    cols = np.array([5, 17, 40, 81], np.int64)
    bits = _bf16_bits(x)
    lo = _widen(_bf16_bits(x[:, cols] - _widen(bits[:, cols])))
    xe = np.concatenate([_widen(bits), lo], axis=1).astype(np.float64)  # what the product reads
    mm = gemm.Products("cpu", 1, None)
    ext = mm._cast.extend(paddle.to_tensor(x), onednn.Extension(cols))
    got_bits = np.ctypeslib.as_array(ctypes.cast(ext, ctypes.POINTER(ctypes.c_uint16)), (300, 100))
    assert np.array_equal(got_bits[:, :96], bits) and np.array_equal(_widen(got_bits[:, 96:]), lo)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    wb = paddle.to_tensor(np.concatenate([w, w[:, cols]], axis=1)).astype("bfloat16")
    mm.extended[int(wb.data_ptr())] = onednn.Extension(cols)
    assert mm.in_features(wb) == 96 and mm.extra_inputs(wb) == 4
    we = _widen(_bf16_bits(np.concatenate([w, w[:, cols]], axis=1))).astype(np.float64)
    want = xe @ we.T
    whole = np.from_dlpack(mm.linear(paddle.to_tensor(x), wb))
    assert np.abs(whole - want).max() <= 1e-5 * np.abs(want).max()
    exact = x.astype(np.float64) @ we[:, :96].T
    plain = _widen(bits).astype(np.float64) @ we[:, :96].T
    assert np.abs(whole - exact).max() < 0.1 * np.abs(plain - exact).max()
    for m in (16, 17, 33, 299):  # the runner's products have at least 16 rows (paddle.rows)
        part = mm.linear(paddle.to_tensor(x[-m:]), wb)
        assert np.array_equal(np.from_dlpack(part), whole[-m:]), m
    acc = rng.standard_normal((300, 64)).astype(np.float32)
    into = paddle.to_tensor(acc)
    mm.add_linear(into, paddle.to_tensor(x), wb)
    assert np.abs(np.from_dlpack(into) - (acc + want)).max() <= 1e-5 * np.abs(want).max()
    act = np.from_dlpack(mm.swiglu_linear(paddle.to_tensor(x), wb))  # gate | up halves of wb
    gate, up = want[:, :32], want[:, 32:]
    silu_up = gate * 0.5 * (1 + np.tanh(gate / 2)) * up
    assert np.abs(act - silu_up).max() <= 1e-4 * np.abs(silu_up).max()
    h = rng.standard_normal((3, 96, 40)).astype(np.float32)
    hb = paddle.to_tensor(np.concatenate([h, h[:, cols]], axis=1)).astype("bfloat16")
    mm.extended[int(hb.data_ptr())] = onednn.Extension(cols)
    assert mm.in_features(hb, heads=True) == 96
    he = _widen(_bf16_bits(np.concatenate([h, h[:, cols]], axis=1))).astype(np.float64)
    heads = np.from_dlpack(mm.project(paddle.to_tensor(x), hb))
    want_h = np.einsum("rk,hkd->hrd", xe, he)
    assert np.abs(heads - want_h).max() <= 1e-5 * np.abs(want_h).max()
    for m in (16, 17, 100):
        part = mm.project(paddle.to_tensor(x[-m:]), hb)
        assert np.array_equal(np.from_dlpack(part), heads[:, -m:]), m


@needs_bf16
def test_the_extended_head_carries_its_channels_and_their_weights_to_float32() -> None:
    """The LM head's prompt rows (`lo_channels._extend_head`): bf16 [n, k + 2s], the head's
    rounding, then on the s heaviest channels its rounding again and its own rest; x goes as
    [hi, rest, hi] on them: the f64 sum of exactly that, registered at every vocabulary slice
    `head_rows` multiplies, rows bitwise at any row count, and with x's outsized channel and
    the weights' rounding both carried the head lands near float32 (its log-sum-exp too)."""
    rng = np.random.default_rng(12)
    n, k = VOCAB_CHUNK + 300, 64  # two vocabulary slices
    x = rng.standard_normal((200, k)).astype(np.float32)
    x[:, 9] *= 200.0
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    mm = gemm.Products("cpu", 1, None)
    energy = (x.astype(np.float64) ** 2).sum(axis=0)
    wide = _extend_head(mm, paddle.to_tensor(w), energy)
    cols = next(iter(mm.extended.values())).cols
    assert 9 in cols and len(cols) == LO_CHANNELS and wide.shape == [n, k + 2 * LO_CHANNELS]
    assert len(mm.extended) == 2 and mm.extra_inputs(wide) == 2 * LO_CHANNELS
    hi = _widen(_bf16_bits(w))
    bits = np.from_dlpack(wide.view(paddle.uint16))  # [hi, hi on cols, rest on cols]
    assert np.array_equal(_widen(bits[:, :k]), hi)
    assert np.array_equal(_widen(bits[:, k : k + len(cols)]), hi[:, cols])
    assert np.array_equal(
        _widen(bits[:, k + len(cols) :]), _widen(_bf16_bits(w[:, cols] - hi[:, cols]))
    )
    xb = _widen(_bf16_bits(x))
    xe = np.concatenate([xb, _widen(_bf16_bits(x[:, cols] - xb[:, cols])), xb[:, cols]], axis=1)
    want = xe.astype(np.float64) @ _widen(bits).astype(np.float64).T
    for lo in (0, VOCAB_CHUNK):  # each slice as head_rows multiplies it (a view)
        got = np.from_dlpack(mm.product(paddle.to_tensor(x), wide[lo : lo + VOCAB_CHUNK]))
        assert np.abs(got - want[:, lo : lo + VOCAB_CHUNK]).max() <= 1e-5 * np.abs(want).max()
        for m in (16, 17, 100):
            part = mm.product(paddle.to_tensor(x[-m:]), wide[lo : lo + VOCAB_CHUNK])
            assert np.array_equal(np.from_dlpack(part), got[-m:]), (lo, m)
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    plain = xb.astype(np.float64) @ hi.astype(np.float64).T
    assert np.abs(want - exact).max() < 0.1 * np.abs(plain - exact).max()
    f32 = head_rows(paddle.to_tensor(x), paddle.to_tensor(w), mm.product, 0, None)
    got = head_rows(paddle.to_tensor(x), wide, mm.product, 0, None)
    bf16 = head_rows(
        paddle.to_tensor(x), paddle.to_tensor(w).astype("bfloat16"), mm.product, 0, None
    )
    assert np.abs(got.lse - f32.lse).max() < 0.1 * np.abs(bf16.lse - f32.lse).max()
    assert np.array_equal(got.ids, f32.ids)


@needs_bf16
def test_a_bf16_runner_extends_its_products_by_calibration() -> None:
    """A bf16 runner alone picks each dense product's `LO_CHANNELS` channels as it starts (no
    first-layer bf16x2 left), the same ones on every start (a seeded prompt), and answers
    closer to float32 than with bf16x2 on no product at all."""
    a, b = runner("bfloat16"), PaddleRunner(small(dtype="bfloat16", seed=5))
    slices = -(-a.spec.vocab_size // VOCAB_CHUNK)  # the LM head's prompt rows: each slice
    assert a._x2 == (0, 0) and len(a._mm.extended) == 4 * len(a._layers) + slices
    assert a._outputs.prompt_head.dtype == paddle.bfloat16
    for ext in a._mm.extended.values():
        assert len(ext.cols) == LO_CHANNELS
    assert [e.cols.tolist() for e in a._mm.extended.values()] == [
        e.cols.tolist() for e in b._mm.extended.values()
    ]
    f32 = runner("float32")
    ids = prompts(np.random.default_rng(4), [40, 25], f32.spec.vocab_size)
    batch = with_options(make_batch(ids, [0, 1]), [ALL, ALL], [0, 0])
    want = f32.forward(batch).prompt_logprobs
    plain = PaddleRunner(small(dtype="bfloat16", seed=5))
    plain._mm.extended.clear()  # the same weights' first k inputs: x rounded only
    plain._outputs.prompt_head = plain._outputs._lm_head.astype("bfloat16")
    for layer in plain._layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, name)
            setattr(layer, name, w[:, : w.shape[1] - LO_CHANNELS].clone())
    got = np.abs(a.forward(batch).prompt_logprobs - want).mean()
    rounded = np.abs(plain.forward(batch).prompt_logprobs - want).mean()
    assert got < rounded


def test_slots_and_exports_round_to_nearest_even() -> None:
    """Float32 K/V that are not bf16 values (a default-mode bf16 worker's) are rounded as
    Paddle's cast rounds them, not truncated; bf16 values pass exactly; NaNs stay NaN."""
    rng = np.random.default_rng(8)
    a = rng.standard_normal((3, 40, 8)).astype(np.float32)
    want = _bf16_bits(a)
    assert np.array_equal(bf16_bits(a), want)
    cast = paddle.to_tensor(a).astype("bfloat16").astype("float32").numpy()
    assert np.array_equal(_widen(want), cast)
    assert np.array_equal(bf16_bits(_widen(want)), want)  # exact for bf16 values
    assert np.isnan(_widen(bf16_bits(np.array([np.nan, 1.0], np.float32)))[0])
    dst = np.zeros(a.shape, np.uint16)
    _copy_kv(dst, paddle.to_tensor(a))
    assert np.array_equal(dst, want)
    dims = {"num_layers": 1, "kv_heads": 3, "head_dim": 8, "hidden_size": 4}
    store = BlockStore(2, **dims, block_tokens=20, kv_dtype="bfloat16")
    store.write_kv(0, np.array([1, 0]), a, -a)
    k, v = store.read_kv(0, np.array([1, 0]))
    assert np.array_equal(k, cast) and np.array_equal(v, -cast)


def test_round_bf16_matches_paddles_cast_and_keeps_nans() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 50, 16)) * 10.0 ** rng.integers(-20, 20, (3, 50, 16))
    t = paddle.to_tensor(a.astype(np.float32))
    want = t.astype("bfloat16").astype("float32").numpy()
    assert round_bf16_(t) is t
    assert np.array_equal(np.from_dlpack(t), want)
    n = paddle.to_tensor(np.array([np.nan, 1.0, -np.inf], np.float32))
    assert np.isnan(np.from_dlpack(round_bf16_(n))[0])


def test_host_widens_bfloat16() -> None:
    t = paddle.to_tensor(np.array([1.0, 2.5, -3.0], np.float32)).astype("bfloat16")
    got = host(t)
    assert got.dtype == np.float32 and got.tolist() == [1.0, 2.5, -3.0]


@needs_bf16
def test_kv_export_copies_bf16_bits() -> None:
    vals = _widen(_bf16_bits(np.random.default_rng(2).standard_normal((2, 5, 4))))
    dst = np.zeros((2, 5, 4), np.uint16)
    _copy_kv(dst, paddle.to_tensor(vals))  # a CPU worker: float32 holding bf16 values
    assert np.array_equal(_widen(dst), vals)
    dst2 = np.zeros_like(dst)
    _copy_kv(dst2, paddle.to_tensor(vals).astype("bfloat16"))  # a GPU's bf16 tensor
    assert np.array_equal(dst2, dst)


def test_slots_hold_bf16_bits() -> None:
    dims = {"num_layers": 30, "kv_heads": 3, "head_dim": 64, "hidden_size": 576}
    f32 = BlockStore.block_bytes(**dims, block_tokens=16)
    bf16 = BlockStore.block_bytes(**dims, block_tokens=16, kv_dtype="bfloat16")
    assert (f32, bf16) == (776_834, 408_194)  # SmolLM2: 1.90x the tokens per byte
    store = BlockStore(2, **dims, block_tokens=16, kv_dtype="bfloat16")
    assert store.keys.dtype == np.uint16
    assert sum(a.nbytes for a in store.slot_arrays(0)) == bf16
    assert store.layout() != BlockStore(2, **dims, block_tokens=16).layout()
    vals = _widen(_bf16_bits(np.random.default_rng(3).standard_normal((3, 32, 64))))
    store.write_kv(4, np.array([1, 0]), vals, -vals)
    k, v = store.read_kv(4, np.array([1, 0]))
    assert np.array_equal(k, vals) and np.array_equal(v, -vals)


@needs_bf16
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_bf16_answers_near_float32_and_batch_invariant(deterministic: bool) -> None:
    r, f = runner("bfloat16", deterministic), runner("float32")
    ps = prompts(np.random.default_rng(4), [5, 40, 100, 17], 512)
    opts = [ALL, LAST, PLP_TOP, ALL]
    batch = with_options(make_batch(ps), opts, [3] * 4)
    got, want = r.forward(batch), f.forward(batch)
    assert r._outputs._lm_head.dtype == paddle.float32  # the head multiplies in float32
    assert r._layers[0].gate_up.dtype == paddle.bfloat16
    for name in ("logprobs", "prompt_logprobs", "embeddings"):  # as the float32 model's
        assert getattr(got, name).dtype == getattr(want, name).dtype
    assert np.array_equal(got.tokens, want.tokens)
    assert np.abs(got.logprobs - want.logprobs).max() < 0.02
    assert np.abs(got.prompt_logprobs - want.prompt_logprobs).max() < 0.05
    assert np.abs(got.embeddings - want.embeddings).max() < 0.02  # mean and last, normalized
    rows = {0: 0, 1: 1, 3: 2}  # the requests with an embedding: its row
    for i, p in enumerate(ps):  # each alone: bitwise its batched answer (rows invariant)
        alone = r.forward(with_options(make_batch([p]), [opts[i]], [3]))
        assert alone.tokens[0] == got.tokens[i] and alone.logprobs[0] == got.logprobs[i]
        if i in rows:
            assert np.array_equal(alone.embeddings[0], got.embeddings[rows[i]])


@needs_bf16
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_chunks_equal_the_whole_prompt_bitwise(deterministic: bool) -> None:
    """Both modes: the default keeps a prompt's earlier chunks' K/V in float32 (as attended),
    deterministic rounded, and each mode attends to the same values whole or in chunks."""
    r = runner("bfloat16", deterministic)
    p = prompts(np.random.default_rng(6), [130], 512)[0]
    whole = r.forward(with_options(make_batch([p], ids=[1]), [PLP_TOP], [3]))
    plps = []
    for a, b in ((0, 1), (1, 64), (64, 130)):
        out = r.forward(with_options(make_batch([p[a:b]], [2], [a], [b == 130]), [PLP_TOP], [3]))
        plps.append(out.prompt_logprobs)
    assert np.array_equal(np.concatenate(plps), whole.prompt_logprobs)
    assert out.tokens[0] == whole.tokens[0] and out.logprobs[0] == whole.logprobs[0]


@needs_bf16
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_a_next_token_batch_runs_its_last_layer_on_the_last_rows_bitwise(
    deterministic: bool,
) -> None:
    """A batch that needs only each prompt's last row after the last layer (next token, top-k,
    labels, the last row's embedding) runs that layer's attention, o projection and MLP on
    those rows alone: bitwise what the same prompts get beside a request whose prompt logprobs
    keep the layer whole (rows are batch-invariant in bf16, both modes)."""
    r = runner("bfloat16", deterministic)
    ps = prompts(np.random.default_rng(8), [5, 40, 100, 17, 64, 1], 512)
    n = len(ps)
    last_only = with_options(make_batch(ps), [protocol.OPT_EMBED_LAST] * n, [3] * n, labels=[7, 2])
    assert last_rows_only(last_only, None, r._mm, bf16=True)
    extra = prompts(np.random.default_rng(9), [30], 512)
    whole = with_options(
        make_batch([*ps, *extra]), [protocol.OPT_EMBED_LAST] * n + [PLP_TOP], [3] * (n + 1),
        labels=[7, 2],
    )  # fmt: skip
    assert not last_rows_only(whole, None, r._mm, bf16=True)
    got, want = r.forward(last_only), r.forward(whole)
    for name in ("tokens", "logprobs", "top_k_ids", "top_k_logprobs", "label_logprobs"):
        a, b = getattr(got, name), getattr(want, name)
        k = len(a) // n
        assert np.array_equal(a, b[: k * n]), name
    assert np.array_equal(got.embeddings, want.embeddings[:n])


def test_cpu_dtype_policy(monkeypatch) -> None:
    assert onednn.cpu_bf16("float32", "cpu") is False
    assert onednn.cpu_bf16("bfloat16", "gpu:0") is False
    monkeypatch.setattr(onednn, "cpu_bf16_units", lambda: True)
    monkeypatch.setattr(hf_dtype, "cpu_bf16_units", lambda: True)
    assert onednn.cpu_bf16("bfloat16", "cpu") is onednn.has_gemm_bf16() or pytest.fail("no gemm")
    with pytest.raises(InvalidConfig, match="float16 needs a GPU"):
        onednn.cpu_bf16("float16", "cpu")
    assert hf_dtype.resolve_dtype("auto", "bfloat16", "cpu") == "bfloat16"
    assert hf_dtype.resolve_dtype("auto", "float16", "cpu") == "float32"
    assert hf_dtype.resolve_dtype("auto", "float16", "gpu") == "float16"
    assert hf_dtype.resolve_dtype("float32", "bfloat16", "cpu") == "float32"
    monkeypatch.setattr(onednn, "cpu_bf16_units", lambda: False)
    monkeypatch.setattr(hf_dtype, "cpu_bf16_units", lambda: False)
    with pytest.raises(InvalidConfig, match="avx512_bf16 or AMX"):
        onednn.cpu_bf16("bfloat16", "cpu")
    assert hf_dtype.resolve_dtype("auto", "bfloat16", "cpu") == "float32"
    assert hf_dtype.checkpoint_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert hf_dtype.checkpoint_dtype({"dtype": "torch.float16"}) == "float16"
    assert hf_dtype.checkpoint_dtype({}) == "float32"


def test_from_pretrained_takes_the_checkpoints_dtype_where_the_cpu_computes_it() -> None:
    from pathlib import Path

    from aioprefill.config import PaddleModel

    data = Path(__file__).resolve().parents[1] / "data"
    bf16 = "bfloat16" if hf_dtype.cpu_bf16_units() else "float32"
    assert PaddleModel.from_pretrained(data / "hf" / "llama_bf16").dtype == bf16
    assert PaddleModel.from_pretrained(data / "hf" / "llama3_rope").dtype == "float32"
    exact = PaddleModel.from_pretrained(data / "hf" / "llama_bf16", dtype="float32")
    assert exact.dtype == "float32"
    assert PaddleModel.from_pretrained(data / "hf" / "llama_bf16", device="gpu").dtype == "bfloat16"


def test_workers_on_a_cuda_device_start_with_spawn(monkeypatch) -> None:
    from aioprefill.config import EngineConfig, PaddleModel
    from aioprefill.engine.pool import process

    def method(device: str) -> str:
        return process.start_method_for(EngineConfig(model=PaddleModel(device=device)))

    assert method("cpu") == "forkserver" and method("gpu") == "spawn"
    monkeypatch.setattr(process, "_cuda_paddle", lambda: True)
    assert method("auto") == "spawn"
    monkeypatch.setattr(process, "_cuda_paddle", lambda: False)
    assert method("auto") == "forkserver"


def test_parallel_groups_check_the_device_once_it_is_picked(monkeypatch) -> None:
    """A CPU model on a CUDA build may form a group (paddle's default device there is a GPU,
    which the group no longer reads); a GPU one is refused once its device is known."""
    from aioprefill.config import PaddleModel
    from aioprefill.workers.paddle import runner as paddle_runner

    monkeypatch.setattr(paddle, "is_compiled_with_cuda", lambda: True)
    monkeypatch.setattr(paddle.device.cuda, "device_count", lambda: 2)
    pick = paddle_runner._pick_device
    assert pick(PaddleModel(device="cpu"), 0, True) == "cpu"
    assert pick(PaddleModel(device="auto"), 1, False) == "gpu:1"
    with pytest.raises(InvalidConfig, match="tensor/expert parallelism runs on CPU"):
        pick(PaddleModel(device="auto"), 0, True)


def test_a_quantized_gguf_stays_float32_under_auto() -> None:
    from aioprefill.config import PaddleModel
    from tests.hf.smollm2 import gguf_path

    assert PaddleModel.from_pretrained(gguf_path()).dtype == "float32"  # Q4_1 / Q8_0
    assert PaddleModel.from_pretrained(gguf_path(), dtype="bfloat16").dtype == "bfloat16"


@needs_bf16
def test_moe_in_bf16_keeps_its_experts_float32() -> None:
    """A mixture of experts in bfloat16: attention and the head's prompt rows in bf16, the
    experts float32."""
    ps = prompts(np.random.default_rng(0), [5, 40], 512)
    spec = small(num_experts=4, num_experts_per_tok=2, seed=11)
    want = PaddleRunner(spec).forward(make_batch(ps))
    bf16 = PaddleRunner(small(**{**_fields(spec), "dtype": "bfloat16"}))
    got = bf16.forward(make_batch(ps))
    assert np.abs(got.logprobs - want.logprobs).max() < 0.01
    # its first layers on bf16x2 as before, the head's prompt rows extended (lo_channels)
    assert bf16._x2 == (1, 4) and bf16._outputs.prompt_head.dtype == paddle.bfloat16
    assert all(e.weight_rest for e in bf16._mm.extended.values())
    batch = with_options(make_batch(ps), [ALL, ALL], [0, 0])
    plp, plp32 = bf16.forward(batch).prompt_logprobs, PaddleRunner(spec).forward(batch)
    assert np.abs(plp - plp32.prompt_logprobs).max() < 0.05


def _fields(spec) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


@needs_bf16
@pytest.mark.asyncio
async def test_a_bf16_checkpoint_through_the_engine_with_its_prefix_cache() -> None:
    """tests/data/hf/llama_bf16 (bf16 weights: exact in bf16) under dtype auto, in a real worker
    process, prompts chunked beside each other: near transformers' float64 golden, and a second
    pass (alone, prefix-cache hits) bitwise the first with deterministic=True."""
    import asyncio
    from pathlib import Path

    from aioprefill import Engine
    from aioprefill.config import EngineConfig, PaddleModel
    from tests.hf.goldens import expected

    path = Path(__file__).parents[1] / "data/hf/llama_bf16"
    model = PaddleModel.from_pretrained(path, deterministic=True)
    assert model.dtype == "bfloat16"
    exp = expected("llama_bf16")
    config = EngineConfig(model=model, max_batch_tokens=64, prefix_cache_bytes=8 << 20)
    async with Engine(config) as engine:
        first = await asyncio.gather(*(engine.prefill(p) for p in exp["prompts"]))
        again = [await engine.prefill(p) for p in exp["prompts"]]
    assert any(r.num_chunks > 1 for r in first) and any(r.cached_tokens for r in again)
    for got, hit, token, logprob in zip(first, again, exp["tokens"], exp["logprobs"], strict=True):
        assert abs(got.logprob - logprob) < 0.05
        assert (hit.token, hit.logprob) == (got.token, got.logprob)
        assert got.token == token
