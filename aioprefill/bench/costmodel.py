"""The forward cost model `a + b*tokens + c*sum(len^2)`: fitted from a run's forwards, and the
best throughput a model can reach with full batches (the yardstick for saturation runs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aioprefill.bench.metrics import Batches

__all__ = ["CostModel", "best_throughput", "fit_cost_model"]


@dataclass(frozen=True, slots=True)
class CostModel:
    fixed_ms: float
    per_token_us: float
    attn_ns: float

    def seconds(self, tokens: float, sum_sq: float) -> float:
        return (
            self.fixed_ms * 1e-3 + self.per_token_us * 1e-6 * tokens + self.attn_ns * 1e-9 * sum_sq
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "fixed_ms": self.fixed_ms,
            "per_token_us": self.per_token_us,
            "attn_ns": self.attn_ns,
        }


def fit_cost_model(batches: list[Batches]) -> dict[str, float | int] | None:
    """Least-squares fit (of relative error) of forward time over the forwards whose members
    are all known.

    Returns the coefficients plus `r2` and `n_batches`, or None with too few or degenerate
    points. Only forwards made entirely of this run's whole prompts are used (a chunked or
    foreign request would make `sum(len^2)` unknown). With a single prompt length `sum(len^2)`
    is proportional to the token count, and only `a + b*tokens` is fitted.
    """
    rows = [b for b in batches if len(b)]
    if not rows:
        return None
    tokens = np.concatenate([b.tokens for b in rows]).astype(np.float64)
    our = np.concatenate([b.our_tokens for b in rows]).astype(np.float64)
    sq = np.concatenate([b.our_sq for b in rows])
    y = np.concatenate([(b.end_ns - b.start_ns) for b in rows]).astype(np.float64) / 1e9
    keep = tokens == our
    tokens, sq, y = tokens[keep], sq[keep], y[keep]
    if len(y) < 8:
        return None
    x = np.column_stack([np.ones_like(tokens), tokens, sq])
    if np.linalg.matrix_rank(x / np.maximum(np.abs(x).max(axis=0), 1e-30)) < 3:
        x = x[:, :2]
    # Relative error, not absolute: forwards span ~100x in length, and an unweighted fit lets
    # the saturation run's big batches set the intercept (a one-request forward's cost) by
    # their noise alone; the ideal-engine replay and eager's ideal lean on exactly that.
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    resid = y - x @ coef
    ss = float(((y - y.mean()) ** 2).sum())
    return {
        "fixed_ms": float(coef[0] * 1e3),
        "per_token_us": float(coef[1] * 1e6),
        "attn_ns": float(coef[2] * 1e9) if len(coef) > 2 else 0.0,
        "r2": 1.0 - float((resid**2).sum()) / ss if ss > 0 else 1.0,
        "n_batches": len(y),
        "min_tokens": int(tokens.min()),
        "max_tokens": int(tokens.max()),
    }


def best_throughput(
    model: CostModel, lengths: np.ndarray, *, max_batch_tokens: int, max_batch_size: int
) -> dict[str, float]:
    """Requests/s and tokens/s when `lengths` run back to back in full batches (packed in order
    under the budgets), and when they run one per forward (eager's ideal)."""
    if len(lengths) == 0:
        return {
            "requests_per_s": 0.0,
            "tokens_per_s": 0.0,
            "single_requests_per_s": 0.0,
            "mean_batch_size": 0.0,
        }
    total = batched = 0.0
    n_batches = 0
    tok = sq = size = 0
    for n in (int(x) for x in lengths):
        total += model.seconds(n, n * n)
        if size and (size + 1 > max_batch_size or tok + n > max_batch_tokens):
            batched += model.seconds(tok, sq)
            n_batches += 1
            tok = sq = size = 0
        tok, sq, size = tok + n, sq + n * n, size + 1
    batched += model.seconds(tok, sq)
    n_batches += 1
    return {
        "requests_per_s": len(lengths) / batched,
        "tokens_per_s": float(lengths.sum()) / batched,
        "single_requests_per_s": len(lengths) / total,
        "mean_batch_size": len(lengths) / n_batches,
    }
