"""Store faults lose nothing: with the master killed, absent at start, or too slow, a worker
computes instead (loads hand over nothing, puts are skipped, nothing raises), warns once per
outage, and reconnects in the background when the master answers again."""

from __future__ import annotations

import logging
import time

import pytest

from aioprefill.kvstore.master import LocalMaster, free_port
from tests.kvstore.util import Blocks, Gate, drain, need_store, tier

need_store()

LOGGER = "aioprefill.kvstore"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING
    ]


def test_killing_the_master_mid_run_computes_then_reconnects(tmp_path, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    master = LocalMaster(log_path=tmp_path / "master.log").start()
    worker = tier(master.address)
    try:
        blocks = Blocks(4, seed=11)
        assert blocks.offer_all(worker) == 4
        drain(worker)
        assert blocks.load(worker)[0] == 4
        master.kill()
        for _ in range(3):  # the first call finds it gone; the others do not ask
            assert blocks.load(worker)[0] == 0
        assert worker.stats.loads_skipped >= 2
        later = Blocks(2, seed=12)
        later.offer_all(worker)  # skipped or refused, never raised
        warnings = _warnings(caplog)
        assert len(warnings) == 1 and master.address in warnings[0], warnings
        master = LocalMaster(port=master.port, log_path=tmp_path / "master2.log").start()
        assert worker.wait_up(30)
        assert any("answers again" in r.getMessage() for r in caplog.records)
        assert blocks.load(worker)[0] == 0  # a new master holds nothing
        # The client remounts its segment on the new master in its own time (until then
        # puts find no space and are dropped, to be offered again on the next compute).
        for _ in range(100):
            puts = worker.stats.puts
            assert blocks.offer_all(worker) == 4  # nothing counts as put before the restart
            drain(worker)
            if worker.stats.puts == puts + 4:
                break
            time.sleep(0.1)
        assert blocks.load(worker)[0] == 4
        assert len(_warnings(caplog)) == 1
    finally:
        worker.close()
        master.stop()


def test_a_master_absent_at_start_is_joined_when_it_comes(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    port = free_port()
    worker = tier(f"127.0.0.1:{port}", up=False)
    try:
        blocks = Blocks(2, seed=13)
        assert not worker.is_up()
        assert blocks.load(worker)[0] == 0  # not connected: computed, the store not asked
        assert blocks.offer_all(worker) == 0
        assert worker.stats.loads == 0 and worker.stats.puts_skipped_down == 2
        with LocalMaster(port=port):
            assert worker.wait_up(30)  # the put thread knocks again after its backoff
            assert blocks.offer_all(worker) == 2
            drain(worker)
            assert blocks.load(worker)[0] == 2
            worker.close()
    finally:
        worker.close()


def test_a_load_past_its_deadline_is_computed_and_its_buffer_kept(caplog):
    caplog.set_level(logging.INFO, LOGGER)
    with LocalMaster() as master:
        worker = tier(master.address, load_timeout_s=0.2)
        try:
            blocks = Blocks(3, seed=14)
            assert blocks.offer_all(worker) == 3
            drain(worker)
            gate = Gate(worker, "batch_get_into")
            assert blocks.load(worker)[0] == 0  # the get waits at the gate past 0.2 s
            assert worker.stats.load_timeouts == 1 and gate.entered.is_set()
            assert len(_warnings(caplog)) == 1
            assert blocks.load(worker)[0] == 0  # the late get still owns the buffer
            gate.open()
            assert worker.wait_up(30)  # the put thread found the master well
            with worker.loader.cond:
                assert worker.loader.cond.wait_for(lambda: not worker.loader.busy, 30)
            assert blocks.load(worker)[0] == 3
        finally:
            worker.close()
