"""Shared fixtures: every async test runs on both the default asyncio loop and uvloop, in debug
mode, and the session fails if any shared-memory segment this process created is left behind."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import uvloop

SHM = Path("/dev/shm")


@pytest.fixture(
    params=[
        pytest.param(asyncio.DefaultEventLoopPolicy, id="asyncio"),
        pytest.param(uvloop.EventLoopPolicy, id="uvloop"),
    ]
)
def event_loop_policy(request: pytest.FixtureRequest) -> asyncio.AbstractEventLoopPolicy:
    policy = request.param()
    return policy


@pytest.fixture(autouse=True)
def _asyncio_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONASYNCIODEBUG", "1")


def own_segments() -> set[str]:
    """Names of /dev/shm entries that this test process created (owner pid in the name)."""
    prefix = f"aioprefill-{os.getpid()}-"
    return {p.name for p in SHM.glob(prefix + "*")}


@pytest.fixture(autouse=True, scope="session")
def _no_leaked_segments():
    yield
    left = own_segments()
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
