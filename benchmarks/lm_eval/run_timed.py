"""One lm-eval run, timed, inside the reference venv (tests/refvenv.py: lm-eval, torch and
transformers are never aioprefill's dependencies): what `lm_eval --model M --model_args A
--tasks T --include_path benchmarks/lm_eval --log_samples` does, with the model's construction
(for `hf`: loading the checkpoint) and its `loglikelihood` calls timed apart. Prints one JSON
line: the times, the metrics and every request's [loglikelihood, is_greedy].

    .ref-venv/bin/python benchmarks/lm_eval/run_timed.py MODEL MODEL_ARGS [LIMIT]
Run by benchmarks/bench_lm_eval.py from the repository root.
"""

from __future__ import annotations

import json
import sys
import time


def main() -> None:
    model, model_args = sys.argv[1], sys.argv[2]
    limit = int(sys.argv[3]) if len(sys.argv) > 3 else None  # lm-eval's --limit: first N docs
    task = "aioprefill_mc5"
    t0 = time.perf_counter()
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    t1 = time.perf_counter()
    lm = get_model(model).create_from_arg_string(model_args, {"device": "cpu"})
    t2 = time.perf_counter()
    spent = [0.0]
    inner = lm.loglikelihood

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    lm.loglikelihood = timed
    out = lm_eval.simple_evaluate(
        model=lm, tasks=[task], task_manager=TaskManager(include_path="benchmarks/lm_eval"),
        log_samples=True, limit=limit,
    )  # fmt: skip
    t3 = time.perf_counter()
    rows = sorted(out["samples"][task], key=lambda r: r["doc_id"])
    samples = [[[float(ll), bool(g)] for ll, g in r["filtered_resps"]] for r in rows]
    metrics = {k.split(",")[0]: v for k, v in out["results"][task].items()
               if isinstance(v, float) and "stderr" not in k}  # fmt: skip
    print(json.dumps({
        "import_s": t1 - t0, "load_s": t2 - t1, "evaluate_s": t3 - t2,
        "loglikelihood_s": spent[0], "requests": sum(len(s) for s in samples),
        "metrics": metrics, "samples": samples,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
