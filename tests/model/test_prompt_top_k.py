"""PaddleRunner's prompt top-k (`OPT_PROMPT_TOP_K`) against the float64 NumPy reference: the
`top_k` best tokens at every prompt position, only for the requests that ask, with the same
values solo, batched with other options, and chunked."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from aioprefill.config import PaddleModel
from aioprefill.hf.weights import random_weights
from aioprefill.wire import protocol
from aioprefill.workers.paddle.runner import PaddleRunner
from aioprefill.workers.runner import ForwardOutput
from tests.model.batches import SMALL, prompts, runner
from tests.model.reference import as64, full
from tests.model.test_outputs import batch

PLP, PTK, MEAN = protocol.OPT_PROMPT_LOGPROBS, protocol.OPT_PROMPT_TOP_K, protocol.OPT_EMBED_MEAN


def per_request(out: ForwardOutput, rows: list[int], opts: list[int], top_k: list[int]):
    """Per request: (prompt logprobs or None, prompt top-k ids [rows, k], logprobs) or Nones."""
    plp_at = ptk_at = 0
    res = []
    for n, o, k in zip(rows, opts, top_k, strict=True):
        plp = ids = lps = None
        if o & PLP:
            plp = out.prompt_logprobs[plp_at : plp_at + n]
            plp_at += n
        if o & PTK:
            ids = out.prompt_top_k_ids[ptk_at : ptk_at + n * k].reshape(n, k)
            lps = out.prompt_top_k_logprobs[ptk_at : ptk_at + n * k].reshape(n, k)
            ptk_at += n * k
        res.append((plp, ids, lps))
    assert plp_at == len(out.prompt_logprobs) and ptk_at == len(out.prompt_top_k_ids)
    return res


def check_top(ids: np.ndarray, lps: np.ndarray, log_probs: np.ndarray) -> None:
    """`ids`/`lps` [rows, k] are the k best of each reference row `log_probs` [rows, vocab]."""
    k = ids.shape[1]
    order = np.argsort(-log_probs, axis=-1, kind="stable")[:, :k]
    want = np.take_along_axis(log_probs, order, axis=-1)
    np.testing.assert_allclose(lps, want, atol=1e-4, rtol=0)
    assert (np.diff(lps, axis=-1) <= 0).all(), "best first"
    # Ids agree wherever the reference's neighbours are not within float32 noise.
    gaps = np.abs(np.diff(want, axis=-1))
    clear = np.ones(want.shape, dtype=bool)
    clear[:, :-1] &= gaps > 1e-4
    clear[:, 1:] &= gaps > 1e-4
    assert (ids[clear] == order[clear]).all()
    # Each id's logprob is the reference's for that id (ties or not).
    np.testing.assert_allclose(lps, np.take_along_axis(log_probs, ids, axis=-1), atol=1e-4)


def test_prompt_top_k_matches_reference_only_where_asked() -> None:
    w64 = as64(random_weights(SMALL, SMALL.seed))
    rng = np.random.default_rng(21)
    lens = [1, 2, 9, 40, 77]
    ps = prompts(rng, lens, SMALL.vocab_size)
    opts = [PLP | PTK, PLP | PTK, PLP, 0, PLP | PTK | MEAN]
    top_k = [3, 5, 2, 4, SMALL.vocab_size]
    out = runner(SMALL).forward(batch(ps, opts, top_k))
    rows = [n - 1 for n in lens]
    for p, o, (plp, ids, lps) in zip(ps, opts, per_request(out, rows, opts, top_k), strict=True):
        ref = full(SMALL, w64, p)
        if o & PLP:
            np.testing.assert_allclose(plp, ref.prompt_logprobs(p), atol=1e-4, rtol=0)
        if not o & PTK:
            assert ids is None
            continue
        assert ids is not None and lps is not None
        assert ids.dtype == np.int32 and lps.dtype == np.float32
        check_top(ids, lps, ref.log_probs[:-1])
        if len(p) > 1:  # the prompt's own token is among the k with its prompt logprob
            hit = ids == p[1:, None]
            np.testing.assert_allclose(lps[hit], np.repeat(plp, hit.sum(axis=1)), atol=1e-6)


def _fields(spec: PaddleModel) -> dict:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_prompt_top_k_solo_batched_and_chunked_agree(deterministic: bool) -> None:
    spec = PaddleModel(**{**_fields(SMALL), "deterministic": deterministic})
    r = PaddleRunner(spec) if deterministic else runner(SMALL)
    rng = np.random.default_rng(22)
    p = prompts(rng, [90], spec.vocab_size)[0]
    opts, k = PLP | PTK, 6
    solo = per_request(r.forward(batch([p], [opts], [k], ids=[5])), [89], [opts], [k])[0]
    others = prompts(rng, [3, 30, 12], spec.vocab_size)
    mixed_opts = [PLP | PTK, opts, PLP, MEAN]
    mixed = r.forward(
        batch([others[0], p, *others[1:]], mixed_opts, [2, k, 9, 0], ids=[1, 5, 2, 3])
    )
    batched = per_request(mixed, [2, 89, 29, 11], mixed_opts, [2, k, 9, 0])[1]
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for a, b in itertools.pairwise([0, 25, 26, 60, 90]):
        out = r.forward(
            batch(
                [others[1], p[a:b]],
                [PLP | PTK, opts],
                [3, k],
                ids=[9, 5],
                starts=[0, a],
                last=[True, b == 90],
            )
        )
        n = b - max(a, 1)
        parts.append(per_request(out, [29, n], [PLP | PTK, opts], [3, k])[1])
    chunked = tuple(np.concatenate(x) for x in zip(*parts, strict=True))
    assert r.num_cached == 0 and r._outputs.num_cached == 0
    assert solo[1] is not None and solo[1].shape == (89, k)
    for got in (batched, chunked):
        exact = deterministic and got is batched  # bitwise, whatever the batch-mates
        for g, w in zip(got, solo, strict=True):
            if exact:
                assert np.array_equal(g, w)
            elif g.dtype == np.int32:  # ids: equal unless neighbours tie within the noise
                vals = solo[2]
                assert vals is not None
                gaps = np.abs(np.diff(vals, axis=-1)) > 1e-5
                clear = np.ones(vals.shape, dtype=bool)
                clear[:, :-1] &= gaps
                clear[:, 1:] &= gaps
                assert (g[clear] == w[clear]).all()
            else:
                np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
