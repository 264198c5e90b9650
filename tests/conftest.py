"""Shared fixtures: every async test runs on both the default asyncio loop and uvloop, in debug
mode, and the session fails if any shared-memory segment this process created is left behind."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import uvloop

SHM = Path("/dev/shm")


def pytest_asyncio_loop_factories(config, item):
    """Run every async test on the default asyncio loop and on uvloop (debug mode: pyproject)."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


# Collected first (and kept first: pyproject's `--no-loadscope-reorder`), so that with two test
# processes the longest modules start at once, one in each process, and the other process runs
# the rest beside them, instead of both waiting on one at the end: test_vllm_decode starts a
# real vLLM decode and a prefill node, then waits on vLLM's timeouts (~2 min where vLLM's venv
# is kept: tests/vllm/vllmvenv.py), test_lm_eval starts a server and runs lm-eval (~1 min, and
# its venv's creation where it is not kept: tests/lm_eval_run.py).
FIRST = ("tests/vllm/test_vllm_decode.py", "tests/serve/test_lm_eval.py")


def pytest_collection_modifyitems(config, items):
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::")[0]
        return FIRST.index(path) if path in FIRST else len(FIRST)

    items.sort(key=rank)  # stable: the order within each rank stays pytest's


def own_segments() -> set[str]:
    """Names of /dev/shm entries that this test process created (owner pid in the name)."""
    prefix = f"aioprefill-{os.getpid()}-"
    return {p.name for p in SHM.glob(prefix + "*")}


@pytest.fixture(autouse=True, scope="session")
def _no_leaked_segments():
    yield
    left = own_segments()
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
