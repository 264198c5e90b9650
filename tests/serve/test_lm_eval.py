"""lm-eval as its users run it against the server: `lm_eval --model local-completions
--model_args base_url=http://HOST:PORT/v1/completions,tokenizer=DIR,tokenized_requests=True` on
the project's own multiple-choice and perplexity tasks (tests/data/lm_eval) gives lm-eval's `hf`
backend's scores on the same SmolLM2 checkpoint (tests/data/lm_eval/hf_scores.json, made by
benchmarks/tools/make_lm_eval_goldens.py): the same accuracies, perplexities within 1e-4, and every
request's loglikelihood within 2e-3 with the same is_greedy. lm-eval runs in a venv of its own
without torch (tests/lm_eval_run.py: lm-eval[api] and transformers for the tokenizer), which this
test creates when missing; its `tokenizer=` is the GGUF file's tokenizer as transformers saves
it, committed (tests/data/tokenizer/smollm2, benchmarks/tools/make_tokenizer_goldens.py)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.lm_eval_run import ROOT, lm_eval_venv, run
from tests.serve.util import serve
from tests.tokenizer_files import SMOLLM2_DIR

GOLDEN = json.loads((ROOT / "tests" / "data" / "lm_eval" / "hf_scores.json").read_text())

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_local_completions_scores_equal_the_hf_backend():
    python = lm_eval_venv()
    # the house rule: no torch in any venv the test run makes
    no_torch = "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is not None)"
    assert subprocess.run([str(python), "-c", no_torch]).returncode == 0, "torch in lm-eval venv"
    # lm-eval loads its tokenizer with transformers' AutoTokenizer from a directory: the GGUF
    # file's tokenizer, as transformers saves it (the pitfall docs/serving.md names)
    with serve("--served-model-name", "smollm2") as server:
        args = (f"base_url={server.url}/v1/completions,tokenizer={SMOLLM2_DIR},"
                "tokenized_requests=True,model=smollm2,num_concurrent=2,max_retries=1")  # fmt: skip
        got = run("local-completions", args, python=python)
    want = GOLDEN["metrics"]
    assert got["metrics"]["aioprefill_mc"] == want["aioprefill_mc"]  # acc, acc_norm
    for name, value in want["aioprefill_ppl"].items():
        assert got["metrics"]["aioprefill_ppl"][name] == pytest.approx(value, rel=1e-4), name
    for task, docs in GOLDEN["samples"].items():
        assert len(got["samples"][task]) == len(docs)
        for mine, theirs in zip(got["samples"][task], docs, strict=True):
            if task == "aioprefill_mc":  # per choice: [loglikelihood, is_greedy]
                assert [g for _, g in mine] == [g for _, g in theirs]
                mine, theirs = [ll for ll, _ in mine], [ll for ll, _ in theirs]
            assert mine == pytest.approx(theirs, abs=2e-3)  # ppl: [rolling loglikelihood]
