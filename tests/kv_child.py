"""A caller that takes KV exports and dies without closing them (run as a script by
tests/test_kv.py). Prints one JSON line (its pid, its tracker's pid, the export names), then
exits at once (`exit`: os._exit, no cleanup) or waits to be SIGKILLed (`kill`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from multiprocessing import resource_tracker

from aioprefill import Engine, EngineConfig, SimModel


async def main(mode: str) -> None:
    async with Engine(EngineConfig(model=SimModel(fixed_ms=1.0, per_token_us=0.0))) as engine:
        results = [await engine.prefill([1, 2, 3, i], return_kv=True) for i in range(3)]
        assert float(results[0].kv.keys.sum()) != 0.0  # mapped and read
        report = {
            "pid": os.getpid(),
            "tracker": resource_tracker._resource_tracker._pid,
            "names": [r.kv.name for r in results],
        }
        print(json.dumps(report), flush=True)
        if mode == "exit":
            os._exit(0)  # no close(), no engine shutdown
        await asyncio.Event().wait()  # until SIGKILL


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
