"""Cost-model presets for `--model sim`: the one place their numbers live.

A `SimModel` sleeps `fixed_ms + per_token_us * tokens + attn_ns * sum(len^2)` per forward. Each
preset says where its numbers come from; refit them here (and only here) when they change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from aioprefill import InvalidConfig, PaddleModel, SimModel

__all__ = ["DEFAULT_PRESET", "SIM_PRESETS", "build_model", "cache_block_bytes", "model_label"]


_TOKENS, _SPEEDUP = 16, 40  # gpu-trace: 512-token hash ids as 32 tokens, 40x the trace's pace

SIM_PRESETS: Final[dict[str, SimModel]] = {
    # The tiny Paddle Llama (PaddleModel(seed=0): 4 layers, hidden 256, 19.6 M params) on one CPU
    # thread of the 2-vCPU build VM, fitted by least squares over packed batches from 1x16 to
    # 8192 tokens by benchmarks/bench_paddle_model.py (worst error 29%; the model also pays
    # ~0.7 ms per request for its 32000-wide LM-head row, which this form folds into the rest).
    "cpu-tiny": SimModel(fixed_ms=6.7, per_token_us=98.1, attn_ns=54.1, vocab_size=32000),
    # A GPU-class prefill model: a Llama-3-8B-shaped forward (32 layers, hidden 4096, GQA 32/8,
    # FFN 14336, vocab 128256, bf16, random weights, eager PyTorch + causal SDPA) on one NVIDIA
    # H200, 19 batch shapes from 1x16 to 1x16384 tokens, fitted with relative-error weights by
    # benchmarks/tools/fit_gpu_preset.py (raw figures:
    # benchmarks/results/policies/gpu_fit_h200.json; the fit is within 35% everywhere, worst at
    # tiny batches where kernel launches dominate).
    "gpu-class": SimModel(fixed_ms=10.9, per_token_us=25.7, attn_ns=0.69, vocab_size=32000),
    # gpu-class replaying a Mooncake trace scaled down 16x in tokens (hash ids of 32 tokens,
    # not 512) and sped up 40x in time: per-token costs x 16 / 40,
    # attention x 16^2 / 40, fixed / 40, so the GPU is as loaded as at full size and full pace
    # (the synthetic trace: 3,993 requests in 1,022 s become 25.6 s, about 2 minutes for cache
    # on and off on one worker). Use with --trace-block-tokens 32 --trace-speedup 40.
    "gpu-trace": SimModel(
        fixed_ms=10.9 / _SPEEDUP,
        per_token_us=25.7 * _TOKENS / _SPEEDUP,
        attn_ns=0.69 * _TOKENS**2 / _SPEEDUP,
        vocab_size=32000,
    ),
}


DEFAULT_PRESET: Final = "cpu-tiny"


def build_model(
    kind: str,
    preset: str = DEFAULT_PRESET,
    *,
    fixed_ms: float | None = None,
    per_token_us: float | None = None,
    attn_ns: float | None = None,
) -> SimModel | PaddleModel:
    """The model spec for `--model`: `PaddleModel(seed=0)`, a sim preset with overrides, or a
    checkpoint directory / `.gguf` file (`PaddleModel.from_pretrained`; `InvalidConfig` when
    it is neither)."""
    if kind == "paddle":
        return PaddleModel(seed=0)
    if kind != "sim":
        path = Path(kind)
        if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
            raise InvalidConfig(f"{kind!r} is not paddle, sim, a checkpoint directory or a .gguf")
        return PaddleModel.from_pretrained(path)
    base = SIM_PRESETS[preset]
    return SimModel(
        fixed_ms=base.fixed_ms if fixed_ms is None else fixed_ms,
        per_token_us=base.per_token_us if per_token_us is None else per_token_us,
        attn_ns=base.attn_ns if attn_ns is None else attn_ns,
        vocab_size=base.vocab_size,
    )


def model_label(model: SimModel | PaddleModel, preset: str | None = None) -> str:
    """A short human label, e.g. `sim:gpu-class (15 ms + 20 us/tok + 0 ns*len^2)`."""
    if isinstance(model, PaddleModel) and model.weights is not None:
        return (
            f"paddle ({Path(model.weights).name}: {model.architecture}, {model.num_layers} layers, "
            f"hidden {model.hidden_size}, vocab {model.vocab_size}, device {model.device})"
        )
    if isinstance(model, PaddleModel):
        return (
            f"paddle (seed={model.seed}, {model.num_layers} layers, hidden {model.hidden_size}, "
            f"device {model.device})"
        )
    name = f"sim:{preset}" if preset else "sim"
    return (
        f"{name} ({model.fixed_ms:g} ms + {model.per_token_us:g} us/tok + "
        f"{model.attn_ns:g} ns*len^2)"
    )


def cache_block_bytes(model: SimModel | PaddleModel, block_tokens: int) -> int:
    """Bytes one prefix-cache block of `block_tokens` tokens takes on a worker, as the worker
    counts them (0: unknown before it starts, e.g. a Paddle model's)."""
    if isinstance(model, SimModel):
        return model.kv_bytes_per_token * block_tokens  # workers/sim.py: the nominal KV size
    return 0
