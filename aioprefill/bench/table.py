"""The terminal report: one row per point (policies side by side at each rate), then notes on
capacity, the cost model and the targets."""

from __future__ import annotations

from typing import Any

import numpy as np

from aioprefill.bench.cachereport import format_prefix

__all__ = ["format_report"]


def _arm(p: dict[str, Any], doc: dict[str, Any]) -> str:
    """The policy, with its cache budget when the run compares several."""
    several = len((doc["config"].get("prefix_cache") or {}).get("budgets", ())) > 1
    return f"{p['policy']}/{p['cache']}" if several else p["policy"]


def _f(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and not np.isfinite(x)) else format(x, spec)


_COLUMNS = (
    "point",
    "policy",
    "offered/s",
    "done/s",
    "TTFT mean",
    "p50",
    "p90",
    "p99",
    "queue p50",
    "batch mean",
    "max",
    "tok/batch",
    "bubble us",
    "util",
    "goodput",
)


def format_report(doc: dict[str, Any]) -> str:
    rows = []
    for p in doc["points"]:
        ttft, bs, bub, gp = p["ttft_ms"], p["batch_size"], p["bubble_us"], p["goodput"]
        point = f"sat c={p['concurrency']}" if p["kind"] == "saturation" else p["label"]
        rows.append(
            (
                point + ("*" if p["partial"] else ""),
                _arm(p, doc),
                _f(p["offered_rps"]),
                _f(p["throughput"]["requests_per_s"]),
                _f(ttft["mean"], ".2f"),
                _f(ttft["p50"], ".2f"),
                _f(ttft["p90"], ".2f"),
                _f(ttft["p99"], ".2f"),
                _f(p["queue_ms"]["p50"], ".2f"),
                _f(bs["mean"], ".2f"),
                _f(bs["max"], ".0f"),
                _f(p["batch_tokens"]["mean"], ".0f"),
                _f(bub["mean"], ".0f"),
                _f(p["utilization"], ".2f"),
                f"{100 * gp['fraction']:.0f}%" if gp and gp["fraction"] is not None else "-",
            )
        )
    widths = [
        max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(_COLUMNS)
    ]
    lines = [
        "  ".join(
            c.rjust(w) if i > 1 else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [_COLUMNS, *rows]
    ]
    cfg, cap, best = doc["config"], doc["capacity"], doc["model_best"]
    notes = [
        "TTFT and queue in ms; batch = requests per forward; "
        "bubble = mean idle gap between forwards "
        "while work waited; util = forward time / span."
    ]
    if cfg["slo_ttft_ms"]:
        notes.append(
            f"goodput = share of requests with TTFT <= {cfg['slo_ttft_ms']:g} ms "
            f"({cfg['slo_source']})."
        )
    if cap["requests_per_s"]:
        notes.append(
            f"eager capacity {cap['requests_per_s']:.1f} requests/s "
            f"(mean forward {_f(cap['forward_ms_mean'], '.2f')} ms); "
            "rates like 0.8x are fractions of it."
        )
    notes.append(
        f"model best: {best['requests_per_s']:.1f} requests/s in full batches of "
        f"{best['mean_batch_size']:.1f} "
        f"({best['source']}), {best['single_requests_per_s']:.1f}/s one at a time."
    )
    if doc["cost_model"]:
        c = doc["cost_model"]
        notes.append(
            f"cost model fitted to this run: {c['fixed_ms']:.2f} ms + "
            f"{c['per_token_us']:.1f} us/tok + "
            f"{c['attn_ns']:.1f} ns*len^2 (r2 {c['r2']:.3f}, {c['n_batches']} forwards)."
        )
    if any(p["partial"] for p in doc["points"]):
        notes.append("* partial: interrupted or not drained in time.")
    for t in doc["targets"]:
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        notes.append(f"target {verdict}: {t['name']}: {t['value']:.2f} ({t['detail']})")
    return "\n".join([*lines, "", *_ideal_table(doc), *format_prefix(doc), *notes])


def _ideal_table(doc: dict[str, Any]) -> list[str]:
    """Per rate: the zero-overhead engine's TTFT and each policy's efficiency against it."""
    rates: dict[str, dict[str, Any]] = {}
    for p in doc["points"]:
        if p.get("ideal"):
            rates.setdefault(p["label"], {}).setdefault(_arm(p, doc), p)
    if not rates:
        return []
    arms = [_arm(p, doc) for p in doc["points"] if p.get("ideal")]
    policies = list(dict.fromkeys(arms))
    head = ["point", "ideal mean", "p99", "1-at-a-time mean", "p99", "batching buys"]
    head += [f"{pol} eff" for pol in policies]
    rows = []
    for label, by_policy in rates.items():
        ref = by_policy.get("forward") or next(iter(by_policy.values()))
        ideal, single = ref["ideal"]["ttft_ms"], ref["ideal"]["single_ttft_ms"]
        row = [
            label,
            _f(ideal["mean"], ".2f"),
            _f(ideal["p99"], ".2f"),
            _f(single["mean"], ".2f"),
            _f(single["p99"], ".2f"),
            f"{single['mean'] / ideal['mean']:.2f}x" if ideal["mean"] else "-",
        ]
        for pol in policies:
            eff = by_policy[pol]["ideal"]["efficiency"] if pol in by_policy else None
            row.append(f"{_f(eff['mean'], '.2f')} / {_f(eff['p99'], '.2f')}" if eff else "-")
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [head, *rows]
    ]
    src = doc["model_best"]
    return [
        "The same arrivals through a zero-overhead engine (cost model: "
        f"{src['source']}): TTFT in ms with batching (every free worker takes all that waits) "
        "and one request per forward; 'batching buys' = their mean ratio; eff = ideal / measured "
        "TTFT (mean / p99), 1.00 = no overhead at all.",
        *lines,
        "",
    ]
