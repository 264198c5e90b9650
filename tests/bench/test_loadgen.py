"""The closed loop's prompts: a pool supplies them, but the prefix cache never sees one twice."""

import asyncio
import time
import types

import numpy as np

from aioprefill.bench.interrupt import Interrupt
from aioprefill.bench.loadgen import LoadGen
from aioprefill.bench.progress import Progress


class _Engine:
    """Answers at once and keeps every prompt it was sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def prefill(self, tokens: np.ndarray) -> object:
        self.sent.append(np.asarray(tokens, dtype="<i4").tobytes())
        await asyncio.sleep(0)
        now = time.monotonic_ns()
        return types.SimpleNamespace(forward_end_ns=now, worker=0, batch_id=len(self.sent))


def test_closed_loop_prompts_never_repeat_across_passes_and_runs():
    pool = [np.arange(1, 1025, dtype=np.int32) * (k + 1) for k in range(3)]  # 3 of 1,024
    engine = _Engine()
    progress = Progress(False)

    async def main() -> None:
        for _ in range(2):  # two runs on one engine (the bench's A B B A saturation runs)
            gen = LoadGen(engine, Interrupt(progress), progress)  # type: ignore[arg-type]
            await gen.closed_loop(pool, 2, min_s=0.001, min_forwards=20)

    asyncio.run(main())
    assert len(engine.sent) >= 40
    assert len(set(engine.sent)) == len(engine.sent)  # never the same prompt twice
    originals = {p.tobytes() for p in pool}
    assert not originals & set(engine.sent)  # nor a pool prompt as the warm-up sends it
    for tokens in engine.sent:  # each a pool prompt, rotated: same length, same ids
        ids = np.frombuffer(tokens, dtype="<i4")
        assert any(sorted(ids) == sorted(p) for p in pool)
