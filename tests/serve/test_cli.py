"""The command line refuses what cannot start, plainly, before any engine starts."""

from __future__ import annotations

import subprocess
import sys

from tests.serve.util import ROOT


def run(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aioprefill.serve", *flags],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip


def test_help_lists_the_flags():
    out = run("--help").stdout
    for flag in ("--model", "--workers", "--tp", "--ep", "--policy", "--max-batch-tokens",
                 "--max-batch-size", "--max-pending", "--max-prompt-tokens", "--host", "--port",
                 "--served-model-name", "--pooling", "--normalize", "--server"):  # fmt: skip
        assert flag in out, flag


def test_a_missing_model_or_a_bad_setting_is_one_line_not_a_traceback(tmp_path):
    done = run("--model", str(tmp_path / "nope.gguf"))
    assert done.returncode != 0 and done.stderr.startswith("aioprefill-serve: ")
    assert "Traceback" not in done.stderr
    done = run("--model", "sim", "--workers", "0")
    assert done.returncode != 0 and "EngineConfig.num_workers" in done.stderr
    assert "Traceback" not in done.stderr
