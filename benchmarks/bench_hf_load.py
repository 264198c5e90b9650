"""Loading a Hugging Face checkpoint directory: one `model.safetensors` vs the same model
sharded (`model.safetensors.index.json` + shards), through the real engine.

Writes a Llama checkpoint of the size given (default: 8 layers, hidden 1024, FFN 2816, vocab
32000, 158 M parameters, 633 MB as float32) twice, as a single file and in `--shard-mb` shards,
with the config.json `save_pretrained` would write, then for each starts an `Engine` on
`PaddleModel.from_pretrained(dir, device="cpu")` and measures:

- load time: `Engine.__aenter__` (worker start, weights read and moved into Paddle tensors,
  ready), wall clock;
- the worker's peak RSS (`VmHWM` in /proc/<pid>/status) after it reports ready, next to a
  worker that loads a 1-layer, hidden-64 model (what paddle itself costs) and to the float32
  weights' own size (what the loaded model must hold).

The loader reads one tensor at a time with plain reads (no mmap) and builds each layer as soon
as its tensors are in, so both layouts should peak near "paddle + model + one layer" and the
shard size should not matter. Runs alternate between the layouts; medians over `--repeats`.

    python benchmarks/bench_hf_load.py [--layers 8] [--hidden 1024] [--repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from aioprefill import Engine, EngineConfig, PaddleModel
from aioprefill.hf.weights import random_weights, save_weights


def config_json(spec: PaddleModel) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def write_checkpoints(spec: PaddleModel, root: Path, shard_mb: int) -> tuple[Path, Path, int]:
    weights = random_weights(spec, 0)
    nbytes = sum(w.nbytes for w in weights.values())
    single, sharded = root / "single", root / "sharded"
    for d in (single, sharded):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config_json(spec)))
    save_weights(single / "model.safetensors", weights)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, w in weights.items():
        if size and size + w.nbytes > shard_mb << 20:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_weights(sharded / file, shard)
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": nbytes}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    print(f"model: {nbytes / 2**20:.0f} MiB float32; {len(shards)} shards of <= {shard_mb} MiB")
    return single, sharded, nbytes


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


async def start(model: PaddleModel) -> tuple[float, float]:
    """Seconds to a ready engine, and its worker's peak RSS in MiB."""
    t0 = time.perf_counter()
    async with Engine(EngineConfig(model=model, max_prompt_tokens=64)) as engine:
        seconds = time.perf_counter() - t0
        peak = peak_rss_mib(engine.worker_pids()[0])
        await engine.prefill([1, 2, 3])
    return seconds, peak


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--shard-mb", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="write the checkpoints here")
    args = parser.parse_args()
    spec = PaddleModel(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_heads=16,
        num_kv_heads=8,
        intermediate_size=args.ffn,
        max_position_embeddings=4096,
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        single, sharded, nbytes = write_checkpoints(spec, root, args.shard_mb)
        base = PaddleModel(
            num_layers=1,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=512,
            device="cpu",
        )
        runs: dict[str, list[tuple[float, float]]] = {
            "paddle only": [],
            "single": [],
            "sharded": [],
        }
        for _ in range(args.repeats):
            runs["paddle only"].append(await start(base))
            for name, path in (("single", single), ("sharded", sharded)):
                runs[name].append(await start(PaddleModel.from_pretrained(path, device="cpu")))
    print(f"{'checkpoint':<12} {'load s':>8} {'peak RSS MiB':>13}   (medians of {args.repeats})")
    for name, values in runs.items():
        secs = statistics.median(v[0] for v in values)
        peak = statistics.median(v[1] for v in values)
        print(f"{name:<12} {secs:8.2f} {peak:13.0f}")
    print(f"float32 weights: {nbytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    asyncio.run(main())
