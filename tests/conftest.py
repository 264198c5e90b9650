"""Shared fixtures: every async test runs on both the default asyncio loop and uvloop, in debug
mode, and the session fails if any shared-memory segment this process created is left behind.

A test whose subject is not the loop (a model's numbers, a server process, the store tier) runs
on uvloop alone: `@pytest.mark.asyncio(loop_factories=["uvloop"])`, with a comment saying why.
The engine's own tests (its wake-ups, cancellations, worker deaths) keep both loops."""

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


def own_segments() -> set[str]:
    """Names of /dev/shm entries that this test process created (owner pid in the name)."""
    prefix = f"aioprefill-{os.getpid()}-"
    return {p.name for p in SHM.glob(prefix + "*")}


@pytest.fixture(autouse=True, scope="session")
def _no_leaked_segments():
    yield
    left = own_segments()
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
