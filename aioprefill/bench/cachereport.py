"""The prefix cache in the report: each point's hit ratio next to the trace's ceilings, the
tokens it computed, the targets of issue 22, and their terminal lines.

A point's `prefix`: `cache` (the budget's label), `bytes_per_worker`, `capacity_blocks` (per
worker), `prompt_tokens`, `cached_tokens`, `computed_tokens`, `hit_ratio` (cached / prompt
tokens of the completed requests) and, for a replayed trace with hash ids, `ceilings`
(`prefix.ceilings` with the same budget in the same blocks, over all workers).
"""

from __future__ import annotations

from typing import Any

from aioprefill.bench.options import Options
from aioprefill.bench.prefix import ceilings
from aioprefill.bench.runner import Point

__all__ = ["format_prefix", "prefix_point", "prefix_targets"]

NO_EVICTION_SHARE = 0.98  # a budget that holds everything: hit ratio vs the no-eviction ceiling
LRU_SHARE = 0.95  # a smaller budget: vs the offline LRU ceiling
DP_SHARE = 0.9  # several workers: vs one cache of the same total budget
NO_REUSE_TOLERANCE = 0.03  # no reuse: req/s and bubble of cache on within this of cache off

_ceiling_memo: dict[tuple[int, int | None, int, int], dict[str, Any]] = {}


def prefix_point(p: Point, opts: Options) -> dict[str, Any]:
    rec = p.records
    prompt, cached = int(rec.prompt_len.sum()), int(rec.cached_tokens.sum())
    # the engine's own count of slots (over all workers), else the budget over the block size
    stats = p.engine_stats if isinstance(p.engine_stats, dict) else {}
    total = (stats.get("prefix_cache") or {}).get("capacity_blocks") or None
    if total is None and p.cache_bytes is not None and opts.block_bytes:
        total = p.cache_bytes // opts.block_bytes * opts.num_workers
    if p.cache_bytes == 0:
        total = 0
    out: dict[str, Any] = {
        "cache": p.cache,
        "bytes_per_worker": p.cache_bytes,
        "capacity_blocks": None if total is None else total // opts.num_workers,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "hit_ratio": cached / prompt if prompt else None,
        "ceilings": None,
    }
    sched = p.schedule
    if sched is not None and sched.hash_ids is not None and total != 0:
        key = (id(sched), total, opts.prefix_block_tokens, opts.num_workers)
        if key not in _ceiling_memo:
            _ceiling_memo[key] = ceilings(
                sched, opts.prefix_block_tokens, total, workers=opts.num_workers
            )
        out["ceilings"] = _ceiling_memo[key]
    return out


def _target(name: str, value: float, limit: float, met: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "value": value, "limit": limit, "met": met, "detail": detail}


def prefix_targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 22's bench targets where this run has the points to check them."""
    out: list[dict[str, Any]] = []
    rate_points = [p for p in doc["points"] if p["kind"] == "rate" and p.get("prefix")]
    for p in rate_points:
        pre, c = p["prefix"], p["prefix"]["ceilings"]
        if c is None or c["capacity_blocks"] is None or pre["hit_ratio"] is None:
            continue  # no trace with hash ids, or a budget whose size in blocks is unknown
        where = f"{p['label']} {p['policy']}/{pre['cache']}"
        hit = pre["hit_ratio"]
        if c["workers"] > 1:  # one cache of the whole budget: what one worker would reach
            ref, share, what = c["lru"], DP_SHARE, "one offline LRU cache of the same total"
        elif c["capacity_blocks"] >= c["distinct_blocks"]:
            ref, share, what = c["no_eviction"], NO_EVICTION_SHARE, "the no-eviction ceiling"
        else:
            ref, share, what = c["lru"], LRU_SHARE, "the offline LRU ceiling"
        if ref:
            out.append(
                _target(
                    f"{where}: hit ratio >= {share:g} x {what}",
                    hit / ref,
                    share,
                    hit / ref >= share,
                    f"{hit:.3f} vs {ref:.3f}"
                    + (
                        f"; offline dispatch by prefix affinity: {c['affinity']:.3f}"
                        if c.get("affinity") is not None
                        else ""
                    ),
                )
            )
        if c.get("round_robin") is not None:
            rr = c["round_robin"]
            out.append(
                _target(
                    f"{where}: hit ratio above round-robin dispatch's (offline)",
                    hit / rr if rr else float("inf"),
                    1.0,
                    hit > rr,
                    f"{hit:.3f} vs {rr:.3f}",
                )
            )
    out += _on_vs_off([p for p in doc["points"] if p.get("prefix")])
    return out


def _on_vs_off(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each budget against cache off on the same arrivals: with reuse, lower TTFT; without
    (random prompts: no hash ids, or a saturation run), req/s and the bubble within 3%
    (averaged over the repeats of a point: ABBA)."""
    out: list[dict[str, Any]] = []
    off = [p for p in points if p["prefix"]["cache"] == "off"]
    for p in points:
        cache = p["prefix"]["cache"]
        mates = [q for q in off if q["label"] == p["label"] and q["policy"] == p["policy"]]
        if cache == "off" or not mates:
            continue
        where = f"{p['label']} {p['policy']}/{cache} vs off"
        if p["prefix"]["ceilings"] is not None:
            q = next((q for q in mates if q.get("index") == p.get("index")), mates[0])
            for key in ("mean", "p99"):
                on_ms, off_ms = p["ttft_ms"][key], q["ttft_ms"][key]
                if on_ms is not None and off_ms:
                    out.append(
                        _target(
                            f"{where}: TTFT {key} lower",
                            on_ms / off_ms,
                            1.0,
                            on_ms < off_ms,
                            f"{on_ms:.1f} vs {off_ms:.1f} ms",
                        )
                    )
            continue
        if any(t["name"].startswith(f"{p['label']} {p['policy']}/{cache} vs off: ") for t in out):
            continue  # an ABBA repeat: counted once, over every repeat
        ons = [q for q in points if q["label"] == p["label"] and q["policy"] == p["policy"]]
        ons = [q for q in ons if q["prefix"]["cache"] == cache]
        for name, get in (
            ("req/s", lambda q: q["throughput"]["requests_per_s"]),
            ("bubble mean", lambda q: q["bubble_us"]["mean"]),
        ):
            a, b = [get(q) for q in ons], [get(q) for q in mates]
            if None in a or None in b or not sum(b):
                continue
            ratio = sum(a) / len(a) / (sum(b) / len(b))
            out.append(
                _target(
                    f"{where}: {name} within {NO_REUSE_TOLERANCE:.0%} (no reuse, "
                    f"{len(a)}+{len(b)} runs)",
                    ratio,
                    NO_REUSE_TOLERANCE,
                    ratio >= 1 - NO_REUSE_TOLERANCE
                    if name == "req/s"
                    else ratio <= 1 + NO_REUSE_TOLERANCE,
                    f"{sum(a) / len(a):.1f} vs {sum(b) / len(b):.1f}",
                )
            )
    return out


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_prefix(doc: dict[str, Any]) -> list[str]:
    """One row per rate point that used or could use the cache: hit ratio and ceilings."""
    rows = [p for p in doc["points"] if p["kind"] == "rate" and p.get("prefix")]
    arms = {p["prefix"]["cache"] for p in rows}
    if not rows or (len(arms) < 2 and not any(p["prefix"]["cached_tokens"] for p in rows)):
        return []
    head = ["point", "arm", "blocks/worker", "hit", "no-evict", "LRU", "round-robin", "affinity"]
    head += ["computed"]
    head += ["TTFT mean", "p99"]
    off = {  # points of one rate index ran one schedule
        (p["label"], p["policy"], p.get("index")): p["prefix"]["computed_tokens"]
        for p in rows
        if p["prefix"]["cache"] == "off"
    }
    table = []
    for p in rows:
        pre, c = p["prefix"], p["prefix"]["ceilings"] or {}
        base = off.get((p["label"], p["policy"], p.get("index")))
        computed = f"{pre['computed_tokens']}"
        if base:
            computed += f" ({pre['computed_tokens'] / base:.2f}x)"
        table.append(
            [
                p["label"],
                f"{p['policy']}/{pre['cache']}",
                _f(pre["capacity_blocks"], "d"),
                _f(pre["hit_ratio"], ".3f"),
                _f(c.get("no_eviction"), ".3f"),
                _f(c.get("lru"), ".3f"),
                _f(c.get("round_robin"), ".3f"),
                _f(c.get("affinity"), ".3f"),
                computed,
                _f(p["ttft_ms"]["mean"], ".1f"),
                _f(p["ttft_ms"]["p99"], ".1f"),
            ]
        )
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(head)]
    lines = [
        "  ".join(
            c.rjust(w) if i > 1 else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [head, *table]
    ]
    distinct = next((p["prefix"]["ceilings"] for p in rows if p["prefix"]["ceilings"]), None)
    note = (
        "Prefix cache: hit = cached / prompt tokens; the ceilings replay the same requests "
        "offline in the same blocks: no eviction, LRU with the same total budget in one cache, "
        "and that budget split over the workers with requests dealt round-robin or sent where "
        "most of their prompt is cached (affinity, ties to the least loaded); computed = "
        "prompt tokens not read from the cache (x cache off's)."
    )
    if distinct:
        note += (
            f" The trace holds {distinct['distinct_blocks']} distinct blocks of "
            f"{distinct['block_tokens']} tokens."
        )
    return [note, *lines, ""]
