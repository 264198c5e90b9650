"""What a rank process of the parallel model tests runs: a `Job` (model, mode, each rank's
batches) in, each step's results out, both msgspec-encoded."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np

from aioprefill.config import PaddleModel
from aioprefill.workers.group import CollectiveError
from aioprefill.workers.runner import ForwardBatch
from tests.model.batches import make_batch

JOB = "tests.model.parallel_jobs:run_job"  # what run_ranks starts in each rank
JOBS = "tests.model.parallel_jobs:run_jobs"  # several jobs, one after another, in one group


class Step(msgspec.Struct):
    prompts: list[list[int]]
    ids: list[int]
    starts: list[int] | None = None
    last: list[bool] | None = None
    options: list[int] | None = None  # OPT_* bits per request
    top_k: list[int] | None = None
    kv_names: list[str] = []  # one per request with OPT_RETURN_KV, batch order
    # prefix cache plan per request (tests.model.prefix.planned): slots read, slots written,
    # the first block written
    reads: list[list[int]] | None = None
    writes: list[list[int]] | None = None
    first: list[int] | None = None


class Out(msgspec.Struct):
    ids: list[int]
    tokens: list[int]
    logprobs: list[float]
    error: str = ""  # the ValueError a refused batch raised
    top_k_ids: list[int] = []
    top_k_logprobs: list[float] = []
    prompt_logprobs: list[float] = []
    embeddings: list[float] = []
    prompt_top_k_ids: list[int] = []
    prompt_top_k_logprobs: list[float] = []


class Job(msgspec.Struct):
    spec: PaddleModel
    mode: str  # "tp" | "ep"
    steps: list[list[Step]]  # [rank][step]; TP ranks all get the same steps
    prefix_cache_bytes: int = 0


EMPTY = ForwardBatch(
    request_ids=np.empty(0, dtype=np.int64),
    offsets=np.zeros(1, dtype=np.int32),
    tokens=np.empty(0, dtype=np.int32),
    start_pos=np.empty(0, dtype=np.int32),
    is_last=np.empty(0, dtype=bool),
)


def forward(runner, step: Step) -> Out:
    """One step; an empty step is an empty batch (what the engine sends an idle EP rank)."""
    if step.prompts:
        prompts = [np.asarray(p, dtype=np.int32) for p in step.prompts]
        batch = make_batch(prompts, step.ids, step.starts, step.last)
        if step.options is not None or step.top_k is not None:
            options = None if step.options is None else np.asarray(step.options, np.uint8)
            top_k = None if step.top_k is None else np.asarray(step.top_k, np.int32)
            batch = dataclasses.replace(
                batch, options=options, top_k=top_k, kv_names=tuple(step.kv_names)
            )
        if step.reads is not None or step.writes is not None:
            from tests.model.prefix import planned

            batch = planned(batch, step.reads, step.writes, step.first)
    else:
        batch = EMPTY
    try:
        out = runner.forward(batch)
    except CollectiveError:
        raise
    except (ValueError, OSError, RuntimeError) as exc:  # refused, or a KV export not opened
        return Out([], [], [], error=f"{type(exc).__name__}: {exc}")
    return Out(
        out.request_ids.tolist(),
        out.tokens.tolist(),
        out.logprobs.tolist(),
        top_k_ids=out.top_k_ids.tolist(),
        top_k_logprobs=out.top_k_logprobs.tolist(),
        prompt_logprobs=out.prompt_logprobs.tolist(),
        embeddings=out.embeddings.ravel().tolist(),
        prompt_top_k_ids=out.prompt_top_k_ids.tolist(),
        prompt_top_k_logprobs=out.prompt_top_k_logprobs.tolist(),
    )


def run_job(rank: int, size: int, master: str, arg: bytes) -> bytes:
    from aioprefill.workers.collectives import PaddleGroup
    from aioprefill.workers.paddle.runner import PaddleRunner

    assert arg is not None
    job = msgspec.msgpack.decode(arg, type=Job)
    group = PaddleGroup(rank, size, master, timeout=60.0)
    try:
        runner = PaddleRunner(
            job.spec, group=group, mode=job.mode, prefix_cache_bytes=job.prefix_cache_bytes
        )
        return msgspec.msgpack.encode([forward(runner, s) for s in job.steps[rank]])
    finally:
        group.close()


def run_jobs(rank: int, size: int, master: str, arg: bytes) -> bytes:
    """Each job of a msgspec list of `Job`s through its own runner on one group, in order: one
    group of rank processes for several models (each group spawned imports paddle again)."""
    from aioprefill.workers.collectives import PaddleGroup
    from aioprefill.workers.paddle.runner import PaddleRunner

    jobs = msgspec.msgpack.decode(arg, type=list[Job])
    group = PaddleGroup(rank, size, master, timeout=60.0)
    try:
        outs = []
        for job in jobs:
            runner = PaddleRunner(
                job.spec, group=group, mode=job.mode, prefix_cache_bytes=job.prefix_cache_bytes
            )
            outs.append([forward(runner, s) for s in job.steps[rank]])
        return msgspec.msgpack.encode(outs)
    finally:
        group.close()


def decode_outs(data: bytes | None) -> list[Out]:
    assert data is not None, "a rank died"
    return msgspec.msgpack.decode(data, type=list[Out])
