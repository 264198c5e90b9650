"""PaddleModel through the whole engine: real Paddle workers, batch invariance across policies,
chunked prefill, weights files, and paddle kept out of the engine process."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from aioprefill import Engine, EngineConfig, PaddleModel, WorkerStartFailed
from tests.model.batches import SMALL


def small(**changes) -> PaddleModel:
    """The small test model of tests/model, with changes (seed, deterministic, weights...)."""
    return msgspec.structs.replace(SMALL, **changes)


def prompts(seed: int, n: int, max_len: int = 48) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(rng.randrange(1, max_len))] for _ in range(n)]


async def run(model: PaddleModel, batch: list[list[int]], *, solo: bool = False, **cfg):
    async with Engine(EngineConfig(model=model, **cfg)) as engine:
        if solo:
            return [await engine.prefill(p) for p in batch]
        return await asyncio.gather(*(engine.prefill(p) for p in batch))


@pytest.mark.asyncio
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
async def test_results_do_not_depend_on_batching_or_policy(deterministic):
    seed = random.randrange(1 << 20)
    print("seed", seed)
    model = small(seed=3, deterministic=deterministic)
    batch = prompts(seed, 40)
    solo = await run(model, batch, solo=True)
    assert {r.batch_size for r in solo} == {1}
    for policy in ("forward", "timeout", "eager"):
        together = await run(model, batch, policy=policy, num_workers=2, batch_timeout_ms=5.0)
        if policy != "eager":
            assert max(r.batch_size for r in together) > 1
        for a, b in zip(solo, together, strict=True):
            assert a.token == b.token
            if deterministic:
                assert a.logprob == b.logprob  # bitwise
            else:
                assert abs(a.logprob - b.logprob) <= 1e-5


@pytest.mark.asyncio
async def test_chunked_prefill_equals_unchunked():
    model = small(seed=1)
    batch = [*prompts(7, 6, max_len=400), list(range(1, 500))]
    whole = await run(model, batch, solo=True)
    chunked = await run(model, batch, max_batch_tokens=64, num_workers=2)
    assert any(r.num_chunks > 1 for r in chunked)
    for a, b in zip(whole, chunked, strict=True):
        assert a.token == b.token
        assert abs(a.logprob - b.logprob) <= 1e-5


@pytest.mark.asyncio
async def test_weights_file_loads_and_bad_files_fail_the_start(tmp_path: Path):
    from aioprefill.hf.weights import random_weights, save_weights

    seeded = small(seed=5)
    weights = random_weights(seeded, 5)
    good = tmp_path / "good.safetensors"
    save_weights(good, weights)
    batch = prompts(3, 5)
    expected = await run(seeded, batch)
    loaded = await run(small(weights=str(good)), batch)
    assert [r.token for r in loaded] == [r.token for r in expected]
    assert [r.logprob for r in loaded] == pytest.approx([r.logprob for r in expected], abs=1e-6)

    del weights["model.layers.1.mlp.down_proj.weight"]
    bad = tmp_path / "bad.safetensors"
    save_weights(bad, weights)
    with pytest.raises(WorkerStartFailed, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        await run(small(weights=str(bad)), batch)


@pytest.mark.asyncio
async def test_workers_take_this_engines_product_setting_not_the_forkservers(monkeypatch):
    """The forkserver keeps the environment of the engine that started it: each engine's
    workers must still read this engine's AIOPREFILL_CPU_GEMM (a bad one: they refuse)."""
    monkeypatch.delenv("AIOPREFILL_CPU_GEMM", raising=False)
    assert len(await run(small(), [[1, 2, 3]])) == 1  # the forkserver runs from here on
    monkeypatch.setenv("AIOPREFILL_CPU_GEMM", "openblas")
    with pytest.raises(WorkerStartFailed, match="AIOPREFILL_CPU_GEMM='openblas'"):
        await run(small(), [[1, 2, 3]])
    monkeypatch.delenv("AIOPREFILL_CPU_GEMM")
    assert len(await run(small(), [[1, 2, 3]])) == 1


def test_paddle_stays_out_of_the_engine_process():
    """Run an engine in a fresh interpreter: paddle must load only in the workers."""
    code = textwrap.dedent(
        f"""
        import asyncio, json, sys
        from aioprefill import Engine, EngineConfig, PaddleModel

        async def main():
            model = PaddleModel(**{msgspec.structs.asdict(SMALL)!r})
            async with Engine(EngineConfig(model=model, num_workers=2)) as engine:
                r = await engine.prefill([1, 2, 3])
                names = [open(f"/proc/{{p}}/comm").read().strip() for p in engine.worker_pids()]
            print(json.dumps({{"paddle": "paddle" in sys.modules, "names": names,
                               "token": r.token}}))

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["paddle"] is False
    assert report["names"] == ["aioprefill-w0", "aioprefill-w1"]
