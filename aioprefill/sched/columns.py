"""`Columns`: the wire columns of one batch, appended as requests join it, and
`make_prefill_batch`, which packs them into one `PrefillBatch`. The one place where a request
becomes wire columns (its tokens, its chunk's place, its output options, its prefix cache
reads and writes).
"""

from __future__ import annotations

import struct
from typing import Any

from aioprefill.sched.units import Chunk, Request
from aioprefill.wire.outputs import option_columns
from aioprefill.wire.protocol import FLAG_FIRST_CHUNK, FLAG_LAST_CHUNK, PrefillBatch

__all__ = ["Columns", "make_prefill_batch"]


class Columns:
    """The per-request wire columns of one batch, appended as requests join it.

    Whole prompts leave `start_pos`/`flags` as None (the packer fills the constant), so the
    common case appends two references per request. A new per-request option is one more
    column here and in `pack`. Output options (`aioprefill.wire.outputs`) are kept sparse, as
    (position, Outputs) for the requests that have any: None while nobody in the batch does.
    """

    __slots__ = ("cache", "flags", "ids", "num_tokens", "outputs", "start_pos", "token_parts")

    def __init__(self, *, whole: bool = True) -> None:
        self.ids: list[int] = []
        self.token_parts: list[bytes] = []
        self.start_pos: list[int] | None = None if whole else []
        self.flags: list[int] | None = None if whole else []
        self.outputs: list[tuple[int, Any]] | None = None
        self.num_tokens = 0
        # The prefix cache's columns (`BatchPlan.columns()`), None: no reads, writes, tails.
        self.cache: tuple[bytes, ...] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def add_whole(self, req: Request) -> None:
        self.ids.append(req.request_id)
        self.token_parts.append(req.tokens)
        self.num_tokens += req.num_tokens
        if req.outputs is not None:
            self._add_outputs(req.outputs)

    def _add_outputs(self, outputs: Any) -> None:
        if self.outputs is None:
            self.outputs = []
        self.outputs.append((len(self.ids) - 1, outputs))

    def add_chunk(self, req: Request, start: int, end: int, cached: int = 0) -> None:
        """Tokens [start, end) of `req`; `cached` > 0: the first chunk computed, which reads
        the tokens before `start` from the prefix cache (a first chunk all the same)."""
        assert self.start_pos is not None and self.flags is not None
        self.ids.append(req.request_id)
        whole = start == 0 and end == req.num_tokens
        self.token_parts.append(req.tokens if whole else req.tokens[4 * start : 4 * end])
        self.start_pos.append(start)
        self.flags.append(
            (FLAG_FIRST_CHUNK if start == cached else 0)
            | (FLAG_LAST_CHUNK if end == req.num_tokens else 0)
        )
        self.num_tokens += end - start
        if req.outputs is not None:
            self._add_outputs(req.outputs)

    @classmethod
    def of_chunks(cls, chunks: list[Chunk]) -> Columns:
        cols = cls(whole=False)
        for c in chunks:
            cols.add_chunk(c.request, c.start, c.end, c.cached)
        return cols

    def pack(self, batch_id: int, free_ids: list[int], sent_ns: int) -> PrefillBatch:
        options = None if self.outputs is None else option_columns(len(self.ids), self.outputs)
        return make_prefill_batch(
            batch_id,
            self.ids,
            self.token_parts,
            self.start_pos,
            self.flags,
            free_ids,
            sent_ns,
            options,
            self.cache,
        )


def make_prefill_batch(
    batch_id: int,
    request_ids: list[int],
    token_parts: list[bytes],
    start_pos: list[int] | None,
    flags: list[int] | None,
    free_ids: list[int],
    sent_ns: int,
    options: tuple[bytes, bytes, list[str], bytes, bytes] | None = None,
    cache: tuple[bytes, ...] | None = None,
) -> PrefillBatch:
    """Pack per-request columns into a PrefillBatch (`token_parts`: int32 bytes per request).

    `start_pos` / `flags` None mean every request is a whole prompt. `struct.pack` over Python
    ints beats building NumPy arrays for the small batches that dominate the hot path, and
    costs a few microseconds for a 256-request batch. `options`: the (options, top_k,
    kv_names) columns from `aioprefill.wire.outputs.option_columns`, None when nobody asked;
    `cache`: the prefix cache columns (`aioprefill.sched.prefix.BatchPlan.columns`), or None.
    """
    n = len(request_ids)
    offsets = [0]
    total = 0
    for part in token_parts:
        total += len(part) >> 2
        offsets.append(total)
    # The cache columns go in the one call: a Struct field set after it is made costs ~0.1 us.
    reads, read_slots, writes, write_slots, first, hashes, tails, tail_hashes = cache or _NO_CACHE
    msg = PrefillBatch(
        batch_id=batch_id,
        request_ids=struct.pack(f"<{n}q", *request_ids),
        offsets=struct.pack(f"<{n + 1}i", *offsets),
        tokens=b"".join(token_parts),
        start_pos=bytes(4 * n) if start_pos is None else struct.pack(f"<{n}i", *start_pos),
        flags=_WHOLE_PROMPT * n if flags is None else bytes(flags),
        free_ids=struct.pack(f"<{len(free_ids)}q", *free_ids) if free_ids else b"",
        sent_ns=sent_ns,
        read_offsets=reads,
        read_slots=read_slots,
        write_offsets=writes,
        write_slots=write_slots,
        write_first=first,
        write_hashes=hashes,
        tail_offsets=tails,
        tail_hashes=tail_hashes,
    )
    if options is not None:
        msg.options, msg.top_k, msg.kv_names, msg.labels, msg.token_types = options
    return msg


_WHOLE_PROMPT = bytes([FLAG_FIRST_CHUNK | FLAG_LAST_CHUNK])
_NO_CACHE = (b"",) * 8  # PrefillBatch's defaults for the eight prefix cache columns
