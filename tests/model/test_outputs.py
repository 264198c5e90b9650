"""PaddleRunner's output options against the float64 NumPy reference: prompt log-probabilities,
top-k, embeddings and the KV export; solo, batched and chunked give the same values."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from aioprefill.config import PaddleModel
from aioprefill.hf.weights import random_weights
from aioprefill.wire import protocol
from aioprefill.wire.kv import KVExports
from aioprefill.workers.paddle.runner import PaddleRunner
from aioprefill.workers.runner import ForwardBatch, ForwardOutput
from tests.model.batches import SMALL, prompts, runner
from tests.model.reference import as64, decode_logits, full

PLP, LAST, MEAN, NORM, KV = (
    protocol.OPT_PROMPT_LOGPROBS,
    protocol.OPT_EMBED_LAST,
    protocol.OPT_EMBED_MEAN,
    protocol.OPT_NORMALIZE,
    protocol.OPT_RETURN_KV,
)


def batch(
    chunks: list[np.ndarray],
    opts: list[int],
    top_k: list[int] | None = None,
    ids: list[int] | None = None,
    starts: list[int] | None = None,
    last: list[bool] | None = None,
    kv_names: tuple[str, ...] = (),
) -> ForwardBatch:
    n = len(chunks)
    offsets = np.zeros(n + 1, dtype=np.int32)
    offsets[1:] = np.cumsum([len(c) for c in chunks])
    return ForwardBatch(
        request_ids=np.asarray(range(n) if ids is None else ids, dtype=np.int64),
        offsets=offsets,
        tokens=np.concatenate(chunks).astype(np.int32),
        start_pos=np.asarray([0] * n if starts is None else starts, dtype=np.int32),
        is_last=np.asarray([True] * n if last is None else last, dtype=bool),
        options=np.asarray(opts, dtype=np.uint8),
        top_k=np.asarray([0] * n if top_k is None else top_k, dtype=np.int32),
        kv_names=kv_names,
    )


def split(out: ForwardOutput, lens: list[int], opts: list[int], top_k: list[int]):
    """Per request: (prompt logprobs, top-k ids, top-k logprobs, embedding or None)."""
    plp = iter(
        np.split(
            out.prompt_logprobs,
            np.cumsum([n - 1 for n, o in zip(lens, opts, strict=True) if o & PLP])[:-1],
        )
    )
    k_at = np.cumsum([0, *top_k])
    emb = iter(out.embeddings)
    res = []
    for i, (o, k) in enumerate(zip(opts, top_k, strict=True)):
        res.append(
            (
                next(plp) if o & PLP else None,
                out.top_k_ids[k_at[i] : k_at[i] + k],
                out.top_k_logprobs[k_at[i] : k_at[i] + k],
                next(emb) if o & (LAST | MEAN) else None,
            )
        )
    return res


@pytest.fixture(scope="module")
def ref64():
    return as64(random_weights(SMALL, SMALL.seed))


def test_prompt_logprobs_top_k_and_embeddings_match_reference(ref64) -> None:
    rng = np.random.default_rng(11)
    lens = [1, 2, 9, 40, 77]
    ps = prompts(rng, lens, SMALL.vocab_size)
    opts = [PLP | LAST, PLP | MEAN | NORM, 0, PLP | MEAN, LAST | NORM]
    top_k = [3, 0, 5, 1, SMALL.vocab_size]
    out = runner(SMALL).forward(batch(ps, opts, top_k))
    for p, o, k, (plp, ids, lps, emb) in zip(
        ps, opts, top_k, split(out, lens, opts, top_k), strict=True
    ):
        ref = full(SMALL, ref64, p)
        if o & PLP:
            assert plp.dtype == np.float32 and plp.shape == (len(p) - 1,)
            np.testing.assert_allclose(plp, ref.prompt_logprobs(p), atol=1e-4, rtol=0)
        last = ref.log_probs[-1]
        assert ids.dtype == np.int32 and lps.dtype == np.float32 and len(ids) == k
        order = np.argsort(-last, kind="stable")[:k]
        np.testing.assert_allclose(lps, last[order], atol=1e-4, rtol=0)
        assert (np.diff(lps) <= 0).all(), "best first"
        # Ids agree wherever the reference's neighbours are not within float32 noise.
        gaps = np.abs(np.diff(last[order]))
        clear = np.ones(k, dtype=bool)
        clear[:-1] &= gaps > 1e-4
        clear[1:] &= gaps > 1e-4
        assert (ids[clear] == order[clear]).all()
        if o & (LAST | MEAN):
            want = ref.hidden[-1] if o & LAST else ref.hidden.mean(axis=0)
            if o & NORM:
                want = want / np.linalg.norm(want)
                assert abs(float(np.linalg.norm(emb)) - 1.0) < 1e-6
            assert emb.dtype == np.float32 and emb.shape == (SMALL.hidden_size,)
            np.testing.assert_allclose(emb, want, atol=1e-4, rtol=0)


def test_log_softmax_is_float64_accurate_on_a_32000_vocabulary() -> None:
    """The default tiny model: the log-softmax sums exponentials with a float64 accumulator, so
    what is left is the float32 forward's own error (paddle's float32 sum lost ~4e-5)."""
    spec = PaddleModel(seed=0)
    w64 = as64(random_weights(spec, spec.seed))
    p = prompts(np.random.default_rng(5), [24], spec.vocab_size)[0]
    out = runner(spec).forward(batch([p], [PLP], [4]))
    ref = full(spec, w64, p)
    worst = max(
        float(np.abs(out.prompt_logprobs - ref.prompt_logprobs(p)).max()),
        abs(float(out.logprobs[0]) - float(ref.log_probs[-1].max())),
    )
    print(f"worst |d logprob| on the 32000-vocab model: {worst:.2e}")
    assert worst < 1e-5


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_solo_batched_and_chunked_agree(deterministic: bool) -> None:
    spec = PaddleModel(**{**_fields(SMALL), "deterministic": deterministic})
    r = PaddleRunner(spec) if deterministic else runner(SMALL)
    rng = np.random.default_rng(12)
    p = prompts(rng, [90], spec.vocab_size)[0]
    opts, k = PLP | MEAN | NORM, 7
    solo = split(r.forward(batch([p], [opts], [k], ids=[5])), [90], [opts], [k])[0]
    others = prompts(rng, [3, 30, 12], spec.vocab_size)
    mixed = r.forward(
        batch([others[0], p, *others[1:]], [LAST, opts, 0, PLP], [2, k, 0, 0], ids=[1, 5, 2, 3])
    )
    batched = split(mixed, [3, 90, 30, 12], [LAST, opts, 0, PLP], [2, k, 0, 0])[1]
    plps, cuts = [], [0, 25, 26, 60, 90]
    for a, b in itertools.pairwise(cuts):
        out = r.forward(
            batch(
                [others[1], p[a:b]],
                [PLP, opts],
                [0, k],
                ids=[9, 5],
                starts=[0, a],
                last=[True, b == 90],
            )
        )
        plps.append(out.prompt_logprobs[29:])  # after the companion's 29 values
    chunked = (np.concatenate(plps), out.top_k_ids, out.top_k_logprobs, out.embeddings[0])
    assert r.num_cached == 0 and r._outputs.num_cached == 0
    for got, want in zip(batched, solo, strict=True):
        if deterministic:  # bitwise, whatever the batch-mates and their options
            assert np.array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for got, want in zip(chunked, solo, strict=True):  # chunking changes sums: within 1e-5
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _fields(spec: PaddleModel) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


def export(r: PaddleRunner, ledger: KVExports, p: np.ndarray, cuts: list[int]):
    """Prefill `p` (in chunks cut at `cuts`) with its KV exported; returns the open handle."""
    ticket = ledger.reserve(len(p))
    bounds = [0, *cuts, len(p)]
    for a, b in itertools.pairwise(bounds):
        r.forward(
            batch([p[a:b]], [KV], ids=[77], starts=[a], last=[b == len(p)], kv_names=(ticket.name,))
        )
    return ledger.open(ticket)


@pytest.mark.parametrize("cuts", [[], [17], [5, 40]], ids=["whole", "2-chunks", "3-chunks"])
def test_kv_export_drives_a_decode_step(ref64, cuts: list[int]) -> None:
    """Prefill p with its KV exported; one decode step for token t in the reference, reading only
    that KV, gives the next-token log-probabilities of a prefill of p + [t]."""
    r = runner(SMALL)
    ledger = KVExports(SMALL, 1 << 26)
    rng = np.random.default_rng(13)
    p = prompts(rng, [60], SMALL.vocab_size)[0]
    t = int(rng.integers(0, SMALL.vocab_size))
    with export(r, ledger, p, cuts) as kv:
        assert kv.keys.shape == (SMALL.num_layers, SMALL.num_kv_heads, 60, SMALL.head_dim)
        assert kv.keys.dtype == np.float32 and not kv.keys.flags.writeable
        ref = full(SMALL, ref64, p)
        np.testing.assert_allclose(kv.keys, ref.keys, atol=1e-4, rtol=0)
        np.testing.assert_allclose(kv.values, ref.values, atol=1e-4, rtol=0)
        logits = decode_logits(
            SMALL, ref64, kv.keys.astype(np.float64), kv.values.astype(np.float64), t
        )
    assert ledger.num_open == 0 and ledger.used_bytes == ledger.pooled_bytes  # kept for reuse
    ledger.close_all()
    assert ledger.used_bytes == 0
    out = r.forward(batch([np.append(p, t)], [0], [SMALL.vocab_size]))
    m = logits.max()
    want = logits - m - np.log(np.exp(logits - m).sum())
    got = np.empty(SMALL.vocab_size)
    got[out.top_k_ids] = out.top_k_logprobs
    assert np.abs(got - want).max() <= 1e-4


def test_kv_export_of_a_failed_forward_is_removed() -> None:
    r = PaddleRunner(SMALL)
    ledger = KVExports(SMALL, 1 << 26)
    ticket = ledger.reserve(4)
    bad = batch([np.array([1, 2, 3, SMALL.vocab_size + 5])], [KV], kv_names=(ticket.name,))
    with pytest.raises(ValueError):
        r.forward(bad)  # refused before the segment exists
    good = batch([np.array([1, 2, 3, 4])], [KV], kv_names=(ticket.name,))
    r._layers = [*r._layers[:1], None]  # type: ignore[list-item]  # the forward fails part-way
    with pytest.raises(AttributeError):
        r.forward(good)
    from pathlib import Path

    assert not Path("/dev/shm", ticket.name).exists()
    ledger.release(ticket)
    assert ledger.used_bytes == 0
