"""An engine under load in its own process, for the engine-death tests (run as a script).

Prints one JSON line once busy: its pid, its workers' pids, its resource tracker's pid and
its shared-memory segments. Then it keeps the engine busy until it is killed. With `hung`,
worker 0 first starts a forward that never ends (SimModel.hang_token).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from multiprocessing import resource_tracker

from aioprefill import Engine, EngineConfig, SimModel

HANG = 31001


async def main(mode: str) -> None:
    model = SimModel(fixed_ms=2.0, per_token_us=0.0, hang_token=HANG)
    config = EngineConfig(model=model, num_workers=2, forward_timeout_s=None)
    async with Engine(config) as engine:
        tasks = set()
        if mode == "hung":
            tasks.add(asyncio.ensure_future(engine.prefill([HANG])))

        async def load() -> None:
            i = 0
            while True:
                batch = [engine.prefill([i % 30000 + 1, 2, 3]) for _ in range(64)]
                await asyncio.gather(*batch)
                i += 1

        tasks.add(asyncio.ensure_future(load()))
        while not all(w.in_flight for w in engine._pool.slots):  # both mid-forward
            await asyncio.sleep(0.005)
        report = {
            "pid": os.getpid(),
            "workers": engine.worker_pids(),
            "tracker": resource_tracker._resource_tracker._pid,
            "segments": sorted(n for n in os.listdir("/dev/shm") if f"-{os.getpid()}-" in n),
        }
        print(json.dumps(report), flush=True)
        await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
