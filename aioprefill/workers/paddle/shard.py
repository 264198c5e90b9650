"""`Shard`: one rank's share of a `PaddleModel`, and the collectives that join the shares.

Tensor parallelism (Megatron-style, `tp` ranks): every rank keeps the whole embedding and the
norms, and a `1/tp` slice of everything else.

- q/k/v are column-parallel: rank r keeps query heads `[r*H/tp, (r+1)*H/tp)` and the KV heads
  they read (contiguous, because query head j reads KV head `j // (H/KV)`); gate/up keep rows
  `[r*F/tp, (r+1)*F/tp)`, as do the experts' w1/w3.
- o and down (and the experts' w2) are row-parallel: the matching columns, so each rank's
  product is a partial sum, and one all_reduce per block (`reduce`) adds them up.
- A KV export (`kv_writer`): each rank writes its KV heads' slice of the shared segment, which
  rank 0 alone creates; `kv_share` gives the slice and the all_reduce that orders the two.
- The LM head is vocab-parallel: rank r keeps rows `[r*V/tp, (r+1)*V/tp)` and runs the head's
  per-row reductions on its slice (max, first argmax, log-sum-exp, top-k, a target's logit);
  one all_gather of those per tile gives the global argmax (the lowest index among the ranks
  holding the max, as argmax over the whole row), the log-sum-exp
  `M + log(sum_r exp(lse_r - M))`, the top-k of all candidates and the target's logit.

Weights arrive as `(layer, part, array)` (`aioprefill.hf.weights.iter_weights`); `take`
slices each as it streams in, and `wants` drops the experts another rank holds.

Expert parallelism (`ep` ranks, one per replica): rank r keeps experts
`[r*E/ep, (r+1)*E/ep)` and everything else whole; `paddle.moe` exchanges the tokens.

A single rank (no group) keeps everything and `reduce` is the identity. Only worker processes
and model-level tests import this module (it imports paddle).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import paddle

from aioprefill.models import PaddleModel
from aioprefill.parallel import ParallelMode
from aioprefill.workers.collectives import PaddleGroup
from aioprefill.workers.kv_writer import ALONE, KVShare
from aioprefill.workers.paddle.logits import HeadRows, join
from aioprefill.workers.runner import ForwardBatch

__all__ = ["Shard", "idle_batch"]

# Parts (`aioprefill.hf.tensors`) that tensor parallelism splits, by the axis of their HF
# [out, in] matrix (biases: their only axis): the output rows, or the input columns.
_COLUMN_PARALLEL = {"q", "k", "v", "gate", "up", "q_bias", "k_bias", "v_bias", "lm_head"}
_ROW_PARALLEL = {"o", "down"}


def _axis(part: str) -> int | None:
    if part.startswith("expert."):
        return 1 if part.endswith(".w2") else 0
    if part in _COLUMN_PARALLEL:
        return 0
    return 1 if part in _ROW_PARALLEL else None


def _part(a: np.ndarray, axis: int, rank: int, size: int) -> np.ndarray:
    step = a.shape[axis] // size
    index = [slice(None)] * a.ndim
    index[axis] = slice(rank * step, (rank + 1) * step)
    return np.ascontiguousarray(a[tuple(index)])


class Shard:
    """Rank `rank` of a group of `size` running `spec` in `mode` (`ParallelInfo.mode`)."""

    def __init__(
        self, spec: PaddleModel, group: PaddleGroup | None = None, mode: ParallelMode = "none"
    ) -> None:
        self.spec = spec
        self.group = group
        self.tp_size = group.size if group is not None and mode == "tp" else 1
        self.ep_size = group.size if group is not None and mode == "ep" else 1
        self.rank = group.rank if group is not None else 0
        self.heads = spec.num_heads // self.tp_size
        self.kv_heads = spec.num_kv_heads // self.tp_size
        self.vocab_start = self.rank * spec.vocab_size // self.tp_size if self.tp_size > 1 else 0

    def local_experts(self) -> range:
        per = self.spec.num_experts // self.ep_size
        first = self.rank * per if self.ep_size > 1 else 0
        return range(first, first + per)

    def wants(self, part: str) -> bool:
        """Whether this rank keeps `part` at all (not another EP rank's expert)."""
        return not part.startswith("expert.") or int(part.split(".")[1]) in self.local_experts()

    def take(self, part: str, w: np.ndarray) -> np.ndarray:
        """This rank's slice of one of the full model's tensors (all of it alone or under EP)."""
        axis = _axis(part) if self.tp_size > 1 else None
        return w if axis is None else _part(w, axis, self.rank, self.tp_size)

    def vocab_rows(self, embed: paddle.Tensor) -> paddle.Tensor:
        """A tied LM head: this rank's vocabulary slice of the (whole) embedding."""
        if self.tp_size == 1:
            return embed
        step = self.spec.vocab_size // self.tp_size
        return embed[self.vocab_start : self.vocab_start + step]

    def in_step(
        self,
        batch: ForwardBatch,
        check: Callable[[ForwardBatch], None],
        run: Callable[[ForwardBatch], object],
    ) -> bool:
        """An expert-parallel rank takes part in every step's collectives, even with no work
        (an empty batch) or with a batch `check` refuses (ValueError, re-raised after): then it
        `run`s one padding token. True: the batch is good, run it."""
        try:
            if batch.size:
                check(batch)
                return True
        except ValueError:
            with paddle.no_grad():
                run(idle_batch())
            raise
        with paddle.no_grad():
            run(idle_batch())
        return False

    def kv_share(self) -> KVShare:
        """The KV heads of an export this rank writes, and how the TP ranks agree that rank 0
        made the segments: one all_reduce of one number (each rank's KV heads are its own
        under EP, and all of them alone)."""
        if self.tp_size == 1:
            return ALONE
        return KVShare(self.rank, self.tp_size, self._rank0_ok)

    def _rank0_ok(self, ok: bool) -> bool:
        assert self.group is not None
        # Only rank 0's word counts: the others add 0, so the sum is 1 exactly when it failed.
        flag = paddle.to_tensor([0.0 if ok or self.rank else 1.0], dtype="float32")
        return float(self.group.all_reduce(flag).numpy()[0]) == 0.0

    def reduce(self, x: paddle.Tensor) -> paddle.Tensor:
        """Sum a row-parallel product's partial results over the TP ranks (identity alone)."""
        if self.tp_size == 1:
            return x
        assert self.group is not None
        return self.group.all_reduce(x)

    def head_rows(self, mine: HeadRows) -> HeadRows:
        """The head's per-row results over the whole vocabulary from this rank's, over its slice
        (`paddle.logits.head_rows` with v0 = `vocab_start`: ids global, -inf for a target outside
        the slice): one all_gather of every rank's candidates, joined as the slices of one row
        are (`paddle.logits.join`)."""
        assert self.group is not None
        k = mine.top_vals.shape[1]
        picked = np.zeros(len(mine.ids)) if mine.picked is None else mine.picked
        m = 1 if picked.ndim == 1 else picked.shape[1]  # targets per row (label token ids)
        columns = [mine.ids, mine.best, mine.lse, picked]
        packed = np.column_stack([*columns, mine.top_vals, mine.top_ids]).astype(np.float64)
        every = self.group.all_gather(paddle.to_tensor(packed)).numpy()  # [tp, rows, 3+m+2k]
        return join(
            [
                HeadRows(
                    r[:, 0].astype(np.int64),
                    r[:, 1],
                    r[:, 2],
                    r[:, 3 + m : 3 + m + k].astype(np.float32),
                    r[:, 3 + m + k :].astype(np.int32),
                    None if mine.picked is None else r[:, 3 : 3 + m].reshape(picked.shape),
                )
                for r in every
            ]
        )


def idle_batch() -> ForwardBatch:
    """What an EP rank without work runs to keep its peers' collectives going: one padding
    token (id 0 at position 0) whose result is thrown away."""
    return ForwardBatch(
        request_ids=np.array([-1], dtype=np.int64),
        offsets=np.array([0, 1], dtype=np.int32),
        tokens=np.zeros(1, dtype=np.int32),
        start_pos=np.zeros(1, dtype=np.int32),
        is_last=np.array([True]),
    )
