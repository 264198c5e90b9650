"""`--plot`: TTFT p50/p99 against request rate per policy, and batch-size distributions.

matplotlib is imported here, only when a plot is asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["write_plot"]

_COLORS = {"forward": "tab:blue", "eager": "tab:red", "timeout": "tab:green"}


def write_plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    rate_points = [p for p in doc["points"] if p["kind"] == "rate" and p["n_completed"]]
    policies = list(dict.fromkeys(p["policy"] for p in doc["points"]))
    fig, (ax_t, ax_b, ax_h) = plt.subplots(1, 3, figsize=(16, 4.8))
    model = doc["config"]["model"]["label"]
    fig.suptitle(
        f"aioprefill.bench: {model}, {doc['config']['num_workers']} worker(s), "
        f"seed {doc['run']['seed']}"
    )

    for pol in policies:
        pts = sorted((p for p in rate_points if p["policy"] == pol), key=lambda p: p["offered_rps"])
        if not pts:
            continue
        x = [p["offered_rps"] for p in pts]
        c = _COLORS.get(pol)
        ax_t.plot(x, [p["ttft_ms"]["p50"] for p in pts], "o--", color=c, label=f"{pol} p50")
        ax_t.plot(x, [p["ttft_ms"]["p99"] for p in pts], "s-", color=c, label=f"{pol} p99")
        ax_b.plot(x, [p["batch_size"]["mean"] for p in pts], "o-", color=c, label=pol)
    cap = doc["capacity"]["requests_per_s"]
    for ax in (ax_t, ax_b):
        if cap:
            ax.axvline(cap, color="gray", lw=0.8, ls=":", label="eager capacity")
        ax.set_xlabel("offered load (requests/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax_t.yaxis.set_major_formatter(ScalarFormatter())
    ax_t.yaxis.set_minor_formatter(NullFormatter())
    ax_t.set_ylabel("TTFT (ms, log)")
    ax_t.set_title("TTFT against request rate")
    ax_b.set_ylabel("requests per forward (mean)")
    ax_b.set_title("batch size against request rate")

    # batch-size distribution at the highest common rate: share of requests per batch size
    top = max(rate_points, key=lambda p: p["offered_rps"])["label"] if rate_points else None
    if top is not None:
        width = 0.8 / max(1, len(policies))
        for k, pol in enumerate(policies):
            p = next((q for q in rate_points if q["policy"] == pol and q["label"] == top), None)
            if p is None:
                continue
            hist = {int(s): n for s, n in p["batch_size"]["hist"].items()}
            total = sum(s * n for s, n in hist.items()) or 1
            sizes = sorted(hist)
            ax_h.bar(
                [s + (k - (len(policies) - 1) / 2) * width for s in sizes],
                [s * hist[s] / total for s in sizes],
                width=width,
                color=_COLORS.get(pol),
                label=pol,
            )
        ax_h.set_title(f"batch sizes at {top}")
        ax_h.set_xlabel("requests in the forward")
        ax_h.set_ylabel("share of requests")
        ax_h.legend(fontsize=8)
        ax_h.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
