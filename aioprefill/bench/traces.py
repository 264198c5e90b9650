"""Trace readers: arrival times and prompt lengths from public LLM inference traces.

- Azure LLM inference trace (2023/2024, AzurePublicDataset): a CSV with the header
  `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP is a date-time such as
  `2023-11-16 18:15:46.6805900` (or plain seconds).
- Mooncake trace (FAST'25): JSON lines `{"timestamp": ms, "input_length": n,
  "output_length": m, "hash_ids": [...]}`: `hash_ids` names the prompt's blocks of
  `MOONCAKE_BLOCK_TOKENS` tokens (chained: equal ids mean an equal prefix).

Both become a `Schedule` whose first arrival is at 0 s. An Azure trace replays prompt lengths
only (its token ids are drawn at random); a Mooncake trace also keeps its `hash_ids`, so its
replay shares the prefixes that the trace shares (`prefix.py` gives each id its own tokens).
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

import msgspec
import numpy as np

from aioprefill.bench.prefix import scale_blocks
from aioprefill.bench.workload import Schedule

__all__ = [
    "MOONCAKE_BLOCK_TOKENS",
    "TRACE_FORMATS",
    "TraceError",
    "detect_format",
    "read_azure",
    "read_mooncake",
    "read_trace",
    "shape_trace",
]

TRACE_FORMATS = ("auto", "azure", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces (FAST'25)


class TraceError(ValueError):
    """A trace file is missing, empty or malformed; the message names the file and line."""


class _MooncakeRow(msgspec.Struct):
    timestamp: float
    input_length: int
    hash_ids: list[int] = []


_mooncake_decoder = msgspec.json.Decoder(_MooncakeRow)


def detect_format(path: Path) -> str:
    """`azure` for .csv, `mooncake` for .jsonl/.json, else by the first non-blank character."""
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return "azure"
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    with path.open("r", encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    return "mooncake" if head.startswith("{") else "azure"


def read_trace(path: str | Path, fmt: str = "auto") -> Schedule:
    """Read a trace file (`fmt`: auto, azure, mooncake) into a `Schedule`."""
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"{p}: no such file")
    if fmt not in TRACE_FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; use one of {', '.join(TRACE_FORMATS)}")
    if fmt == "auto":
        fmt = detect_format(p)
    return read_azure(p) if fmt == "azure" else read_mooncake(p)


def _timestamp_s(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return datetime.fromisoformat(text.strip()).timestamp()


def read_azure(path: Path) -> Schedule:
    times: list[float] = []
    lengths: list[int] = []
    with path.open("r", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        fields = {name.strip() for name in reader.fieldnames or []}
        if not {"TIMESTAMP", "ContextTokens"} <= fields:
            raise TraceError(
                f"{path}: not an Azure LLM trace: header needs TIMESTAMP,ContextTokens "
                f"(got {sorted(fields)})"
            )
        for row in reader:
            line = reader.line_num
            row = {k.strip(): v for k, v in row.items() if k is not None}
            try:
                t = _timestamp_s(row["TIMESTAMP"] or "")
                n = int(row["ContextTokens"] or "")
            except ValueError as exc:
                raise TraceError(f"{path}:{line}: {exc}") from None
            times.append(t)
            lengths.append(n)
    return _schedule(path, times, lengths)


def read_mooncake(path: Path) -> Schedule:
    times: list[float] = []
    lengths: list[int] = []
    ids: list[np.ndarray] = []
    block = MOONCAKE_BLOCK_TOKENS
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = _mooncake_decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise TraceError(f"{path}:{line_no}: {exc}") from None
            times.append(row.timestamp / 1000.0)
            lengths.append(row.input_length)
            k = len(row.hash_ids)
            if k and not (k - 1) * block < row.input_length <= k * block:
                raise TraceError(
                    f"{path}:{line_no}: {k} hash_ids of {block} tokens do not cover "
                    f"input_length {row.input_length}"
                )
            if k and min(row.hash_ids) < 0:
                raise TraceError(f"{path}:{line_no}: a hash id is negative")
            ids.append(np.asarray(row.hash_ids, dtype=np.int64))
    if ids and not all(len(h) for h in ids):  # lengths only, unless every request has its ids
        ids = []
    return _schedule(path, times, lengths, ids, block)


def _schedule(
    path: Path,
    times: list[float],
    lengths: list[int],
    hash_ids: list[np.ndarray] | None = None,
    block_tokens: int = 0,
) -> Schedule:
    if not times:
        raise TraceError(f"{path}: no requests in the trace")
    t = np.asarray(times, dtype=np.float64)
    n = np.asarray(lengths, dtype=np.int64)
    if not np.all(np.isfinite(t)):
        raise TraceError(f"{path}: a timestamp is not finite")
    if np.any(n < 1):
        bad = int(np.argmax(n < 1))
        raise TraceError(f"{path}: request {bad + 1} has prompt length {n[bad]} (< 1)")
    order = np.argsort(t, kind="stable")  # traces are near-sorted; replay needs sorted
    t, n = t[order], n[order]
    t -= t[0]
    if not hash_ids:
        return Schedule(t, n)
    return Schedule(t, n, tuple(hash_ids[i] for i in order), block_tokens)


def shape_trace(
    t: Schedule, requests: int | None, block_tokens: int | None, speedup: float | None
) -> Schedule:
    """The first `requests`, each hash id as `block_tokens` tokens, `speedup` times faster
    (each None: unchanged)."""
    if requests is not None:
        t = t.first(requests)
    if block_tokens is not None:
        if t.hash_ids is None:
            raise TraceError("the trace has no hash_ids")
        t = scale_blocks(t, block_tokens)
    return t if speedup is None else t.sped_up(speedup)
