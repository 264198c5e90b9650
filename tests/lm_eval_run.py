"""lm-eval's CLI run as its users run it, on the project's own tasks (tests/data/lm_eval), reduced
to what the goldens compare: each task's metrics and every request's loglikelihood (and
is_greedy). Used by benchmarks/tools/make_lm_eval_goldens.py (`--model hf`, in the reference venv:
tests/refvenv.py, torch) and tests/serve/test_lm_eval.py (`--model local-completions` through
the server, in the lm-eval venv below).

The lm-eval venv (`~/.cache/aioprefill/lm-eval-venv`, outside any checkout so that every clone
and CI run on a machine reuse one, as the vLLM venv: tests/vllm/vllmvenv.py;
`AIOPREFILL_LM_EVAL_VENV` moves it; made on first use, reused after):
lm-eval 0.4.13 with its `api` extra and transformers, no torch. lm-eval's `local-completions`
imports no torch; for `tokenizer=DIR` it loads the tokenizer with transformers' AutoTokenizer
(its `huggingface` tokenizer backend), which reads a tokenizer.json directory without torch.
Measured on a loaded 2-core machine: 50 s for lm-eval[api], 11 s for transformers."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from tests import refvenv

ROOT = refvenv.ROOT
TASKS = "aioprefill_mc,aioprefill_ppl"
LM_EVAL_VENV = Path(
    os.environ.get(
        "AIOPREFILL_LM_EVAL_VENV", Path.home() / ".cache" / "aioprefill" / "lm-eval-venv"
    )
)
LM_EVAL_REQUIREMENTS = [
    "lm-eval[api]==0.4.13",
    # the tokenizer only (lm-eval's `huggingface` tokenizer backend); no torch comes with it
    "transformers==5.24.0",
]


def lm_eval_venv() -> Path:
    """The lm-eval venv's python (no torch), made when missing."""
    return refvenv.make(LM_EVAL_VENV, LM_EVAL_REQUIREMENTS)


def run(model: str, model_args: str, *extra: str, python: Path) -> dict:
    """`lm_eval --model MODEL --model_args ARGS --tasks ... --log_samples` with the lm-eval of
    the venv of `python`, offline, then its metrics and per-request loglikelihoods as JSON."""
    lm_eval = python.parent / "lm_eval"
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   HF_HOME=str(Path(out) / "hf"), TOKENIZERS_PARALLELISM="false")  # fmt: skip
        cmd = [str(lm_eval), "--model", model, "--model_args", model_args, "--tasks", TASKS,
               "--include_path", "tests/data/lm_eval", "--output_path", str(Path(out) / "res"),
               "--log_samples", *extra]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        results = json.loads(next(Path(out).rglob("results_*.json")).read_text())
        samples = {}
        for task in TASKS.split(","):
            rows = [json.loads(line) for f in Path(out).rglob(f"samples_{task}_*.jsonl")
                    for line in f.read_text().splitlines()]  # fmt: skip
            rows.sort(key=lambda r: r["doc_id"])
            samples[task] = [_plain(r["filtered_resps"]) for r in rows]
    metrics = {
        task: {k.split(",")[0]: v for k, v in values.items()
               if isinstance(v, float) and "stderr" not in k}
        for task, values in results["results"].items()
    }  # fmt: skip
    command = " ".join(cmd[1:]).replace(out, "OUT")
    return {"metrics": metrics, "samples": samples, "command": command}


def _plain(x: object) -> object:
    """lm-eval's logged responses (strings: "-4.5", "False") as numbers and booleans."""
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if x in ("True", "False"):
        return x == "True"
    if isinstance(x, str):
        return float(x)
    return x
