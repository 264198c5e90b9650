"""Command-line parsing for `python -m aioprefill.bench`: flags in, a validated `Options` out.

Every bad argument ends the program with one line naming the flag, and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from aioprefill.bench import argtypes
from aioprefill.bench.argtypes import EP_POLICIES, POLICIES, Parser, number
from aioprefill.bench.options import Options
from aioprefill.bench.prefix import distinct_blocks
from aioprefill.bench.presets import (
    DEFAULT_PRESET,
    SIM_PRESETS,
    build_model,
    cache_block_bytes,
    model_label,
)
from aioprefill.bench.traces import TRACE_FORMATS, TraceError, read_trace, shape_trace
from aioprefill.errors import InvalidConfig

__all__ = [
    "DEFAULT_DURATION_S",
    "DEFAULT_MODEL",
    "DEFAULT_PROMPT_LEN",
    "DEFAULT_RATES",
    "POLICIES",
    "build_parser",
    "parse_options",
]

# The default run: what `python3 dev.py bench` shows in about two minutes on 2 CPU cores.
DEFAULT_MODEL = "paddle"
DEFAULT_RATES = "0.5x,0.8x,0.95x,1.2x"
DEFAULT_DURATION_S = 6.0
DEFAULT_PROMPT_LEN = "lognormal:64:0.5"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m aioprefill.bench",
        description="Open-loop prefill benchmark: batching policies side by side on one "
        "arrival schedule.",
        epilog="Rates like 0.8x are fractions of eager's capacity, measured by a saturation "
        "run first.",
    )
    pos, non_neg, pos_int = (
        number(0, allow_lo=False),
        number(0, allow_lo=True),
        number(1, allow_lo=True, kind=int),
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        metavar="{paddle,sim,PATH}",
        help="paddle: the tiny PaddleModel(seed=0) on this machine; sim: a cost model; PATH: a "
        "Hugging Face checkpoint directory or a .gguf file (PaddleModel.from_pretrained; prompts "
        "drawn from its vocabulary) (default: %(default)s)",
    )
    g.add_argument(
        "--sim-preset",
        choices=tuple(SIM_PRESETS),
        default=None,
        help=f"cost-model preset for --model sim (default: {DEFAULT_PRESET})",
    )
    g.add_argument(
        "--sim-fixed-ms", type=non_neg, help="override the preset's fixed cost per forward (ms)"
    )
    g.add_argument(
        "--sim-per-token-us", type=non_neg, help="override the preset's cost per token (us)"
    )
    g.add_argument("--sim-attn-ns", type=non_neg, help="override the preset's cost per len^2 (ns)")
    g = p.add_argument_group("engine")
    g.add_argument(
        "--policy",
        type=argtypes.policies,
        default=None,
        help=f"comma-separated policies to compare (default: {','.join(POLICIES)}; "
        f"with --ep: {','.join(EP_POLICIES)})",
    )
    g.add_argument("--workers", type=pos_int, default=1, help="num_workers (default: %(default)s)")
    g.add_argument(
        "--tp", type=pos_int, default=1, help="tensor-parallel ranks per worker (default: 1)"
    )
    g.add_argument(
        "--ep",
        action="store_true",
        help="the workers form one expert-parallel group stepping in lockstep",
    )
    g.add_argument("--max-batch-tokens", type=pos_int, default=8192, help="(default: %(default)s)")
    g.add_argument(
        "--prefix-cache",
        type=argtypes.cache_budgets,
        default=None,
        metavar="LIST",
        help="prefix-cache budgets to compare, one engine each: default (the engine's), off, "
        "a size per worker (256MiB), or a share of the trace's distinct blocks over all "
        "workers (10%%, all) (default: default; with a trace of hash ids: default,off)",
    )
    g.add_argument(
        "--prefix-block-tokens",
        type=pos_int,
        default=16,
        help="tokens per cached block (default: %(default)s)",
    )
    g.add_argument("--max-batch-size", type=pos_int, default=256, help="(default: %(default)s)")
    g.add_argument(
        "--batch-timeout-ms",
        type=non_neg,
        default=10.0,
        help="for policy timeout (default: %(default)s)",
    )
    g = p.add_argument_group("workload")
    g.add_argument(
        "--rate",
        type=argtypes.rates,
        default=None,
        help="requests/s per point, or fractions of eager's capacity like 0.8x "
        f"(default: {DEFAULT_RATES}; "
        "with --trace: the trace's own pace)",
    )
    g.add_argument(
        "--burstiness",
        type=pos,
        default=1.0,
        help="gamma shape of the gaps; 1 = Poisson (default: %(default)s)",
    )
    g.add_argument(
        "--duration",
        type=pos,
        default=None,
        help=f"seconds of arrivals per point (default: {DEFAULT_DURATION_S:g}; "
        "with --trace: the whole trace)",
    )
    g.add_argument(
        "--prompt-len",
        type=argtypes.lengths,
        default=None,
        help=f"fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA (default: {DEFAULT_PROMPT_LEN})",
    )
    g.add_argument(
        "--max-prompt-len",
        type=pos_int,
        default=None,
        help="clip prompt lengths (default: --max-batch-tokens)",
    )
    g.add_argument(
        "--trace",
        metavar="PATH",
        help="replay arrivals and prompt lengths from an Azure CSV or Mooncake JSONL trace",
    )
    g.add_argument(
        "--trace-format", choices=TRACE_FORMATS, default="auto", help="(default: %(default)s)"
    )
    g.add_argument(
        "--trace-requests", type=pos_int, metavar="N", help="replay only the trace's first N"
    )
    g.add_argument(
        "--trace-speedup",
        type=pos,
        metavar="X",
        help="replay the trace X times faster than recorded (default: 1; --rate overrides)",
    )
    g.add_argument(
        "--trace-block-tokens",
        type=pos_int,
        metavar="N",
        help="tokens per hash id of a Mooncake trace (default: the trace's 512); smaller "
        "scales every prompt down for a small model, keeping what is shared",
    )
    g.add_argument(
        "--seed", type=number(0, allow_lo=True, kind=int), default=0, help="(default: %(default)s)"
    )
    g = p.add_argument_group("measurement")
    g.add_argument(
        "--slo-ttft-ms",
        type=pos,
        default=None,
        help="TTFT target for goodput (default: 5x eager's mean forward, when measured)",
    )
    g.add_argument(
        "--saturation-s",
        type=non_neg,
        default=3.0,
        help="length of each policy's saturation run; 0 skips them (default: %(default)s)",
    )
    g.add_argument(
        "--warmup",
        type=number(0, allow_lo=True, kind=int),
        default=8,
        help="requests sent to each engine before measuring (default: %(default)s)",
    )
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", type=Path, help="write every figure as JSON")
    g.add_argument(
        "--plot",
        metavar="PATH",
        type=Path,
        help="write TTFT-vs-rate and batch-size plots (.png/.svg/.pdf)",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="live progress on stderr (default: when stderr is a terminal)",
    )
    g.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="event loop (default: %(default)s)",
    )
    return p


def _check_out(parser: argparse.ArgumentParser, flag: str, path: Path | None) -> None:
    if path is not None and not path.parent.resolve().is_dir():
        parser.error(f"argument {flag}: directory {path.parent} does not exist")


def parse_options(argv: list[str] | None = None) -> Options:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser.parse_args(argv)
    if a.model != "sim":
        for flag in ("sim_preset", "sim_fixed_ms", "sim_per_token_us", "sim_attn_ns"):
            if getattr(a, flag) is not None:
                parser.error(f"argument --{flag.replace('_', '-')}: only with --model sim")
    if a.trace is not None and a.prompt_len is not None:
        parser.error("argument --prompt-len: not with --trace (the trace gives the lengths)")
    if a.trace is None and a.trace_format != "auto":
        parser.error("argument --trace-format: only with --trace")
    trace = None
    if a.trace is not None:
        try:
            trace = read_trace(a.trace, a.trace_format)
        except (TraceError, OSError, UnicodeDecodeError) as exc:
            parser.error(f"argument --trace: {exc}")
        if a.trace_speedup is not None and a.rate is not None:
            parser.error("argument --trace-speedup: not with --rate (which sets the pace)")
        try:
            trace = shape_trace(trace, a.trace_requests, a.trace_block_tokens, a.trace_speedup)
        except TraceError as exc:
            parser.error(f"argument --trace-block-tokens: {exc}")
    else:
        for flag in ("trace_requests", "trace_speedup", "trace_block_tokens"):
            if getattr(a, flag) is not None:
                parser.error(f"argument --{flag.replace('_', '-')}: only with --trace")
    shared = trace is not None and trace.hash_ids is not None
    caches = a.prefix_cache or argtypes.cache_budgets("default,off" if shared else "default")
    if not shared and any(c.kind == "share" for c in caches):
        parser.error("argument --prefix-cache: shares like 10% need a trace with hash ids")
    policies = a.policy or argtypes.policies(",".join(EP_POLICIES if a.ep else POLICIES))
    if a.ep:
        if a.workers < 2 or a.tp > 1:
            parser.error("argument --ep: needs --workers >= 2 and no --tp (one rank per worker)")
        if any(p not in EP_POLICIES for p in policies):
            parser.error(f"argument --policy: with --ep use {', '.join(EP_POLICIES)}")
    elif "ep-timer" in policies:
        parser.error("argument --policy: ep-timer is an --ep baseline")
    rates = a.rate if a.rate is not None or trace is not None else argtypes.rates(DEFAULT_RATES)
    if rates and any(r.relative for r in rates) and a.saturation_s == 0:
        parser.error(
            "argument --rate: fractions like 0.8x need eager's capacity; drop --saturation-s 0"
        )
    if a.ep and rates and any(r.relative for r in rates):
        parser.error(
            "argument --rate: fractions like 0.8x are of eager's capacity, and expert-parallel "
            "ranks cannot run eager: with --ep give requests/s"
        )
    if a.plot is not None:
        if a.plot.suffix.lower() not in (".png", ".svg", ".pdf"):
            parser.error(f"argument --plot: use a .png, .svg or .pdf name, got {a.plot.name!r}")
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("argument --plot: needs matplotlib (pip install 'aioprefill[bench]')")
    _check_out(parser, "--json", a.json)
    _check_out(parser, "--plot", a.plot)
    if a.loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
        parser.error("argument --loop: uvloop is not installed; use --loop asyncio")
    preset = a.sim_preset or DEFAULT_PRESET
    try:
        model = build_model(
            a.model,
            preset,
            fixed_ms=a.sim_fixed_ms,
            per_token_us=a.sim_per_token_us,
            attn_ns=a.sim_attn_ns,
        )
    except InvalidConfig as exc:
        parser.error(f"argument --model: {exc}")
    # a trace that shares prefixes keeps its prompts whole (chunked), so what is shared stays
    max_len = min(
        a.max_prompt_len or (model.max_prompt_tokens if shared else a.max_batch_tokens),
        model.max_prompt_tokens,
    )
    if trace is not None:
        trace = trace.clipped(max_len)
    block_bytes = cache_block_bytes(model, a.prefix_block_tokens)
    if block_bytes == 0 and any(c.kind == "share" for c in caches):
        parser.error("argument --prefix-cache: this model's bytes per block are unknown")
    duration = a.duration if a.duration is not None or trace is not None else DEFAULT_DURATION_S
    return Options(
        model=model,
        model_label=model_label(model, preset if a.model == "sim" else None),
        policies=policies,
        rates=rates,
        duration_s=duration,
        burstiness=a.burstiness,
        lengths=None
        if trace is not None
        else (a.prompt_len or argtypes.lengths(DEFAULT_PROMPT_LEN)),
        trace=trace,
        trace_path=a.trace,
        trace_format=a.trace_format,
        max_prompt_len=max_len,
        num_workers=a.workers,
        tp_size=a.tp,
        expert_parallel=a.ep,
        max_batch_tokens=a.max_batch_tokens,
        max_batch_size=a.max_batch_size,
        batch_timeout_ms=a.batch_timeout_ms,
        slo_ttft_ms=a.slo_ttft_ms,
        saturation_s=a.saturation_s,
        warmup=a.warmup,
        seed=a.seed,
        json_path=a.json,
        plot_path=a.plot,
        progress=sys.stderr.isatty() if a.progress is None else a.progress,
        loop=a.loop,
        argv=argv,
        prefix_cache=caches,
        prefix_block_tokens=a.prefix_block_tokens,
        block_bytes=block_bytes,
        distinct_blocks=distinct_blocks(trace, a.prefix_block_tokens)
        if shared and trace is not None
        else None,
    )
