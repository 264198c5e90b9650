"""A script that starts an Engine without a main guard fails saying so (real script, real
subprocess, real spawn re-import); the same script with the guard runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")

SCRIPT = """
import asyncio
from aioprefill import Engine, EngineConfig, SimModel

async def main():
    config = EngineConfig(model=SimModel(fixed_ms=1.0), start_method={method!r})
    async with Engine(config) as engine:
        print("token", (await engine.prefill([1, 2, 3])).token)
"""


def run_script(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run `body` as a script; `.args` of the result is the script's pid."""
    path = tmp_path / "server.py"
    path.write_text(textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with subprocess.Popen(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as popen:
        out, err = popen.communicate(timeout=120)
    return subprocess.CompletedProcess(popen.pid, popen.returncode, out, err)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_missing_main_guard_is_named_with_the_fix(tmp_path, method):
    proc = run_script(tmp_path, SCRIPT.format(method=method) + "\nasyncio.run(main())\n")
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    # The engine's own error: exit code read after reaping, the module named, the fix given.
    assert last.startswith("aioprefill.errors.WorkerStartFailed: worker 0 (pid "), last
    assert "exit code 1;" in last and "code None" not in proc.stderr
    assert f"the main module {tmp_path / 'server.py'} has no main guard" in last
    assert 'under `if __name__ == "__main__":`' in last
    # The worker's traceback says the same instead of multiprocessing's bootstrapping riddle.
    assert "while multiprocessing was still bootstrapping this process" in proc.stderr
    assert "has finished its bootstrapping phase" not in proc.stderr
    assert not list(SHM.glob(f"aioprefill-{proc.args}-*"))  # its channels were unlinked


def test_the_same_script_with_the_guard_runs(tmp_path):
    body = SCRIPT.format(method="spawn") + '\nif __name__ == "__main__":\n    asyncio.run(main())\n'
    proc = run_script(tmp_path, body)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("token ")


def test_guard_detection_reads_the_source(tmp_path, monkeypatch):
    from aioprefill.engine.pool import main_guard

    main = tmp_path / "m.py"
    monkeypatch.setattr(sys.modules["__main__"], "__file__", str(main), raising=False)
    for source, guarded in [
        ("x = 1\n", False),
        ("if __name__ == '__main__':\n    pass\n", True),
        ("if '__main__' == __name__:\n    pass\n", True),
        ("def f():\n    if __name__ == '__main__':\n        pass\n", False),
    ]:
        main.write_text(source)
        assert (main_guard.missing_guard_hint() == "") is guarded, source
