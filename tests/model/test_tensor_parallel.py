"""Tensor parallelism through real gloo collectives: two spawned rank processes, each holding
half of the model (column/row-parallel layers, vocab-parallel head), give the single-rank
runner's tokens and log-probabilities (|d| <= 1e-5) — whole prompts and chunked ones."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from aioprefill.config import PaddleModel
from aioprefill.shm.segments import SHM_DIR, attach_segment, create_segment, segment_name
from aioprefill.wire import protocol
from aioprefill.wire.kv import KVLayout, kv_layout
from tests.model.batches import SMALL, runner, small
from tests.model.parallel_jobs import JOBS, Job, Out, Step, forward
from tests.ranks import run_ranks

pytestmark = pytest.mark.slow

TOL = 1e-5


def steps_for(spec: PaddleModel, seed: int) -> list[Step]:
    rng = np.random.default_rng(seed)
    print("seed", seed)

    def p(n: int) -> list[int]:
        return rng.integers(0, spec.vocab_size, n).tolist()

    long = p(150)
    prompt_lp, embed = protocol.OPT_PROMPT_LOGPROBS, protocol.OPT_EMBED_MEAN
    chunk_opts: dict = {"options": [prompt_lp | protocol.OPT_PROMPT_TOP_K, 0], "top_k": [3, 0]}
    return [
        Step([p(n) for n in (1, 2, 7, 33, 100)], [0, 1, 2, 3, 4]),
        # output options: top-k and prompt logprobs (and their top-k) join the ranks' slices
        Step(
            [p(n) for n in (9, 40, 3, 12)],
            [20, 21, 22, 23],
            options=[prompt_lp, prompt_lp | embed, 0, prompt_lp | protocol.OPT_PROMPT_TOP_K],
            top_k=[5, 0, 3, 4],
        ),
        # a chunked prompt: its KV cache lives across forwards on every rank
        Step([long[:90], p(5)], [10, 11], starts=[0, 0], last=[False, True], **chunk_opts),
        Step([long[90:], p(3)], [10, 12], starts=[90, 0], last=[True, True], **chunk_opts),
    ]


def check_same(got: list[Out], want: list[Out], tol: float = TOL) -> None:
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.ids == w.ids, f"step {step}"
        assert g.tokens == w.tokens, f"step {step}"
        for name in ("top_k_ids", "prompt_top_k_ids"):
            a, b = getattr(g, name), getattr(w, name)
            if tol <= TOL:
                assert a == b, f"step {step}: {name}"
                continue
            # bf16: two ids whose log-probabilities tie within the rounding may swap places
            # (their values are checked below); only where a neighbour's value is that close
            lps = getattr(w, name.replace("ids", "logprobs"))
            for i in (i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y):
                near = [abs(lps[i] - lps[j]) for j in (i - 1, i + 1) if 0 <= j < len(lps)]
                assert min(near) <= 2 * tol, f"step {step}: {name}[{i}] {a[i]} != {b[i]}"
        names = ("logprobs", "top_k_logprobs", "prompt_logprobs", "prompt_top_k_logprobs")
        for name in (*names, "embeddings"):
            a, b = getattr(g, name), getattr(w, name)
            assert len(a) == len(b), f"step {step}: {name}"
            diff = np.abs(np.subtract(a, b)).max(initial=0.0)
            assert diff <= tol, f"step {step}: |d {name}| = {diff:.2e}"


SPECS = {
    "gqa": SMALL,  # GQA: each rank keeps 2 query heads and the 1 KV head they read
    "mha-tied": small(num_kv_heads=4, tie_word_embeddings=True, seed=8),  # head = embedding slice
    "deterministic": small(deterministic=True, seed=9),  # fixed row tiles line up across ranks
    "bias-qknorm": small(attention_bias=True, qk_norm=True, seed=12),  # per-head norms whole
    # TP over a mixture of experts: every expert's w1/w3 rows and w2 columns are split
    "moe": small(num_experts=4, num_experts_per_tok=2, seed=10),
    # bfloat16 on the CPU: row-parallel partial sums add in another order, and a product's
    # input rounds to bf16 after them, so the ranks' answer is within bf16 rounding (TOLS)
    "bf16": small(dtype="bfloat16", seed=13),
}
TOLS = {"bf16": 2e-2}


def kv_steps(spec: PaddleModel, names: dict[str, str]) -> list[Step]:
    """Exports from a TP group: one rank 0 cannot create (the group must fail it together and
    stay in step), one over a too-small segment left behind (rank 0 alone replaces it), and a
    chunked prompt's (its past from every rank's cache)."""
    rng = np.random.default_rng(spec.seed)

    def p(n: int) -> list[int]:
        return rng.integers(0, spec.vocab_size, n).tolist()

    kv = protocol.OPT_RETURN_KV
    long = p(70)
    return [
        Step([p(9), p(20)], [30, 31], options=[kv, kv], kv_names=[names["a"], names["bad"]]),
        Step(
            [long[:40], p(5)],
            [32, 33],
            last=[False, True],
            options=[kv, kv],
            kv_names=[names["long"], names["small"]],
        ),
        Step(
            [long[40:], p(3)], [32, 34], starts=[40, 0], options=[kv, 0], kv_names=[names["long"]]
        ),
    ]


KV_HEADS = {"1-kv-head-per-rank": 2, "2-kv-heads-per-rank": 4}
Tp2 = tuple[dict[str, list[list[Out]]], dict[str, dict[str, str]]]


@pytest.fixture(scope="module")
def tp2() -> Iterator[Tp2]:
    """Every test's job through one TP group of two rank processes, a runner per job, in turn
    (a group per test spawned two ranks and imported paddle in them seven times): the outs
    ({test id: [rank 0's, rank 1's]}) and the export tests' segment names."""
    jobs = {name: Job(spec=s, mode="tp", steps=[steps_for(s, s.seed)] * 2)
            for name, s in SPECS.items()}  # fmt: skip
    kv_names: dict[str, dict[str, str]] = {}
    try:
        for label, kv_heads in KV_HEADS.items():
            spec = kv_spec(kv_heads)
            names = {k: segment_name(f"kv.tp-test.{kv_heads}") for k in ("a", "long", "small")}
            names["bad"] = "x" * 300  # shm_open refuses the name: rank 0 cannot create it
            kv_names[label] = names
            # A worker that died part-way left "small" behind, too small for this prompt.
            create_segment(names["small"], 4096, track=False).close()
            jobs[label] = Job(spec=spec, mode="tp", steps=[kv_steps(spec, names)] * 2)
        raw = run_ranks(JOBS, 2, msgspec.msgpack.encode(list(jobs.values())))
        ranks = [msgspec.msgpack.decode(r, type=list[list[Out]]) for r in raw if r is not None]
        assert len(ranks) == 2, "a rank died"
        yield {name: [ranks[0][i], ranks[1][i]] for i, name in enumerate(jobs)}, kv_names
    finally:
        for names in kv_names.values():
            for key in ("a", "long", "small"):
                with contextlib.suppress(FileNotFoundError):
                    (SHM_DIR / names[key]).unlink()


@pytest.mark.parametrize("name", list(SPECS))
def test_tp2_matches_single_rank(name: str, tp2: Tp2) -> None:
    spec = SPECS[name]
    want = [forward(runner(spec), s) for s in steps_for(spec, seed=spec.seed)]
    tol = TOLS.get(name, TOL)
    check_same(tp2[0][name][0], want, tol)
    check_same(tp2[0][name][1], want, tol)  # every rank sees the gathered head's answer


def kv_spec(kv_heads: int) -> PaddleModel:
    return small(num_kv_heads=kv_heads, seed=20 + kv_heads)


@pytest.mark.parametrize("label", list(KV_HEADS))
def test_tp2_kv_export_matches_single_rank(label: str, tp2: Tp2) -> None:
    spec = kv_spec(KV_HEADS[label])
    ranks, names = tp2[0][label], tp2[1][label]
    ref = {k: v if k == "bad" else v + "-ref" for k, v in names.items()}
    layout = kv_layout(spec)
    try:
        single = runner(spec)
        want = [forward(single, s) for s in kv_steps(spec, ref)]
        for rank, got in enumerate(ranks):
            check_same(got, want)
            assert got[0].error and want[0].error, f"rank {rank}"  # every rank failed step 0
        assert not (SHM_DIR / names["a"]).exists()  # rank 0 removed what it had opened
        for key, n in (("small", 5), ("long", 70)):
            got, want = read_kv(names[key], layout, n), read_kv(ref[key], layout, n)
            for a, b in zip(got, want, strict=True):
                diff = np.abs(a - b).max(axis=(2, 3))  # per [layer, KV head]
                assert diff.max() <= TOL, f"{key}: {diff}"
    finally:
        for name in ref.values():
            if name != names["bad"]:
                with contextlib.suppress(FileNotFoundError):
                    (SHM_DIR / name).unlink()


def read_kv(name: str, layout: KVLayout, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Copies of an export's (keys, values)."""
    mm = attach_segment(name)
    keys, values = (a.copy() for a in layout.views(mm, num_tokens))
    mm.close()
    return keys, values
