"""Trace readers: arrival times and prompt lengths from public LLM inference traces.

- Azure LLM inference trace (2023/2024, AzurePublicDataset): a CSV with the header
  `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP is a date-time such as
  `2023-11-16 18:15:46.6805900` (or plain seconds).
- Mooncake trace (FAST'25): JSON lines `{"timestamp": ms, "input_length": n,
  "output_length": m, "hash_ids": [...]}`; only `timestamp` and `input_length` are used.

Both become a `Schedule` whose first arrival is at 0 s. Only prompt lengths are replayed: the
token ids are drawn at random (prefill cost depends on the lengths, not the ids).
"""

from __future__ import annotations

import csv
from datetime import datetime
from pathlib import Path

import msgspec
import numpy as np

from aioprefill.bench.workload import Schedule

__all__ = [
    "TRACE_FORMATS",
    "TraceError",
    "detect_format",
    "read_azure",
    "read_mooncake",
    "read_trace",
]

TRACE_FORMATS = ("auto", "azure", "mooncake")


class TraceError(ValueError):
    """A trace file is missing, empty or malformed; the message names the file and line."""


class _MooncakeRow(msgspec.Struct):
    timestamp: float
    input_length: int


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
    return _schedule(path, times, lengths)


def _schedule(path: Path, times: list[float], lengths: list[int]) -> Schedule:
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
    return Schedule(t, n)
