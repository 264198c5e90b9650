"""`StoreStats`: one worker's store-tier counters. Each counter has one writer thread (the
forward's, the put thread or the load thread) or is written under the put queue's lock
(`puts_skipped_recent`, `puts_dropped_full`: a block is staged by either thread), so plain ints
suffice."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StoreStats"]


@dataclass(slots=True)
class StoreStats:
    puts: int = 0  # blocks put
    put_bytes: int = 0
    puts_dropped_full: int = 0  # the put budget was full: not put (back-pressure)
    puts_skipped_down: int = 0  # the store was unreachable: not put
    puts_skipped_recent: int = 0  # put by this worker recently
    puts_no_space: int = 0  # the store's pool was full (it evicts in the background)
    puts_failed: int = 0  # any other refusal
    loads: int = 0  # chains asked for
    blocks_loaded: int = 0  # blocks that passed every check and were handed over
    load_bytes: int = 0
    blocks_missing: int = 0  # chains that stopped at a block the store does not hold
    blocks_refused: int = 0  # values that failed a check (short, foreign, corrupt, forged)
    loads_skipped: int = 0  # store unreachable, still busy, or not worth it: computed
    load_timeouts: int = 0  # a load passed load_timeout_s: computed
    loads_unlisted: int = 0  # no block of the batch's chains announced by any node: computed

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}
