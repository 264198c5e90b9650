"""A `PaddleModel`'s weights on the device, in the layout `PaddleRunner`'s forward multiplies.

`weights.iter_weights` streams the model as `(layer, part, float32 array)`; `load_to_device`
passes each tensor through the rank's `Shard` (only its slice, only its experts) and builds a
decoder layer's `Layer` as soon as the layer's last tensor arrives, dropping its host arrays, so
loading holds about one layer on the host beyond the device copy, whatever the checkpoint's file
layout. `rope_tables` builds the RoPE cos/sin tables once.

The layout is the contract with the forward (`paddle.runner`), which relies on it unchecked:

- `Layer.qkv` is q, k and v heads-major, `[heads + 2 * kv_heads, hidden, head_dim]`: one
  batched matmul of `[1, rows, hidden]` with it gives `[heads + 2 * kv_heads, rows, head_dim]`,
  q and k a contiguous leading slice (RoPE runs on both at once), v the rest.
- Queries come out scaled by `head_dim^-0.5`, as attention (`paddle.attention.attend`) expects:
  the scale is folded into q_proj and its bias, or, with q/k norms, into q_norm's weight.
- `Layer.qkv_bias` is `[heads + 2 * kv_heads, 1, head_dim]`, for a rank-1 spread over the rows.
- `o`, `gate_up` (gate rows, then up rows: `F.swiglu`'s order) and `down` keep HF's `[out, in]`
  layout and are multiplied with `transpose_y`; with experts, `moe` holds a `paddle.moe.MoE`
  instead of `gate_up` / `down`.
- The RoPE tables are cos and a sign-folded sin, so rotating is `x*cos + roll(x)*sin`.
- bfloat16 on a CPU (`paddle.onednn.cpu_bf16`): the decoder layers' product weights (qkv, o,
  gate_up, down) are bfloat16, in HF's `[out, in]` layout, for `paddle.gemm`'s bf16 product;
  everything else (the embedding, the LM head, norms, biases, RoPE tables, MoE experts and
  router) float32, the forward's compute dtype there (Paddle's CPU ops have no bfloat16
  kernels). The head in bf16 cost 0.014 of the prompt-logprob p99 against float64 on SmolLM2
  (docs/performance.md), and it is one product of the forward.

Only worker processes and model-level tests import this module (it imports paddle).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import paddle

from aioprefill.errors import InvalidConfig
from aioprefill.hf.tensors import layer_parts
from aioprefill.hf.weights import iter_weights
from aioprefill.models import PaddleModel
from aioprefill.workers.paddle.moe import MoE
from aioprefill.workers.paddle.shard import Shard
from aioprefill.workers.rope import rope_inv_freq

__all__ = ["DeviceWeights", "Layer", "load_to_device", "rope_tables"]


def _heads_major(w: np.ndarray, dim: int) -> np.ndarray:
    """HF [heads * dim, hidden] -> [heads, hidden, dim]: a batched matmul of [1, rows, hidden]
    with it writes q/k/v straight into the [heads, rows, dim] layout attention wants."""
    return w.reshape(-1, dim, w.shape[1]).transpose(0, 2, 1)


class Layer:
    """One decoder layer's weights on the device, laid out for the packed forward.

    `w` maps the layer's parts (`aioprefill.hf.tensors.layer_parts`) to float32 arrays.
    """

    __slots__ = (
        "down",
        "gate_up",
        "in_norm",
        "k_norm",
        "moe",
        "o",
        "post_norm",
        "q_norm",
        "qkv",
        "qkv_bias",
    )

    def __init__(
        self, w: dict[str, np.ndarray], spec: PaddleModel, *, in_out: bool, bf16: bool = False
    ) -> None:
        dtype = "float32" if bf16 else spec.dtype  # `bf16`: bfloat16 products on a CPU

        def t(a: np.ndarray) -> paddle.Tensor:
            return paddle.to_tensor(np.ascontiguousarray(a), dtype=dtype)

        def wt(a: np.ndarray) -> paddle.Tensor:  # a product's weight
            return t(a).astype("bfloat16") if bf16 else t(a)

        def linear(a: np.ndarray) -> paddle.Tensor:  # HF's [out, in], or [in, out] (in_out)
            return wt(a.T if in_out else a)

        dim = spec.head_dim
        # Queries are scaled by head_dim^-0.5 for the scores. Without q/k norms the scale is
        # folded into q_proj (and its bias; RoPE is linear), which saves an op per score matrix;
        # with them it goes into q_norm's weight, since a norm after q_proj would undo it.
        scale = 1.0 if spec.qk_norm else dim**-0.5
        qk = np.concatenate([_heads_major(w["q"] * scale, dim), _heads_major(w["k"], dim)])
        # One product gives [q k | v], each part a contiguous leading slice (no copies).
        self.qkv = wt(np.concatenate([qk, _heads_major(w["v"], dim)]))
        self.qkv_bias: paddle.Tensor | None = None
        if spec.attention_bias:
            # [heads + 2 * kv_heads, 1, dim]: spread over the rows of the qkv product.
            bias = np.concatenate([w["q_bias"] * scale, w["k_bias"], w["v_bias"]])
            self.qkv_bias = t(bias.reshape(-1, 1, dim))
        self.q_norm: paddle.Tensor | None = None
        self.k_norm: paddle.Tensor | None = None
        if spec.qk_norm:
            self.q_norm = t(w["q_norm"] * dim**-0.5)
            self.k_norm = t(w["k_norm"])
        # The rest: [in, out] on a float32 CPU, else HF's [out, in] (`paddle.gemm.weights_in_out`).
        self.o = linear(w["o"])
        # parallel: a mixture of experts replaces the dense MLP (paddle.moe)
        self.moe = MoE(w, spec, t) if spec.num_experts else None
        if self.moe is None:
            self.gate_up = linear(np.concatenate([w["gate"], w["up"]]))
            self.down = linear(w["down"])
        self.in_norm = t(w["in_norm"])
        self.post_norm = t(w["post_norm"])


class DeviceWeights(NamedTuple):
    """The whole model (this rank's share of it) on the device."""

    embed: paddle.Tensor  # [vocab, hidden], whole on every rank
    layers: list[Layer]
    norm: paddle.Tensor  # the final norm's weight
    lm_head: paddle.Tensor  # [vocab (this rank's slice under TP), hidden]; tied: embed's rows


def load_to_device(
    spec: PaddleModel, shard: Shard, *, in_out: bool = False, bf16: bool = False
) -> DeviceWeights:
    """Move the weights onto the current device as they stream in, layer by layer; only the
    parts and slices `shard` keeps; the linear layers' weights [in, out] with `in_out`; with
    `bf16` (a bfloat16 CPU worker) the layers' product weights bfloat16, the rest float32 (the
    embedding and the LM head too). Call under `paddle.no_grad()`."""
    parts = tuple(p for p in layer_parts(spec) if shard.wants(p))
    pending: dict[int, dict[str, np.ndarray]] = {}
    layers: list[Layer | None] = [None] * spec.num_layers
    top: dict[str, paddle.Tensor] = {}
    for layer, part, array in iter_weights(spec):
        if not shard.wants(part):
            continue
        array = shard.take(part, array)
        if layer is None:
            top[part] = paddle.to_tensor(array, dtype="float32" if bf16 else spec.dtype)
            continue
        have = pending.setdefault(layer, {})
        have[part] = array
        if len(have) == len(parts):
            layers[layer] = Layer(pending.pop(layer), spec, in_out=in_out, bf16=bf16)
    embed = top["embed"]
    lm_head = top["lm_head"] if "lm_head" in top else shard.vocab_rows(embed)
    norm = top["norm"]
    done = [layer for layer in layers if layer is not None]
    if pending or len(done) != spec.num_layers:
        raise InvalidConfig(f"PaddleModel.weights: incomplete layers {sorted(pending)}")
    return DeviceWeights(embed, done, norm, lm_head)


def rope_tables(
    spec: PaddleModel, positions: int, bf16: bool = False
) -> tuple[paddle.Tensor, paddle.Tensor]:
    """cos and sign-folded sin, [positions, head_dim], in the model's dtype (as HF casts them;
    float32 for a bfloat16 CPU worker, `bf16`),
    for HF's rotate_half convention: x*cos + rotate_half(x)*sin = x*cos + roll(x)*[-sin, sin],
    where roll swaps the two halves of the last axis."""
    inv_freq = rope_inv_freq(spec)
    angles = np.outer(np.arange(positions, dtype=np.float64), inv_freq)
    cos = np.cos(np.concatenate([angles, angles], axis=1))
    sin = np.concatenate([-np.sin(angles), np.sin(angles)], axis=1)
    dtype = "float32" if bf16 else spec.dtype
    return paddle.to_tensor(cos, dtype=dtype), paddle.to_tensor(sin, dtype=dtype)
