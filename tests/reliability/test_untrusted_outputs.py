"""Forged answers for requests with output options, written into a live engine's result ring
while its worker is frozen (as in test_untrusted_bytes.py): a `Spilled` message naming no
segment, and a result whose option columns lie. The askers fail with a typed error, nothing
leaks, and the engine serves on."""

from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest

from aioprefill import Engine, EngineConfig, ForwardFailed
from aioprefill.errors import ProtocolError
from aioprefill.wire.protocol import Spilled, encode
from aioprefill.workers.sim import expected_token
from tests.reliability.test_untrusted_bytes import forger, result, wake
from tests.reliability.util import all_ready, kill_worker, sim, until

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("answer", ["spill-names-nothing", "short-prompt-logprobs"])
async def test_forged_answers_with_outputs_fail_their_askers_cleanly(answer: str):
    prompt = [1, 2, 3]
    async with Engine(EngineConfig(model=sim(300.0), num_workers=1)) as engine:
        w = engine._pool.slots[0]
        first = asyncio.create_task(engine.prefill([99]))  # alone: the asker gathers behind it
        await until(lambda: bool(w.in_flight), what="the first forward")
        stale = w.in_flight[0].batch_id
        task = asyncio.create_task(engine.prefill(prompt, prompt_logprobs=True, return_kv=True))
        await first
        await until(lambda: bool(w.in_flight) and w.in_flight[0].batch_id != stale, what="batch")
        kill_worker(engine, 0, signal.SIGSTOP)
        batch = w.in_flight[0]
        rid = batch.chunks[0].request.request_id
        if answer == "spill-names-nothing":
            forged = Spilled(batch.batch_id, "aioprefill-1-0123456789abcdef-spill", 64)
        else:  # two prompt logprobs are owed, one is sent
            forged = result(batch.batch_id, [rid], [expected_token(prompt)])
            forged.prompt_logprobs = np.zeros(1, "<f4").tobytes()
        with forger(engine) as ring:
            assert ring.try_write(encode(forged))
        wake(engine)
        with pytest.raises(ForwardFailed if answer == "spill-names-nothing" else ProtocolError):
            await asyncio.wait_for(task, 10)
        await asyncio.sleep(0)  # the future's done-callbacks run
        assert engine.stats().protocol_errors == 1
        assert engine._kv.used_bytes == 0 and engine._kv.num_open == 0
        kill_worker(engine, 0)  # the frozen worker never answers again; its replacement serves
        await until(lambda: all_ready(engine), what="the restart")
        r = await asyncio.wait_for(engine.prefill(prompt, prompt_logprobs=True), 10)
        assert r.token == expected_token(prompt) and len(r.prompt_logprobs) == 2
