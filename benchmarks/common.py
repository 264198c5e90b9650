"""What the benchmark scripts share, in one place: the repository's paths, a free loopback port, CPU
time read from /proc, the Mooncake synthetic trace's location.

A maintained script (benchmarks/*.py) imports it directly: `python benchmarks/x.py` puts
benchmarks/ first on sys.path. A study (benchmarks/studies/<topic>/) or a tool (benchmarks/tools/)
first puts benchmarks/ there itself, in one line:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ (tools/: parents[1])
    import common

Importing it appends the repository root (so `aioprefill` is this checkout's unless PYTHONPATH
names another one first: the A/B studies rely on that) and benchmarks/ (the maintained scripts a
study imports from) to sys.path. Standard library only: the golden builders import it from the
reference venvs (torch, transformers), which do not have aioprefill's dependencies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent  # benchmarks/
ROOT = BENCH.parent  # the repository
RESULTS = BENCH / "results"

for _p in (str(ROOT), str(BENCH)):
    if _p not in sys.path:
        sys.path.append(_p)

_TRACE_NAME = Path("shared", "traces", "mooncake_synthetic_trace.jsonl")
# The Mooncake synthetic trace: the first `shared/traces/...` found above the checkout (the
# workplace keeps it at /work/shared), or the relative path (a script's `--trace` overrides it).
TRACE = next((p / _TRACE_NAME for p in BENCH.parents if (p / _TRACE_NAME).is_file()), _TRACE_NAME)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` so far (/proc/PID/stat: 10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """CPU seconds of every thread of `pid` so far, at ns resolution (schedstat's first field;
    /proc/PID/stat's utime+stime tick at only 10 ms)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def tree_cpu_s(pid: int) -> float:
    """CPU seconds so far of `pid`, its threads and all its descendants (schedstat, ns)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(FileNotFoundError):
                    total += int((task / "schedstat").read_text().split()[0])
                    todo += [int(c) for c in (task / "children").read_text().split()]
    return total / 1e9


@contextlib.contextmanager
def locked(path: str | None):
    """An exclusive flock on `path` (a shared machine's measurement lock); none without it."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
