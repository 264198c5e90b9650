"""The benchmark's entry point: parse flags, run, and report what was measured, even after
Ctrl-C or a failure (exit 130 or 1 then; 2 for bad arguments)."""

from __future__ import annotations

import asyncio
import sys
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from aioprefill import AioprefillError
from aioprefill.bench.cli import parse_options
from aioprefill.bench.interrupt import Interrupt
from aioprefill.bench.options import Options
from aioprefill.bench.progress import Progress
from aioprefill.bench.report import build_report, write_json
from aioprefill.bench.runner import Runner
from aioprefill.bench.table import format_report

__all__ = ["main", "run"]


def _header(opts: Options) -> str:
    if opts.trace is not None:
        load = (
            f"trace {opts.trace_path} ({len(opts.trace)} requests over {opts.trace.span_s:.1f} s)"
        )
    else:
        load = f"prompts {opts.lengths}"
    rates = ",".join(r.label for r in opts.rates) if opts.rates else "trace pace"
    dur = f"{opts.duration_s:g} s per point" if opts.duration_s else "whole trace"
    return (
        f"aioprefill.bench: model {opts.model_label}; policies {','.join(opts.policies)}; "
        f"rates {rates} (burstiness {opts.burstiness:g}); {dur}; {load}; "
        f"{opts.num_workers} worker(s){_parallel(opts)}; seed {opts.seed}"
    )


def _parallel(opts: Options) -> str:
    if opts.expert_parallel:
        return " in one expert-parallel group"
    return f" x {opts.tp_size} tensor-parallel ranks" if opts.tp_size > 1 else ""


async def run(opts: Options, progress: Progress) -> tuple[Runner, dict[str, Any]]:
    """Run the benchmark; never raises for an engine failure (it is recorded in the result)."""
    info: dict[str, Any] = {"started_at": datetime.now(UTC).isoformat(timespec="seconds")}
    t0 = time.monotonic()
    interrupt = Interrupt(progress)
    interrupt.install()
    runner = Runner(opts, progress, interrupt)
    try:
        await runner.run()
        info["error"] = None
    except AioprefillError as exc:
        info["error"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:
        traceback.print_exc()
        info["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        interrupt.uninstall()
    info["interrupted"] = interrupt.stop.is_set()
    info["wall_s"] = time.monotonic() - t0
    return runner, info


def main(argv: list[str] | None = None) -> int:
    opts = parse_options(argv)
    print(_header(opts), flush=True)
    progress = Progress(opts.progress)
    factory: Callable[[], asyncio.AbstractEventLoop] = asyncio.new_event_loop
    if opts.loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as loop_runner:
        runner, info = loop_runner.run(run(opts, progress))
    doc = build_report(opts, runner, run=info)
    print(format_report(doc), flush=True)
    if opts.json_path is not None:
        write_json(doc, opts.json_path)
        print(f"wrote {opts.json_path}")
    if opts.plot_path is not None and doc["points"]:
        from aioprefill.bench.plot import write_plot

        write_plot(doc, opts.plot_path)
        print(f"wrote {opts.plot_path}")
    if info["error"]:
        print(f"aioprefill.bench: error: {info['error']}", file=sys.stderr)
        return 1
    return 130 if info["interrupted"] else 0
