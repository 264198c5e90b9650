"""A request's result must not depend on what it is batched with: the same token and a logprob
(and label token logprobs) within 1e-5 by default, bitwise the same with deterministic=True."""

from __future__ import annotations

import os

import numpy as np
import pytest

from aioprefill.config import PaddleModel
from aioprefill.workers.paddle.runner import PaddleRunner
from tests.model.batches import SMALL, make_batch, prompts, runner, small
from tests.model.prefix import with_options

LABELS = [3, 0, 77, 3, 500]

SEED = int(os.environ.get("AIOPREFILL_TEST_SEED", np.random.SeedSequence().entropy % 2**32))


def compare_compositions(
    runner: PaddleRunner, vocab: int, *, trials: int, max_len: int, bitwise: bool
) -> float:
    """Solo results of a pool of prompts vs the same prompts in random batches (random subsets,
    orders and companions, some with a chunked request alongside). Returns the worst |Δlogprob|."""
    print(f"batch-composition seed: {SEED} (set AIOPREFILL_TEST_SEED to replay)")
    rng = np.random.default_rng(SEED)
    pool = prompts(rng, rng.integers(1, max_len, 24).tolist(), vocab)
    solo = [runner.forward(labelled(make_batch([p], ids=[1000 + i]))) for i, p in enumerate(pool)]
    worst = 0.0
    for trial in range(trials):
        pick = rng.choice(len(pool), int(rng.integers(2, 14)), replace=False)
        chosen = [pool[i] for i in pick]
        ids = [1000 + int(i) for i in pick]
        # Half the batches also carry the first chunk of an unrelated long prompt.
        extra = trial % 2 == 1
        if extra:
            at = int(rng.integers(0, len(chosen) + 1))
            chosen.insert(at, rng.integers(0, vocab, 50).astype(np.int32))
            ids.insert(at, 99)
        last = [rid != 99 for rid in ids]
        out = runner.forward(labelled(make_batch(chosen, ids=ids, last=last)))
        if extra:
            runner.free(np.array([99]))
        assert len(out.request_ids) == len(pick)
        for j, i in enumerate(pick):
            context = f"seed {SEED}, trial {trial}, prompt {i} (length {len(pool[i])})"
            assert out.request_ids[j] == 1000 + i
            assert out.tokens[j] == solo[i].tokens[0], context
            delta = abs(float(out.logprobs[j]) - float(solo[i].logprobs[0]))
            worst = max(worst, delta)
            labels = out.label_logprobs[len(LABELS) * j : len(LABELS) * (j + 1)]
            if bitwise:
                assert out.logprobs[j] == solo[i].logprobs[0], f"{context}: off by {delta:.3g}"
                assert np.array_equal(labels, solo[i].label_logprobs), context
            else:
                assert delta <= 1e-5, f"{context}: off by {delta:.3g}"
                assert np.abs(labels - solo[i].label_logprobs).max() <= 1e-5, context
    return worst


def labelled(batch):
    """Every request of `batch` asks for the label token logprobs of LABELS."""
    return with_options(batch, [0] * batch.size, [0] * batch.size, labels=LABELS)


def test_default_mode_is_invariant_within_tolerance() -> None:
    worst = compare_compositions(
        runner(SMALL), SMALL.vocab_size, trials=30, max_len=120, bitwise=False
    )
    print(f"worst |Δlogprob| across compositions: {worst:.3g}")


def test_default_mode_tiny_model() -> None:
    spec = PaddleModel(seed=0)
    compare_compositions(runner(spec), spec.vocab_size, trials=8, max_len=80, bitwise=False)


@pytest.mark.parametrize(
    "spec",
    [small(deterministic=True), small(deterministic=True, num_kv_heads=1)],
    ids=["gqa", "mqa"],
)
def test_deterministic_mode_is_bitwise(spec: PaddleModel) -> None:
    compare_compositions(runner(spec), spec.vocab_size, trials=40, max_len=150, bitwise=True)


def test_deterministic_mode_tiny_model_is_bitwise() -> None:
    spec = PaddleModel(seed=0, deterministic=True)
    compare_compositions(runner(spec), spec.vocab_size, trials=12, max_len=100, bitwise=True)


def test_deterministic_results_match_default_mode() -> None:
    batch = make_batch(prompts(np.random.default_rng(1), [3, 70, 9], SMALL.vocab_size))
    a = runner(SMALL).forward(batch)
    b = runner(small(deterministic=True)).forward(batch)
    assert np.array_equal(a.tokens, b.tokens)
    assert np.abs(a.logprobs - b.logprobs).max() <= 1e-5


def test_repeating_a_batch_is_bitwise_identical() -> None:
    batch = make_batch(prompts(np.random.default_rng(2), [5, 60, 17], SMALL.vocab_size))
    first, second = runner(SMALL).forward(batch), runner(SMALL).forward(batch)
    assert np.array_equal(first.tokens, second.tokens)
    assert np.array_equal(first.logprobs, second.logprobs)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_prompt_logprobs_past_one_head_tile_do_not_depend_on_batch_mates(deterministic) -> None:
    # Prompt log-probabilities run the head in tiles of HEAD_ROWS rows, the last tile as long
    # as the rows left (default mode): a prompt's rows land at other places of other tiles as
    # its batch-mates change, and must not change by more than 1e-5 (bitwise: deterministic).
    from dataclasses import replace

    from aioprefill.wire.protocol import OPT_PROMPT_LOGPROBS
    from aioprefill.workers.paddle.logits import HEAD_ROWS

    spec = small(deterministic=deterministic)
    run = runner(spec)
    rng = np.random.default_rng(7)
    probe = prompts(rng, [300], spec.vocab_size)[0]

    def scores(batch_prompts: list[np.ndarray]) -> np.ndarray:
        batch = make_batch(batch_prompts)
        options = np.full(batch.size, OPT_PROMPT_LOGPROBS, dtype=np.uint8)
        out = run.forward(replace(batch, options=options))
        return out.prompt_logprobs[-(len(probe) - 1) :]  # the probe is last: its rows end it

    alone = scores([probe])
    for mates in ([HEAD_ROWS - 5], [HEAD_ROWS + 100], [700, 650], [2 * HEAD_ROWS - 290]):
        got = scores([*prompts(rng, mates, spec.vocab_size), probe])
        if deterministic:
            assert np.array_equal(got, alone), mates
        else:
            assert np.abs(got - alone).max() <= 1e-5, mates
