"""Chunked prefill: a prompt split over consecutive forwards gives the unchunked result, and the
runner keeps, checks and drops each request's KV state."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from aioprefill.errors import InvalidConfig
from aioprefill.workers.paddle.runner import PaddleRunner
from tests.model.batches import SMALL, make_batch, prompts, small


@pytest.fixture
def fresh() -> PaddleRunner:
    return PaddleRunner(SMALL)


def run_chunked(
    runner: PaddleRunner,
    prompt: np.ndarray,
    cuts: list[int],
    rid: int = 7,
    companions: list[np.ndarray] | None = None,
) -> tuple[int, float]:
    """Feed `prompt` in chunks split at `cuts`, each chunk batched with the companions."""
    bounds = [0, *cuts, len(prompt)]
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        others = companions or []
        out = runner.forward(
            make_batch(
                [*others, prompt[a:b]],
                ids=[*range(100, 100 + len(others)), rid],
                starts=[0] * len(others) + [a],
                last=[True] * len(others) + [b == len(prompt)],
            )
        )
        if b < len(prompt):
            assert rid not in out.request_ids.tolist()
            assert runner.num_cached == 1, f"after chunk {k}"
    assert runner.num_cached == 0
    assert out.request_ids[-1] == rid
    return int(out.tokens[-1]), float(out.logprobs[-1])


@pytest.mark.parametrize(
    "cuts",
    [[1], [50], [99], [10, 20, 30], [33, 34, 66], list(range(5, 100, 5))],
    ids=lambda c: "-".join(map(str, c[:4])),
)
def test_chunked_equals_unchunked(fresh: PaddleRunner, cuts: list[int]) -> None:
    prompt = prompts(np.random.default_rng(0), [100], SMALL.vocab_size)[0]
    whole = fresh.forward(make_batch([prompt]))
    token, logprob = run_chunked(fresh, prompt, cuts)
    assert token == int(whole.tokens[0])
    assert abs(logprob - float(whole.logprobs[0])) <= 1e-5


def test_chunks_ride_along_with_other_requests(fresh: PaddleRunner) -> None:
    rng = np.random.default_rng(1)
    prompt = prompts(rng, [90], SMALL.vocab_size)[0]
    whole = fresh.forward(make_batch([prompt]))
    token, logprob = run_chunked(fresh, prompt, [30, 60], companions=prompts(rng, [4, 25], 512))
    assert token == int(whole.tokens[0])
    assert abs(logprob - float(whole.logprobs[0])) <= 1e-5


def test_chunked_in_query_blocks(monkeypatch) -> None:
    from aioprefill.workers.paddle import runner as paddle_runner

    monkeypatch.setattr(paddle_runner, "_ATTN_TILE", 9)
    runner = PaddleRunner(SMALL)
    prompt = prompts(np.random.default_rng(2), [120], SMALL.vocab_size)[0]
    whole = runner.forward(make_batch([prompt]))
    token, logprob = run_chunked(runner, prompt, [40, 41, 100])
    assert token == int(whole.tokens[0])
    assert abs(logprob - float(whole.logprobs[0])) <= 1e-5


def test_interleaved_chunked_requests(fresh: PaddleRunner) -> None:
    a, b = prompts(np.random.default_rng(3), [60, 45], SMALL.vocab_size)
    expect = fresh.forward(make_batch([a, b]))
    fresh.forward(make_batch([a[:20], b[:30]], ids=[1, 2], last=[False, False]))
    assert fresh.num_cached == 2
    first = fresh.forward(
        make_batch([b[30:], a[20:40]], ids=[2, 1], starts=[30, 20], last=[True, False])
    )
    assert first.request_ids.tolist() == [2] and fresh.num_cached == 1
    second = fresh.forward(make_batch([a[40:]], ids=[1], starts=[40]))
    assert second.tokens[0] == expect.tokens[0] and first.tokens[0] == expect.tokens[1]
    assert abs(second.logprobs[0] - expect.logprobs[0]) <= 1e-5
    assert abs(first.logprobs[0] - expect.logprobs[1]) <= 1e-5


def test_free_drops_state(fresh: PaddleRunner) -> None:
    p = prompts(np.random.default_rng(4), [30], SMALL.vocab_size)[0]
    out = fresh.forward(make_batch([p[:10]], ids=[5], last=[False]))
    assert len(out.request_ids) == 0 and out.tokens.dtype == np.int32
    assert fresh.num_cached == 1
    fresh.free(np.array([5, 12345], dtype=np.int64))  # unknown ids are ignored
    assert fresh.num_cached == 0
    with pytest.raises(ValueError, match="request 5: chunk starts at 10, but this worker holds 0"):
        fresh.forward(make_batch([p[10:]], ids=[5], starts=[10]))


def test_wrong_continuation_offset_is_refused(fresh: PaddleRunner) -> None:
    p = prompts(np.random.default_rng(5), [30], SMALL.vocab_size)[0]
    fresh.forward(make_batch([p[:10]], ids=[6], last=[False]))
    with pytest.raises(ValueError, match="chunk starts at 12, but this worker holds 10"):
        fresh.forward(make_batch([p[12:]], ids=[6], starts=[12]))
    assert fresh.num_cached == 1  # a refused batch changes nothing


def test_restarting_a_prompt_replaces_stale_state(fresh: PaddleRunner) -> None:
    p = prompts(np.random.default_rng(6), [30], SMALL.vocab_size)[0]
    whole = fresh.forward(make_batch([p], ids=[8]))
    fresh.forward(make_batch([p[::-1][:10]], ids=[8], last=[False]))  # a retry from scratch
    again = fresh.forward(make_batch([p], ids=[8]))
    assert fresh.num_cached == 0
    assert again.tokens[0] == whole.tokens[0] and again.logprobs[0] == whole.logprobs[0]


def test_bad_batches_are_refused(fresh: PaddleRunner) -> None:
    with pytest.raises(ValueError, match="out of range"):
        fresh.forward(make_batch([np.array([1, SMALL.vocab_size])]))
    with pytest.raises(ValueError, match="out of range"):
        fresh.forward(make_batch([np.array([-1, 2])]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        fresh.forward(make_batch([np.array([1, 2])], starts=[SMALL.max_position_embeddings - 1]))
    with pytest.raises(ValueError, match="at least one token"):
        fresh.forward(make_batch([np.array([1]), np.array([], dtype=np.int32)]))


def test_cpu_refuses_half_precision_and_missing_gpu() -> None:
    with pytest.raises(InvalidConfig, match="dtype"):
        PaddleRunner(small(dtype="float16", device="cpu"))
    import paddle

    if not paddle.is_compiled_with_cuda():
        with pytest.raises(InvalidConfig, match="device"):
            PaddleRunner(small(device="gpu"))


def test_threads_setting_is_accepted() -> None:
    batch = make_batch([np.array([1, 2, 3])])
    two = PaddleRunner(small(num_threads=2)).forward(batch)
    one = PaddleRunner(SMALL).forward(batch)  # also puts the process back on one thread
    assert two.tokens[0] == one.tokens[0]


def test_a_failed_forward_drops_the_state_of_its_requests(fresh: PaddleRunner, monkeypatch) -> None:
    from aioprefill.workers.paddle import runner as paddle_runner

    p, other = prompts(np.random.default_rng(7), [30, 20], SMALL.vocab_size)
    fresh.forward(make_batch([p[:10], other[:10]], ids=[1, 2], last=[False, False]))
    real, calls = paddle_runner.attend_rows, []

    def fail_in_layer_1(*args, **kwargs):
        calls.append(args[6])
        if args[6] == 1:
            raise MemoryError("out of memory")
        return real(*args, **kwargs)

    monkeypatch.setattr(paddle_runner, "attend_rows", fail_in_layer_1)
    with pytest.raises(MemoryError):
        fresh.forward(make_batch([p[10:20]], ids=[1], starts=[10], last=[False]))
    assert 1 in calls
    monkeypatch.setattr(paddle_runner, "attend_rows", real)
    assert fresh.num_cached == 1  # request 2 was not in the failed batch
    with pytest.raises(ValueError, match="request 1"):
        fresh.forward(make_batch([p[10:]], ids=[1], starts=[10]))
