"""The golden checkpoints of tests/data/hf (built by benchmarks/tools/make_hf_goldens.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data" / "hf"
GOLDENS = sorted(p.name for p in DATA.iterdir() if (p / "expected.json").is_file())


def expected(name: str) -> dict:
    """prompts, tokens, logprobs (HF, float64) and top-2 margins of one golden checkpoint."""
    return json.loads((DATA / name / "expected.json").read_text())


def copy_with_config(tmp: Path, name: str, **changes) -> Path:
    """A copy of a golden checkpoint whose config.json has keys set (None: removed)."""
    out = tmp / name
    shutil.copytree(DATA / name, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (out / "config.json").write_text(json.dumps(config))
    return out
