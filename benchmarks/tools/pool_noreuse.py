"""Pool the no-reuse comparison (cache on vs off) of several `python -m aioprefill.bench
--prefix-cache default,off --json FILE` runs: per point, the bubble as the gap-weighted mean,
the median of the runs' means, the median and mean of the runs' p50s, and requests/s, on / off.
A run's mean bubble is ruled by its few multi-ms gaps (the host's scheduling), its p50 is not.

    python benchmarks/tools/pool_noreuse.py run1.json run2.json ...
"""

from __future__ import annotations

import json
import statistics as st
import sys


def main(paths: list[str]) -> None:
    points: dict[str, dict[str, list[dict]]] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for p in data["points"]:
            arm = "on" if (p.get("prefix") or {}).get("capacity_blocks") else "off"
            points.setdefault(p["label"].split()[0], {}).setdefault(arm, []).append(p)
    for label, arms in points.items():
        on, off = arms.get("on", []), arms.get("off", [])
        if not on or not off:
            continue

        def runs(ps: list[dict], stat: str) -> list[float]:
            return [q["bubble_us"][stat] for q in ps]

        def weighted(ps: list[dict]) -> float:
            gaps = sum(q["bubble_us"]["count"] for q in ps)
            return sum(q["bubble_us"]["mean"] * q["bubble_us"]["count"] for q in ps) / gaps

        def rps(ps: list[dict]) -> float:
            return st.mean(q["throughput"]["requests_per_s"] for q in ps)

        p50_on, p50_off = st.median(runs(on, "p50")), st.median(runs(off, "p50"))
        means = st.median(runs(on, "mean")) / st.median(runs(off, "mean"))
        print(
            f"{label:5} runs {len(on)}+{len(off)}: bubble gap-weighted mean "
            f"{weighted(on):.0f}/{weighted(off):.0f} us = {weighted(on) / weighted(off):.3f}; "
            f"median of run means {means:.3f}; "
            f"median of run p50s {p50_on:.0f}/{p50_off:.0f} = {p50_on / p50_off:.3f}; "
            f"mean of run p50s {st.mean(runs(on, 'p50')) / st.mean(runs(off, 'p50')):.3f}; "
            f"req/s {rps(on) / rps(off):.4f}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
