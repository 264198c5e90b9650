"""`dtype="auto"`: which dtype a worker computes a checkpoint in.

The checkpoint's own dtype (config.json's `torch_dtype`, `dtype` in transformers 5 configs; a GGUF
file's float type) where the device computes it well, float32 otherwise:

- a GPU (`device="gpu"`) takes the checkpoint's float16 / bfloat16 / float32;
- a CPU (`device="cpu"` or `"auto"`: the engine process cannot ask Paddle whether a GPU is there)
  takes bfloat16 for a bfloat16 checkpoint where the CPU has bf16 units (`avx512_bf16` or
  `amx_bf16` in /proc/cpuinfo's flags; the worker also checks that the wheel's oneDNN has its bf16
  product and refuses to start without it), float32 otherwise (float16 checkpoints too: the CPU
  path has no float16 product);
- a quantized GGUF (Q4/Q8 blocks: the tests' SmolLM2) is float32: its weights are dequantized
  to float32 on load, and rounding them again to bfloat16 would add a second rounding
  (`docs/configuration.md`); a GGUF whose tensors are all F16/BF16/F32 maps like a config.

`float32` is the exact mode; `bfloat16` asked for explicitly on a CPU without bf16 units is refused
(`InvalidConfig`), while `auto` falls back to float32 with a log line. NumPy only (no paddle).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aioprefill.hf.gguf_file import GGUFHeader

__all__ = ["DTYPES", "checkpoint_dtype", "cpu_bf16_units", "gguf_dtype", "resolve_dtype"]

DTYPES = ("float32", "float16", "bfloat16")

log = logging.getLogger("aioprefill.hf")

_TORCH = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16",
          "bfloat16": "bfloat16"}  # fmt: skip


@functools.cache
def cpu_bf16_units() -> bool:
    """Whether /proc/cpuinfo lists avx512_bf16 or amx_bf16 (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split())
                    return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        pass
    return False


def checkpoint_dtype(config: dict[str, object]) -> str:
    """A config.json's dtype (`torch_dtype`, or `dtype`), float32 where it names none."""
    raw = config.get("torch_dtype", config.get("dtype"))
    name = str(raw).removeprefix("torch.") if raw is not None else "float32"
    return _TORCH.get(name, "float32")


# GGML tensor types that are plain floats: F32, F16, BF16 (any other is a quantized block type)
_GGML_FLOATS = {0: "float32", 1: "float16", 30: "bfloat16"}


def gguf_dtype(header: GGUFHeader) -> str:
    """A GGUF file's dtype: that of its 2-D (matrix) tensors when they are all one float type,
    float32 when any is quantized (dequantized to float32 on load) or they mix."""
    kinds = {_GGML_FLOATS.get(int(t.ggml_type), "quantized") for t in header.tensors.values()
             if len(t.shape) >= 2}  # fmt: skip
    return kinds.pop() if len(kinds) == 1 and "quantized" not in kinds else "float32"


def resolve_dtype(requested: str, stored: str, device: str, source: str = "") -> str:
    """The dtype a worker runs: `requested` itself unless it is `auto`, then `stored` (the
    checkpoint's) where `device` computes it well, float32 otherwise; the choice is logged."""
    if requested != "auto":
        return requested
    if device == "gpu" or stored == "float32":
        chosen, why = stored, "the checkpoint's"
    elif stored == "bfloat16" and cpu_bf16_units():
        chosen, why = "bfloat16", "the checkpoint's; this CPU has bf16 units"
    elif stored == "bfloat16":
        chosen, why = "float32", "the checkpoint is bfloat16 but this CPU has no bf16 units"
    else:
        chosen, why = "float32", f"the checkpoint is {stored}, which the CPU path does not run"
    log.info("dtype auto%s: %s (%s)", f" for {source}" if source else "", chosen, why)
    return chosen
