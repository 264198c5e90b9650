"""A Mixtral-style mixture-of-experts MLP for the packed forward, alone or expert-parallel.

Routing is Mixtral's (transformers' `MixtralTopKRouter` / `MixtralExperts`): router logits
`h @ gate.T` in the model's dtype, softmax over the experts in float32, the
`num_experts_per_tok` most probable kept and renormalised to sum to 1. Each expert is a SwiGLU
MLP `w2(silu(w1 h) * w3 h)`; a token's output is the weighted sum of its experts' outputs,
added expert by expert in expert order. Router jitter and the load-balancing loss are
training-only there, so absent here. Two differences, neither of which the golden meets:
an exact tie in probability at the k-th place goes to the lower expert id (a stable sort:
deterministic and batch-invariant), where torch.topk leaves equal values' order to its kernel
(on CPU, of four equal probabilities it kept experts 2 and 3); and the weights are rounded to
the model's dtype before they scale an expert's output (transformers 4.x did the same; 5.x
multiplies in float32 and rounds once), which matters only for bfloat16/float16 on a GPU.

Expert parallelism: each EP rank holds a slice of the experts and its own batch of tokens. Per
layer, the ranks all_gather their hidden states together with the routing each owner chose
(padded to the group's largest batch), every rank applies its experts to the tokens routed to
them, and an all_reduce sums the partial outputs; each rank keeps its own rows. Gloo on CPU has
no all_to_all, hence all_gather + all_reduce (the brief's other option): it moves every token
to every rank, which a GPU build with NCCL's all_to_all would not need. A rank that skips a step
leaves its peers blocked inside the all_gather: that is why the engine must keep EP ranks in
lockstep. Routing is decided where the token lives and travels with it, so a rank never
re-routes a token it did not compute.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import paddle
import paddle.nn.functional as F

from aioprefill.models import PaddleModel
from aioprefill.workers.collectives import PaddleGroup
from aioprefill.workers.paddle.head import host

__all__ = ["MoE"]


class MoE:
    """One layer's router and this rank's experts (`experts[e] = (w1|w3, w2)`, global ids)."""

    __slots__ = ("experts", "gate", "top_k")

    def __init__(
        self,
        w: dict[str, np.ndarray],
        spec: PaddleModel,
        to_device: Callable[[np.ndarray], paddle.Tensor],
    ) -> None:
        """`w`: the layer's parts (`router`, `expert.{e}.w1/w2/w3` for this rank's experts)."""
        self.top_k = spec.num_experts_per_tok
        self.gate = to_device(w["router"])
        ids = sorted(
            int(p.split(".")[1]) for p in w if p.startswith("expert.") and p.endswith("w1")
        )
        self.experts: dict[int, tuple[paddle.Tensor, paddle.Tensor]] = {}
        for e in ids:
            w13 = np.concatenate([w[f"expert.{e}.w1"], w[f"expert.{e}.w3"]])
            self.experts[e] = (to_device(w13), to_device(w[f"expert.{e}.w2"]))

    def route(self, h: paddle.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Each row's experts `[rows, top_k]` (int) and their renormalised weights (float32)."""
        logits = paddle.matmul(h, self.gate, transpose_y=True).astype("float32").numpy()
        logits = logits - logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=-1, keepdims=True)
        chosen = np.argsort(-probs, axis=-1, kind="stable")[:, : self.top_k]
        weights = np.take_along_axis(probs, chosen, axis=-1)
        return chosen, (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)

    def apply(self, h: paddle.Tensor, chosen: np.ndarray, weights: np.ndarray) -> paddle.Tensor:
        """Sum over this rank's experts of weight * expert(row), for every row of `h` (zeros
        for rows none of them was chosen for). With TP the result is a partial sum."""
        out = paddle.zeros(h.shape, dtype=h.dtype)
        for e, (w13, w2) in self.experts.items():
            rows, slot = np.nonzero(chosen == e)
            if len(rows) == 0:
                continue
            index = paddle.to_tensor(rows.astype(np.int64))
            up = F.swiglu(paddle.matmul(paddle.gather(h, index), w13, transpose_y=True))
            y = paddle.matmul(up, w2, transpose_y=True)
            scale = paddle.to_tensor(weights[rows, slot][:, None], dtype=h.dtype)
            out = paddle.index_add(out, index, 0, y * scale)
        return out

    def forward(self, h: paddle.Tensor, group: PaddleGroup | None) -> paddle.Tensor:
        """The MoE MLP's output for this rank's rows; `group`: the EP group, or None."""
        chosen, weights = self.route(h)
        if group is None:
            return self.apply(h, chosen, weights)
        rows, hidden = int(h.shape[0]), int(h.shape[1])
        most = int(group.all_reduce(paddle.to_tensor([rows], dtype="int64"), op="max")[0])
        # Each row travels with its routing, as float32 (expert ids < 2^24 are exact; a 2-byte
        # model's rows widen exactly and narrow back: in bfloat16 the ids would be exact only
        # up to 256 and the weights lose 8 bits, and `.numpy()` would give raw bits); padding
        # rows (up to the group's largest batch) go to no expert.
        routing = np.zeros((most, 2 * self.top_k), dtype=np.float32)
        routing[:, : self.top_k] = -1
        routing[:rows, : self.top_k] = chosen
        routing[:rows, self.top_k :] = weights
        mine = paddle.concat([h, paddle.zeros([most - rows, hidden], dtype=h.dtype)])
        mine = paddle.concat([mine.astype("float32"), paddle.to_tensor(routing)], axis=1)
        every = group.all_gather(mine).reshape([group.size * most, hidden + 2 * self.top_k])
        tail = host(every[:, hidden:])
        chosen_all = tail[:, : self.top_k].astype(np.int64)
        out = self.apply(every[:, :hidden].astype(h.dtype), chosen_all, tail[:, self.top_k :])
        group.all_reduce(out)
        begin = group.rank * most
        return out[begin : begin + rows]
