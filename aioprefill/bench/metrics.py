"""Per-point figures from the `PrefillResult`s of one run: latency, batching, bubble, goodput.

All times come from the results' `time.monotonic_ns()` stamps (one clock across processes):
TTFT = finished - submitted, queue = forward_start - submitted. A batch is one
`(worker, batch_id)`. The bubble is the gap between consecutive forwards on one worker while a
request was already waiting (submitted before the earlier forward ended, started after it):
idle time the scheduler could have filled.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Batches", "Records", "distribution", "steady_throughput", "summarize"]

_NS_PER_MS = 1e6


def distribution(values: np.ndarray, scale: float = 1.0) -> dict[str, float | None]:
    """mean, p50, p90, p99, max of `values / scale` (all None when empty)."""
    if len(values) == 0:
        return dict.fromkeys(("mean", "p50", "p90", "p99", "max"))
    x = np.asarray(values, dtype=np.float64) / scale
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {
        "mean": float(x.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(x.max()),
    }


@dataclass(slots=True)
class Records:
    """What one run measured: one row per completed request, plus failures by error type."""

    scheduled_ns: np.ndarray  # int64: when the generator meant to submit it
    submitted_ns: np.ndarray
    forward_start_ns: np.ndarray
    forward_end_ns: np.ndarray
    finished_ns: np.ndarray
    worker: np.ndarray
    batch_id: np.ndarray
    batch_size: np.ndarray
    batch_tokens: np.ndarray
    prompt_len: np.ndarray
    cached_tokens: np.ndarray  # int64: prompt tokens read from the prefix cache
    n_submitted: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    @classmethod
    def from_results(
        cls,
        results: list[Any],
        scheduled_ns: list[int],
        prompt_len: list[int],
        *,
        n_submitted: int,
        errors: Counter[str] | None = None,
    ) -> Records:
        """Build from `PrefillResult`s and the matching schedule rows (same order)."""

        def col(name: str) -> np.ndarray:
            return np.fromiter(
                (getattr(r, name, 0) for r in results), dtype=np.int64, count=len(results)
            )

        return cls(
            scheduled_ns=np.asarray(scheduled_ns, dtype=np.int64),
            submitted_ns=col("submitted_ns"),
            forward_start_ns=col("forward_start_ns"),
            forward_end_ns=col("forward_end_ns"),
            finished_ns=col("finished_ns"),
            worker=col("worker"),
            batch_id=col("batch_id"),
            batch_size=col("batch_size"),
            batch_tokens=col("batch_tokens"),
            prompt_len=np.asarray(prompt_len, dtype=np.int64),
            cached_tokens=col("cached_tokens"),
            n_submitted=n_submitted,
            errors=errors if errors is not None else Counter(),
        )

    def __len__(self) -> int:
        return len(self.submitted_ns)


@dataclass(slots=True)
class Batches:
    """One row per forward seen in the records: `(worker, batch_id)` with its stamps."""

    worker: np.ndarray
    size: np.ndarray
    tokens: np.ndarray
    start_ns: np.ndarray
    end_ns: np.ndarray
    our_count: np.ndarray  # how many of this run's requests finished in it
    our_tokens: np.ndarray  # sum of their prompt lengths, less their cached tokens
    our_sq: np.ndarray  # sum of len^2 - cached^2 (the attention term of the cost model)

    @classmethod
    def from_records(cls, rec: Records) -> Batches:
        if len(rec) == 0:
            e = np.zeros(0, dtype=np.int64)
            return cls(e, e, e, e, e, e, e, e.astype(np.float64))
        key = rec.worker * (1 << 40) + rec.batch_id
        uniq, first, inv = np.unique(key, return_index=True, return_inverse=True)
        full, hit = rec.prompt_len.astype(np.float64), rec.cached_tokens.astype(np.float64)
        lens, sq = full - hit, full * full - hit * hit  # cached tokens are not computed
        return cls(
            worker=rec.worker[first],
            size=rec.batch_size[first],
            tokens=rec.batch_tokens[first],
            start_ns=rec.forward_start_ns[first],
            end_ns=rec.forward_end_ns[first],
            our_count=np.bincount(inv, minlength=len(uniq)).astype(np.int64),
            our_tokens=np.bincount(inv, weights=lens, minlength=len(uniq)).astype(np.int64),
            our_sq=np.bincount(inv, weights=sq, minlength=len(uniq)),
        )

    def __len__(self) -> int:
        return len(self.size)


def _bubbles_ns(rec: Records, b: Batches) -> np.ndarray:
    """Gaps between consecutive forwards on a worker while some request was waiting."""
    waiting_sub = np.sort(rec.submitted_ns)
    waiting_start = np.sort(rec.forward_start_ns)
    gaps: list[np.ndarray] = []
    for w in np.unique(b.worker):
        sel = np.flatnonzero(b.worker == w)
        order = sel[np.argsort(b.start_ns[sel], kind="stable")]
        ends, starts = b.end_ns[order][:-1], b.start_ns[order][1:]
        # requests waiting at the end of a forward: submitted <= end, not started by then
        waiting = np.searchsorted(waiting_sub, ends, "right") - np.searchsorted(
            waiting_start, ends, "right"
        )
        gaps.append(np.maximum(starts - ends, 0)[waiting > 0])
    return np.concatenate(gaps) if gaps else np.zeros(0, dtype=np.int64)


def steady_throughput(b: Batches, window_ns: tuple[int, int]) -> dict[str, float | None]:
    """Throughput of a saturation run from its forwards, free of start-up and drain.

    Per worker, over the forwards that end after `window_ns[0]` and start before
    `window_ns[1]` (when clients stopped): the requests of all but the first of them, over the
    time from the first one's end to the last one's end. Workers add up.
    """
    rps = tps = 0.0
    span = 0.0
    for w in np.unique(b.worker):
        sel = (b.worker == w) & (b.end_ns >= window_ns[0]) & (b.start_ns <= window_ns[1])
        idx = np.flatnonzero(sel)
        if len(idx) < 2:
            continue
        idx = idx[np.argsort(b.end_ns[idx], kind="stable")]
        dt = (b.end_ns[idx[-1]] - b.end_ns[idx[0]]) / 1e9
        if dt <= 0:
            continue
        rps += float(b.our_count[idx[1:]].sum() / dt)
        tps += float(b.our_tokens[idx[1:]].sum() / dt)
        span = max(span, dt)
    if span == 0:
        return {"window_s": 0.0, "requests_per_s": None, "tokens_per_s": None}
    return {"window_s": span, "requests_per_s": rps, "tokens_per_s": tps}


def summarize(
    rec: Records,
    *,
    slo_ttft_ms: float | None = None,
    steady_window_ns: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Every figure of one point as plain JSON types. Throughput spans first submission to last
    completion; a saturation run passes `steady_window_ns` (see `steady_throughput`)."""
    n = len(rec)
    ttft = rec.finished_ns - rec.submitted_ns
    out: dict[str, Any] = {
        "n_submitted": rec.n_submitted,
        "n_completed": n,
        "n_failed": int(sum(rec.errors.values())),
        "errors": dict(rec.errors),
        "ttft_ms": distribution(ttft, _NS_PER_MS),
        "queue_ms": distribution(rec.forward_start_ns - rec.submitted_ns, _NS_PER_MS),
        "forward_ms": distribution(rec.forward_end_ns - rec.forward_start_ns, _NS_PER_MS),
        "return_ms": distribution(rec.finished_ns - rec.forward_end_ns, _NS_PER_MS),
        "generator_lag_ms": distribution(rec.submitted_ns - rec.scheduled_ns, _NS_PER_MS),
    }
    span_s = (int(rec.finished_ns.max()) - int(rec.submitted_ns.min())) / 1e9 if n else 0.0
    b = Batches.from_records(rec)
    if steady_window_ns is not None:
        out["throughput"] = steady_throughput(b, steady_window_ns)
    else:
        out["throughput"] = {
            "window_s": span_s,
            "requests_per_s": n / span_s if span_s > 0 else None,
            "tokens_per_s": float(rec.prompt_len.sum() / span_s) if span_s > 0 else None,
        }
    hist = Counter(int(s) for s in b.size)
    out["batches"] = len(b)
    out["batch_size"] = {
        **distribution(b.size),
        "mean_per_request": float(rec.batch_size.mean()) if n else None,
        "hist": {str(k): hist[k] for k in sorted(hist)},
    }
    out["batch_tokens"] = distribution(b.tokens)
    bubbles = _bubbles_ns(rec, b)
    busy_span = float(b.end_ns.max() - b.start_ns.min()) if len(b) else 0.0
    out["bubble_us"] = {
        "count": len(bubbles),
        **distribution(bubbles, 1e3),
        "total_ms": float(bubbles.sum() / _NS_PER_MS),
        "fraction": float(bubbles.sum() / busy_span) if busy_span > 0 else None,
    }
    busy = float((b.end_ns - b.start_ns).sum())
    n_workers = len(np.unique(b.worker)) if len(b) else 0
    out["utilization"] = busy / (busy_span * n_workers) if busy_span > 0 and n_workers else None
    if slo_ttft_ms is not None:
        met = ttft <= slo_ttft_ms * _NS_PER_MS
        out["goodput"] = {
            "slo_ttft_ms": slo_ttft_ms,
            "requests_per_s": float(met.sum() / span_s) if span_s > 0 else None,
            "fraction": float(met.sum() / rec.n_submitted) if rec.n_submitted else None,
        }
    else:
        out["goodput"] = None
    return out
