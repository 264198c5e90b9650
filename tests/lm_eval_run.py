"""lm-eval's CLI run as its users run it, in the reference venv (tests/refvenv.py), on the
project's own tasks (tests/data/lm_eval), reduced to what the goldens compare: each task's
metrics and every request's loglikelihood (and is_greedy). Used by
benchmarks/make_lm_eval_goldens.py (`--model hf`) and tests/serve/test_lm_eval.py
(`--model local-completions` through the server)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from tests import refvenv

ROOT = refvenv.ROOT
TASKS = "aioprefill_mc,aioprefill_ppl"


def run(model: str, model_args: str, *extra: str) -> dict:
    """`lm_eval --model MODEL --model_args ARGS --tasks ... --log_samples`, offline, then its
    metrics and per-request loglikelihoods as plain JSON."""
    lm_eval = refvenv.ensure().parent / "lm_eval"
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
