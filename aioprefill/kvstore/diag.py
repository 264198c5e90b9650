"""`Diag`: a worker's store-tier event log for finding where store hits are lost, on only when
`AIOPREFILL_STORE_DIAG` names a directory (benchmarks: `benchmarks/kvstore_gap.py` reads it). Each
worker keeps, in memory, its lookups (asked, decided, found, how long each part of a load call
took), its forwards' written blocks and
its completed or dropped puts (wall-clock times, comparable across the host's processes), and
writes them to `<dir>/store-<pid>.json` when it stops. Off: every call is a no-op check."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DIAG", "Diag"]


class Diag:
    def __init__(self, directory: str) -> None:
        self.path = Path(directory) / f"store-{os.getpid()}.json"
        self.asks: list[list[object]] = []
        self.written: list[list[object]] = []
        self.puts: list[list[object]] = []
        self.drops: list[list[object]] = []

    def ask(self, decision: str, chains: Sequence[Sequence[int]], got: Sequence[int],
            seconds: float, state: Sequence[float],
            parts: Sequence[float] = ()) -> None:  # fmt: skip
        """One lookup; `parts`: a load call's seconds by part (`Loader.parts`)."""
        self.asks.append([time.time(), decision, [list(c) for c in chains], list(got), seconds,
                          list(state), list(parts)])  # fmt: skip

    def wrote(self, hashes: Sequence[int]) -> None:
        self.written.append([time.time(), [int(h) for h in hashes]])

    def put(self, hashes: Sequence[int]) -> None:
        self.puts.append([time.time(), [int(h) for h in hashes]])

    def dropped(self, block_hash: int) -> None:
        self.drops.append([time.time(), int(block_hash)])

    def write(self, stats: dict[str, int]) -> None:
        data = {"asks": self.asks, "written": self.written, "puts": self.puts,
                "drops": self.drops, "stats": stats}  # fmt: skip
        self.path.write_text(json.dumps(data))


_dir = os.environ.get("AIOPREFILL_STORE_DIAG")
DIAG: Diag | None = Diag(_dir) if _dir else None
