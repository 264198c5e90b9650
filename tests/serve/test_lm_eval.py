"""lm-eval as its users run it against the server: `lm_eval --model local-completions
--model_args base_url=http://HOST:PORT/v1/completions,tokenizer=DIR,tokenized_requests=True` on
the project's own multiple-choice and perplexity tasks (tests/data/lm_eval) gives lm-eval's `hf`
backend's scores on the same SmolLM2 checkpoint (tests/data/lm_eval/hf_scores.json, made by
benchmarks/make_lm_eval_goldens.py): the same accuracies, perplexities within 1e-4, and every
request's loglikelihood within 2e-3 with the same is_greedy. lm-eval runs in the reference venv
(tests/refvenv.py), which this test creates when missing."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests import refvenv
from tests.hf.smollm2 import gguf_path
from tests.lm_eval_run import ROOT, run
from tests.serve.util import serve

GOLDEN = json.loads((ROOT / "tests" / "data" / "lm_eval" / "hf_scores.json").read_text())

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_local_completions_scores_equal_the_hf_backend(tmp_path):
    python = refvenv.ensure()
    # lm-eval loads its tokenizer with transformers' AutoTokenizer from a directory: the GGUF
    # file's tokenizer, saved once (the pitfall docs/serving.md names)
    tokenizer = tmp_path / "tokenizer"
    save = ("import sys; from pathlib import Path; from transformers import AutoTokenizer; "
            "g = Path(sys.argv[1]); AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)"
            ".save_pretrained(sys.argv[2])")  # fmt: skip
    subprocess.run([str(python), "-c", save, str(gguf_path()), str(tokenizer)], check=True)
    with serve("--served-model-name", "smollm2") as server:
        args = (f"base_url={server.url}/v1/completions,tokenizer={tokenizer},"
                "tokenized_requests=True,model=smollm2,num_concurrent=2,max_retries=1")  # fmt: skip
        got = run("local-completions", args)
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
