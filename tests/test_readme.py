"""The README's opening snippet runs as written: a real script (main guard included) starting a
Paddle engine with two workers and asking for every output option."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("paddle")  # the snippet uses PaddleModel (the [paddle] extra)


def test_the_readme_snippet_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S)
    assert snippet is not None, "README.md has no python snippet"
    code = snippet.group(1)
    assert 'if __name__ == "__main__":' in code  # workers are spawned
    script = tmp_path / "readme_snippet.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
