"""Every soak and fault test checks the scheduler's invariants after every engine event.

In this process through `Scheduler.checking`; in engine subprocesses the tests start, through
the environment variable it reads at import. Not in tests marked `slow` (the 200k-request
soak measures memory over a long run) or `unchecked`: with thousands of requests in flight a
full recount per event makes them quadratic.
"""

from __future__ import annotations

import pytest

from aioprefill.sched.scheduler import Scheduler


@pytest.fixture(autouse=True)
def _check_scheduler_invariants(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    node = request.node
    if node.get_closest_marker("slow") is None and node.get_closest_marker("unchecked") is None:
        monkeypatch.setattr(Scheduler, "checking", True)
        monkeypatch.setenv("AIOPREFILL_CHECK_INVARIANTS", "1")
    yield
