"""KV exports pulled through Mooncake (SimModel engines): bytes equal to the local export from
another process, into caller buffers, and every way an export ends (close, reuse, release,
expiry, engine close) turning later pulls into KVExportClosed, with no registration or
/dev/shm entry left behind."""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import pytest

from tests.transfer.util import (
    ROOT,
    kv_segments,
    need_mooncake,
    registered,
    transfer_config,
    wait_for,
)

need_mooncake()

from aioprefill import Engine, InvalidRequest, KVExportClosed  # noqa: E402
from aioprefill.transfer import pull_kv, release_kv  # noqa: E402


@pytest.mark.asyncio
async def test_another_process_pulls_the_export_bit_for_bit(tmp_path):
    async with Engine(transfer_config()) as engine:
        rs = [await engine.prefill(list(range(1, n)), return_kv=True) for n in (2, 41)]
        assert registered(engine) == 2
        for r in rs:
            text = json.dumps(r.kv.transfer_params())  # plain JSON, as a server returns it
            out = tmp_path / "kv.npy"
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.transfer.children",
                "pull",
                str(out),
                cwd=ROOT,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            stdout, stderr = await proc.communicate(text.encode())
            assert proc.returncode == 0, stderr.decode()[-2000:]
            got = np.load(out)
            assert np.array_equal(got[0], r.kv.keys) and np.array_equal(got[1], r.kv.values)
            info = json.loads(stdout.decode().splitlines()[-1])
            params = json.loads(text)
            assert info["export_id"] == params["export_id"]
            assert tuple(info["shape"]) == r.kv.shape and info["dtype"] == "float32"
            layout = params["layout"]
            assert (layout["num_tokens"], layout["keys"]) == (r.kv.num_tokens, "rope_applied")
            assert params["session"].startswith("127.0.0.1:")  # loopback unless configured
        for r in rs:
            r.kv.close()
        assert registered(engine) == 0
    assert engine._kv.transfer is not None and engine._kv.transfer.num_regions == 0
    assert kv_segments(engine) == []


@pytest.mark.asyncio
async def test_pull_into_caller_buffers_whole_or_layer_by_layer():
    async with Engine(transfer_config()) as engine:
        r = await engine.prefill(list(range(3, 30)), return_kv=True)
        params = r.kv.transfer_params()
        keys, values = np.zeros(r.kv.shape, np.float32), np.zeros(r.kv.shape, np.float32)
        kv = await asyncio.to_thread(pull_kv, params, into=(keys, values), timeout_s=None)
        assert kv.keys is keys and np.array_equal(keys, r.kv.keys)
        assert np.array_equal(values, r.kv.values)
        # a paged cache: one (keys, values) destination per layer, anywhere in memory
        pool = np.zeros((2 * r.kv.shape[0] + 1, *r.kv.shape[1:]), np.float32)
        layers = [(pool[2 * i + 1], pool[2 * i]) for i in range(r.kv.shape[0])]
        await asyncio.to_thread(pull_kv, params, into=layers)
        for i, (k, v) in enumerate(layers):
            assert np.array_equal(k, r.kv.keys[i]) and np.array_equal(v, r.kv.values[i])
        bad = [
            (keys.astype(np.float64), values),
            (keys[:, :, ::2], values),
            (keys[:1], values[:1]),
            layers[:-1],
            [keys, values],  # whole arrays, but as a list: read as layers, refused
            [(keys[i],) for i in range(len(keys))],
        ]
        for into in bad:
            with pytest.raises(InvalidRequest):
                pull_kv(params, into=into)  # refused before any read


@pytest.mark.asyncio
async def test_pulls_after_close_reuse_release_and_expiry_raise_kv_export_closed():
    async with Engine(transfer_config(ttl=0.6)) as engine:
        a = await engine.prefill(list(range(1, 17)), return_kv=True)
        pa = a.kv.transfer_params()
        a.kv.close()
        with pytest.raises(KVExportClosed):
            a.kv.transfer_params()
        with pytest.raises(KVExportClosed):
            await asyncio.to_thread(pull_kv, pa)
        # the same segment, same size, another prompt: the old params never read its bytes
        b = await engine.prefill(list(range(100, 116)), return_kv=True)
        assert b.kv.name == a.kv.name
        with pytest.raises(KVExportClosed):
            await asyncio.to_thread(pull_kv, pa)
        pb = b.kv.transfer_params()
        assert pb["export_id"] != pa["export_id"]
        kv = await asyncio.to_thread(pull_kv, pb)
        assert np.array_equal(kv.keys, b.kv.keys)
        # released by the decode side: the engine closes it soon after
        assert await asyncio.to_thread(release_kv, pb) is True
        await wait_for(lambda: b.kv.closed, timeout=3.0)
        assert await asyncio.to_thread(release_kv, pb) is False  # already gone
        with pytest.raises(KVExportClosed):
            await asyncio.to_thread(pull_kv, pb)
        # nobody pulls or closes it: expires after export_ttl_s
        c = await engine.prefill(list(range(7, 40)), return_kv=True)
        pc = c.kv.transfer_params()
        await wait_for(lambda: c.kv.closed, timeout=3.0)
        with pytest.raises(KVExportClosed):
            await asyncio.to_thread(pull_kv, pc)
        with pytest.raises(KVExportClosed):
            _ = c.kv.keys
        assert registered(engine) == 0
        # open at close: deregistered with the engine
        d = await engine.prefill([5, 6, 7], return_kv=True)
        pd = d.kv.transfer_params()
        assert registered(engine) == 1
    assert d.kv.closed and engine._kv.transfer is not None
    assert engine._kv.transfer.num_regions == 0 and kv_segments(engine) == []
    with pytest.raises(Exception) as caught:  # the engine is gone: TransferError
        pull_kv(pd, timeout_s=5.0)
    assert type(caught.value).__name__ == "TransferError"


@pytest.mark.asyncio
async def test_transfer_params_need_kv_transfer():
    from aioprefill import EngineConfig
    from tests.reliability.util import sim

    async with Engine(EngineConfig(model=sim())) as engine:
        r = await engine.prefill([1, 2, 3], return_kv=True)
        with pytest.raises(InvalidRequest, match="kv_transfer"):
            r.kv.transfer_params()
        r.kv.close()


def test_long_reads_are_sliced_without_gaps():
    from aioprefill.transfer.pull import sliced

    reads = [(1000, 5000, 10), (0, 77, 25)]
    out = sliced(reads, piece=4)
    assert [n for *_, n in out] == [4, 4, 2, 4, 4, 4, 4, 4, 4, 1]
    assert out[:3] == [(1000, 5000, 4), (1004, 5004, 4), (1008, 5008, 2)]
    assert sliced([(0, 0, 8)], piece=8) == [(0, 0, 8)]


@pytest.mark.asyncio
async def test_an_export_larger_than_a_slice_pulls_whole():
    async with Engine(transfer_config(max_batch_tokens=32768)) as engine:
        r = await engine.prefill([i % 30000 + 1 for i in range(20000)], return_kv=True)
        assert r.kv.nbytes > 4 << 20  # more than one 4 MiB slice
        kv = await asyncio.to_thread(pull_kv, r.kv.transfer_params())
        assert np.array_equal(kv.keys, r.kv.keys) and np.array_equal(kv.values, r.kv.values)
        r.kv.close()


@pytest.mark.asyncio
async def test_a_pull_after_the_budget_evicted_the_closed_segment_raises_kv_export_closed():
    from aioprefill.wire.kv import SIM_KV_LAYOUT

    per_token = SIM_KV_LAYOUT.nbytes(1)
    async with Engine(transfer_config(max_kv_export_bytes=40 * per_token)) as engine:
        a = await engine.prefill(list(range(1, 33)), return_kv=True)
        pa = a.kv.transfer_params()
        a.kv.close()  # kept for reuse
        assert engine._kv.pooled_bytes == 32 * per_token
        b = await engine.prefill(list(range(1, 16)), return_kv=True)  # too small to reuse it:
        assert b.kv.name != a.kv.name and engine._kv.pooled_bytes == 0  # a's is unlinked
        with pytest.raises(KVExportClosed):
            await asyncio.to_thread(pull_kv, pa)
        assert registered(engine) == 1
        b.kv.close()
    assert kv_segments(engine) == []
