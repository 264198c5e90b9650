"""SIGKILL workers mid-forward, again and again, under thousands of concurrent requests:
every request ends exactly once, with its own correct result or `WorkerCrashed`."""

from __future__ import annotations

import asyncio
import random

import pytest

from aioprefill import Engine, EngineConfig, PrefillResult, WorkerCrashed
from aioprefill.workers.sim import expected_logprob, expected_token
from tests.reliability.util import all_ready, busy_worker, kill_worker, prompt, seeded, sim, until

pytestmark = pytest.mark.asyncio

NUM_REQUESTS = 4000
NUM_KILLS = 6
STAGE_S = 0.5  # each stage's arrivals are spread over this long


# eager queues one batch per request at a worker: each kill strands hundreds of batches.
# (Thousands of batches in flight make a full invariant recount per event quadratic, and this
# test keeps it to a few seconds: eager runs it unchecked.)
@pytest.mark.parametrize(
    "policy, fixed_ms",
    [("forward", 3.0), pytest.param("eager", 1.0, marks=pytest.mark.unchecked)],
)
async def test_repeated_sigkill_under_load_loses_and_duplicates_nothing(
    policy: str, fixed_ms: float
):
    rng = seeded()
    prompts = [prompt(rng) for _ in range(NUM_REQUESTS)]
    # Prompts longer than max_batch_tokens are chunked: a kill can land between their chunks.
    for i in range(0, NUM_REQUESTS, 200):
        prompts[i] = prompt(rng, rng.randrange(300, 700))
    cfg = EngineConfig(
        model=sim(fixed_ms),
        num_workers=2,
        policy=policy,
        max_batch_size=64,
        max_batch_tokens=256,
        max_restarts=NUM_KILLS + 1,
    )
    outcomes: list[PrefillResult | BaseException | None] = [None] * NUM_REQUESTS
    calls = [0] * NUM_REQUESTS
    # Arrivals come in NUM_KILLS + 1 stages, stage k released once k kills have landed and
    # spread over STAGE_S after that, so every kill lands under load however slow the machine
    # (a fixed 3 s spread once ended before the 6th kill on a loaded 2-core machine).
    stages = [asyncio.Event() for _ in range(NUM_KILLS + 1)]
    stage_of = [int(rng.random() * len(stages)) for _ in range(NUM_REQUESTS)]
    delay_of = [rng.random() * STAGE_S for _ in range(NUM_REQUESTS)]
    async with Engine(cfg) as engine:

        async def caller(i: int) -> None:
            await stages[stage_of[i]].wait()
            await asyncio.sleep(delay_of[i])
            calls[i] += 1
            try:
                outcomes[i] = await engine.prefill(prompts[i])
            except WorkerCrashed as exc:
                outcomes[i] = exc

        async def killer() -> int:
            kills = 0
            local = random.Random(rng.random())
            for stage in stages[:-1]:
                stage.set()
                # Well inside the stage's arrivals (0.1-0.2 s of STAGE_S): workers are busy.
                await asyncio.sleep(0.1 + local.random() * 0.1)
                await until(lambda: busy_worker(engine) is not None, what="a busy worker")
                victim = busy_worker(engine)
                assert victim is not None
                kill_worker(engine, victim)
                kills += 1
            stages[-1].set()  # the last stage arrives after the last kill
            return kills

        killing = asyncio.create_task(killer())
        await asyncio.wait_for(asyncio.gather(*(caller(i) for i in range(NUM_REQUESTS))), 120)
        assert killing.done()
        assert killing.result() == NUM_KILLS
        stats = engine.stats()

        crashed = 0
        request_ids = set()
        for p, outcome in zip(prompts, outcomes, strict=True):
            assert outcome is not None, "a request never ended"
            if isinstance(outcome, WorkerCrashed):
                crashed += 1
                continue
            assert isinstance(outcome, PrefillResult)
            assert outcome.token == expected_token(p) and outcome.num_tokens == len(p)
            assert outcome.logprob == pytest.approx(expected_logprob(p))
            request_ids.add(outcome.request_id)
        assert calls == [1] * NUM_REQUESTS
        assert len(request_ids) == NUM_REQUESTS - crashed  # no result delivered twice
        assert stats.completed == NUM_REQUESTS - crashed and stats.failed == crashed
        assert stats.pending == 0 and stats.in_flight == 0
        assert stats.retried > 0  # the kills did land mid-forward
        print(f"{policy}: {NUM_KILLS} kills, {stats.retried} retried, {crashed} failed")

        # Afterwards both workers come back and serve new requests correctly.
        await until(lambda: all_ready(engine), timeout=15, what="both workers back")
        fresh = [prompt(rng) for _ in range(200)]
        results = await asyncio.gather(*(engine.prefill(p) for p in fresh))
        assert [r.token for r in results] == [expected_token(p) for p in fresh]
        assert {r.worker for r in results} == {0, 1}
