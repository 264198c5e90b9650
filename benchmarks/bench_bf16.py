"""bfloat16 against float32 on the CPU (issue 35): speed side by side and accuracy against
transformers' float64 forward of the same weights, on SmolLM2-135M (the tests' GGUF).

Workloads (bench_vs_ctranslate2.py's, token ids kept in results/model/bf16_prompts.npz):
`64x280`, 64 prompts of 280 random ids (seed 0), run as 4 forwards of 16 prompts; `real12`, 12
real prompts of 12..900 tokens, one forward. Two tasks:
`next` (prefill + the next token's logprob) and `score` (prompt logprobs of every position).
aioprefill runs in this process as one `PaddleRunner` per dtype (the worker's forward, no
server), 1 thread, prefix cache off. Accuracy: every prompt once per dtype (with prompt logprobs)
against the float64 reference: greedy next tokens equal to float64's, next-token logprob max |d|,
prompt-logprob |d| mean / p99 / max. Speed: `--time-prompts` of 64x280's prompts (all of
real12's), dtypes interleaved A B B A over `--rounds`, medians as tok/s of wall time and
tok/CPU-s (the machine is shared: CPU time is the steadier figure).

    python benchmarks/bench_bf16.py [--rounds 2] [--time-prompts 32] [--workloads 64x280,real12]
    # the float64 reference (committed as results/model/bf16_reference_f64.npz), in a venv with
    # torch + transformers, from SmolLM2 as an HF float32 directory (the GGUF dequantized):
    .ref-venv/bin/python benchmarks/bench_bf16.py reference --hf-dir DIR --out FILE
    # a checkpoint that is bf16 (as the published SmolLM2): its reference and an HF bf16 dir, then
    .ref-venv/bin/python benchmarks/bench_bf16.py reference --hf-dir DIR --round-bf16 \
        --save-bf16 BF16DIR --out REF
    python benchmarks/bench_bf16.py --model BF16DIR --reference REF
    # a vLLM OpenAI server already started on the same model (docs/performance.md):
    python benchmarks/bench_bf16.py vllm --url http://127.0.0.1:PORT --label bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
from common import ROOT

RESULTS = ROOT / "benchmarks" / "results" / "model"
REFERENCE = RESULTS / "bf16_reference_f64.npz"  # transformers' float64 answers (`reference`)
PROMPTS = RESULTS / "bf16_prompts.npz"  # the token ids of both workloads


def cpu_line() -> str:
    """The CPU's model name and the flags that decide the bf16 path."""
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    keep = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
    return f"{model}; flags: {' '.join(f for f in keep if f in flags) or '-'}"


def workloads(names: list[str]) -> dict[str, list[np.ndarray]]:
    """The prompts, from PROMPTS (bench_vs_ctranslate2.py's two workloads as they were drawn
    for the float64 reference: its real12 texts are this repository's files, which move)."""
    ids = np.load(PROMPTS)
    count = {"64x280": 64, "real12": 12}
    return {n: [ids[f"{n}_{i}"].astype(np.int32) for i in range(count[n])] for n in names}


def batches(prompts: list[np.ndarray], per: int, scores: bool):
    from aioprefill.wire import protocol
    from aioprefill.workers.runner import ForwardBatch

    opt = protocol.OPT_PROMPT_LOGPROBS if scores else 0
    out = []
    for lo in range(0, len(prompts), per):
        part = prompts[lo : lo + per]
        n = len(part)
        offsets = np.zeros(n + 1, np.int32)
        offsets[1:] = np.cumsum([len(p) for p in part])
        out.append(ForwardBatch(
            np.arange(lo, lo + n, dtype=np.int64), offsets, np.concatenate(part),
            np.zeros(n, np.int32), np.ones(n, bool), options=np.full(n, opt, np.uint8),
        ))  # fmt: skip
    return out


def run_aioprefill(args: argparse.Namespace) -> None:
    from aioprefill.config import PaddleModel
    from aioprefill.workers.paddle.runner import PaddleRunner
    from tests.hf.smollm2 import gguf_path

    model = args.model or str(gguf_path())
    print(f"# CPU: {cpu_line()}")
    print(f"# aioprefill PaddleRunner, {args.model or 'SmolLM2-135M GGUF'}, 1 thread, "
          f"{args.rounds} rounds A B B A; reference {args.reference}")  # fmt: skip
    dtypes = ("float32", "bfloat16")
    runners = {
        d: PaddleRunner(PaddleModel.from_pretrained(model, device="cpu", dtype=d)) for d in dtypes
    }
    sets = workloads(args.workloads.split(","))
    ref = np.load(args.reference)
    for name, prompts in sets.items():
        per = 16 if name == "64x280" else len(prompts)
        # accuracy: every prompt once per dtype, with prompt logprobs (the next token comes too)
        outs = {d: [runners[d].forward(b) for b in batches(prompts, per, True)] for d in dtypes}
        for d in dtypes:
            got = (
                accuracy(outs[d], ref, name, "next") + "; " + accuracy(outs[d], ref, name, "score")
            )
            print(f"{name:7s} {d:9s} vs float64: {got}")
        timed = prompts[: args.time_prompts] if name == "64x280" else prompts
        tokens = sum(len(p) for p in timed)
        for task in ("next", "score") if args.rounds else ():  # --rounds 0: accuracy only
            work = batches(timed, per, task == "score")
            wall: dict[str, list[float]] = {d: [] for d in dtypes}
            cpu: dict[str, list[float]] = {d: [] for d in dtypes}
            for r in range(args.rounds):
                for d in dtypes if r % 2 == 0 else dtypes[::-1]:
                    w0, c0 = time.perf_counter(), time.process_time()
                    for b in work:
                        runners[d].forward(b)
                    wall[d].append(time.perf_counter() - w0)
                    cpu[d].append(time.process_time() - c0)
            speed = {d: (tokens / statistics.median(wall[d]), tokens / statistics.median(cpu[d]))
                     for d in dtypes}  # fmt: skip
            label = f"{name} ({len(timed)} prompts)"
            for d in dtypes:
                w, c = speed[d]
                ratio = "" if d == "float32" else (
                    f"  x{w / speed['float32'][0]:.2f} wall, x{c / speed['float32'][1]:.2f} CPU"
                )  # fmt: skip
                print(f"{label:18s} {task:5s} {d:9s} {w:7.0f} tok/s {c:7.0f} tok/CPU-s{ratio}")
        sys.stdout.flush()


def accuracy(outs, ref, name: str, task: str) -> str:
    tokens = np.concatenate([o.tokens for o in outs])
    if task == "next":
        lps = np.concatenate([o.logprobs for o in outs])
        same = int((tokens == ref[f"{name}_0"]).sum())
        d = np.abs(lps - ref[f"{name}_1"]).max()
        return f"greedy {same}/{len(tokens)} = float64, next-token logprob max |d| {d:.2e}"
    # prompt logprobs: per prompt, tokens 1.. (the first has no context), back to back
    plp = np.concatenate([o.prompt_logprobs for o in outs]).astype(np.float64)
    d = np.abs(plp - ref[f"{name}_2"])
    return (
        f"prompt logprob |d| mean {d.mean():.2e} p99 {np.quantile(d, 0.99):.2e} max {d.max():.2e}"
    )


def run_vllm(args: argparse.Namespace) -> None:
    """A running vLLM OpenAI server (`--url`, started by hand: see docs/performance.md) on the
    same prompts: 64 requests in flight 16 at a time, max_tokens 1; next token (logprobs 1) and
    scoring (echo + prompt_logprobs); wall tok/s per pass, then accuracy against float64."""
    import asyncio

    import aiohttp

    ref = np.load(args.reference)
    sets = workloads(args.workloads.split(","))

    async def one(session, p: np.ndarray, score: bool) -> dict:
        body = {"model": args.served_model, "prompt": p.tolist(), "max_tokens": 1,
                "temperature": 0, "logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
        if score:
            body |= {"echo": True, "prompt_logprobs": 0}
        async with session.post(args.url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            return (await r.json())["choices"][0]

    async def run(prompts, score: bool) -> tuple[list[dict], float]:
        sem = asyncio.Semaphore(16)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:

            async def bounded(p):
                async with sem:
                    return await one(session, p, score)

            t0 = time.perf_counter()
            got = await asyncio.gather(*(bounded(p) for p in prompts))
            return got, time.perf_counter() - t0

    for name, prompts in sets.items():
        tokens = sum(len(p) for p in prompts)
        for task in ("next", "score"):
            got, wall = asyncio.run(run(prompts, task == "score"))
            print(
                f"vllm {args.label} {name:7s} {task:5s} {tokens / wall:7.0f} tok/s (wall, 1 pass)"
            )
        toks = np.array([int(c["logprobs"]["tokens"][-1].split(":")[-1]) for c in got])
        lps = np.array([c["logprobs"]["token_logprobs"][-1] for c in got], np.float64)
        plp = np.concatenate([_prompt_logprobs(c, p) for c, p in zip(got, prompts, strict=True)])
        same = int((toks == ref[f"{name}_0"]).sum())
        d = np.abs(plp - ref[f"{name}_2"])
        print(f"vllm {args.label} {name:7s} vs float64: greedy {same}/{len(toks)}, next-token "
              f"logprob max |d| {np.abs(lps - ref[f'{name}_1']).max():.2e}; prompt logprob |d| "
              f"mean {d.mean():.2e} p99 {np.quantile(d, 0.99):.2e} max {d.max():.2e}")  # fmt: skip
        sys.stdout.flush()


def _prompt_logprobs(choice: dict, prompt: np.ndarray) -> list[float]:
    """vLLM's prompt_logprobs (None for token 0, then {token id: {logprob...}}) of the prompt."""
    entries = choice["prompt_logprobs"][1:]
    return [e[str(int(t))]["logprob"] for e, t in zip(entries, prompt[1:], strict=True)]


def reference(args: argparse.Namespace) -> None:
    """transformers' float64 forward (run in a venv with torch + transformers). `--round-bf16`:
    of the weights rounded to bfloat16 first (a checkpoint that is bf16, as the published
    SmolLM2; `--save-bf16 DIR` writes it as a bfloat16 HF directory for both engines)."""
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float64).eval()
    if args.round_bf16:
        with torch.no_grad():
            for p in model.parameters():  # float32 values: one rounding, to nearest even
                p.copy_(p.to(torch.bfloat16).to(torch.float64))
    if args.save_bf16:  # a copy loaded as bf16 (model.to(bf16) would round RoPE's inv_freq too)
        bf16 = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.bfloat16)
        bf16.save_pretrained(args.save_bf16)
        for f in Path(args.hf_dir).iterdir():  # the tokenizer's files, as they are
            if f.name.startswith(("tokenizer", "chat_template", "generation")):
                shutil.copy(f, Path(args.save_bf16) / f.name)
    out = {}
    for name, prompts in workloads(args.workloads.split(",")).items():
        toks, lps, plps = [], [], []
        for p in prompts:
            with torch.no_grad():
                logits = model(torch.tensor(p[None].astype(np.int64))).logits[0]
            lp = torch.log_softmax(logits, dim=-1)
            toks.append(int(torch.argmax(lp[-1])))
            lps.append(float(lp[-1].max()))
            target = torch.tensor(p[1:].astype(np.int64))[:, None]
            plps.append(lp[:-1].gather(1, target)[:, 0].numpy())
        out[f"{name}_0"] = np.array(toks, np.int32)
        out[f"{name}_1"] = np.array(lps)
        out[f"{name}_2"] = np.concatenate(plps)
    np.savez(args.out, **out)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "what", nargs="?", default="aioprefill", choices=["aioprefill", "reference", "vllm"]
    )
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--time-prompts", type=int, default=32, help="of 64x280's, for the timing")
    p.add_argument("--workloads", default="64x280,real12")
    p.add_argument("--reference", default=str(REFERENCE))
    p.add_argument("--hf-dir", default="")
    p.add_argument("--model", default="", help="aioprefill: a checkpoint (default: the GGUF)")
    p.add_argument("--out", default=str(REFERENCE))
    p.add_argument("--round-bf16", action="store_true", help="reference: bf16 weights")
    p.add_argument("--save-bf16", default="", help="reference: write them as an HF dir")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="vllm: the server")
    p.add_argument("--served-model", default="smollm2")
    p.add_argument("--label", default="", help="vllm: a name for its dtype in the output")
    args = p.parse_args()
    {"aioprefill": run_aioprefill, "reference": reference, "vllm": run_vllm}[args.what](args)


if __name__ == "__main__":
    main()
