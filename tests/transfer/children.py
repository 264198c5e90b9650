"""Processes the transfer tests run as scripts: a decode node that pulls with nothing but the
params (no Engine), and a prefill engine whose exports another process pulls.

    python -m tests.transfer.children pull OUT.npy      params JSON on stdin; saves [K, V]
    python -m tests.transfer.children loop              "ready" once imported, then params JSON
                                                        on stdin; pulls until killed ("pulling"
                                                        after the first pull)
    python -m tests.transfer.children serve             a SimModel engine: prints params, waits
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np


def pull(out: str) -> None:
    from aioprefill.transfer import pull_kv

    kv = pull_kv(sys.stdin.read())  # the JSON text as it came
    np.save(out, np.stack([kv.keys, kv.values]))
    print(json.dumps({"export_id": kv.export_id, "shape": kv.shape, "dtype": kv.dtype}))


def loop() -> None:
    from aioprefill.transfer import pull_kv

    print("ready", flush=True)
    params = json.loads(sys.stdin.readline())
    pull_kv(params)
    print("pulling", flush=True)
    while True:
        pull_kv(params)


async def serve() -> None:
    from aioprefill import Engine, EngineConfig, SimModel

    config = EngineConfig(model=SimModel(fixed_ms=1.0, per_token_us=0.0), kv_transfer="mooncake")
    async with Engine(config) as engine:
        r = await engine.prefill(list(range(1, 65)), return_kv=True)
        print(json.dumps(r.kv.transfer_params()), flush=True)
        await asyncio.Event().wait()  # until killed or stopped


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "pull":
        pull(sys.argv[2])
    elif mode == "loop":
        loop()
    else:
        asyncio.run(serve())
