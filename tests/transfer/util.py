"""Shared by the transfer tests: skip without Mooncake (with the reason), an engine config with
KV transfer on, registrations and segments to count, waiting on a condition."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aioprefill import Engine, EngineConfig
from aioprefill.transfer import TransferOptions
from tests.conftest import own_segments
from tests.reliability.util import sim

ROOT = Path(__file__).parents[2]


@functools.cache
def mooncake_missing() -> str | None:
    """Why Mooncake cannot be imported here, or None when it can (`python3 dev.py test`
    installs it and, as root, Debian's libibverbs1, so CI runs what needs it)."""
    try:
        import mooncake.engine
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        return (
            f"Mooncake is not importable ({exc}): pip install 'aioprefill[transfer]' and "
            "apt-get install libibverbs1"
        )
    return None


# for a test (or a parametrization) that needs Mooncake: skipped, saying why, where it is missing
needs_mooncake = pytest.mark.skipif(mooncake_missing() is not None, reason=str(mooncake_missing()))


def need_mooncake() -> None:
    """Skip the calling module when Mooncake cannot be imported."""
    if (why := mooncake_missing()) is not None:
        pytest.skip(why, allow_module_level=True)


def transfer_config(ttl: float | None = 60.0, **kw: object) -> EngineConfig:
    options = TransferOptions(export_ttl_s=ttl)
    return EngineConfig(model=sim(), kv_transfer="mooncake", kv_transfer_options=options, **kw)  # type: ignore[arg-type]


def kv_segments(engine: Engine) -> list[str]:
    return sorted(n for n in own_segments() if n.endswith("-" + engine._kv._tag))


def registered(engine: Engine) -> int:
    transfer = engine._kv.transfer
    assert transfer is not None
    return transfer.num_registered


async def wait_for(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)
