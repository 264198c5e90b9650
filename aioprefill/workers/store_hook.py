"""The KV store tier around a worker's forwards (`EngineConfig(kv_store="mooncake")`).

Before a forward (`StoreHook.before`), for each chunk that is its prompt's first chunk computed
and writes blocks from its very start (the blocks just past what the worker's cache held), the
worker asks the store for those blocks' chain (`StoreTier.load`: checked values, within a
deadline, only when the cost rule says reading beats computing) and copies what it got into
the very slots the engine planned to write them to. The batch is then rewritten so that those
blocks are *read*: the chunk starts `k * block_tokens` later, reads its slots plus the loaded
ones, writes the rest. Nothing the engine planned changes: after the forward each write slot
holds its block either way (loaded or computed), so the engine's index stays exact, and any
failure (store down, block missing, refused, too slow) just means the blocks are computed.
At least one token of every chunk is computed (a prompt's last token always is).

With `KVStoreOptions.scratch_blocks`, the runner has that many slots past the engine's, which
the engine never names. A chunk's *tail*, the full blocks it computes past the write slots the
engine gave it (a prompt longer than the local cache, or whose slots are all pinned; their
hashes come with the batch, `PrefillBatch.tail_hashes`), is written to the next free scratch
slots as if the engine had planned it (up to `scratch_blocks` a batch): its blocks are loaded
into them like any others and, when computed, put. Scratch slots are never indexed: a block
there serves this forward (and its put) only.

Once the answer is sent (`StoreHook.put_written`, before the worker takes its next batch, so
no slot has changed yet), every block the forward wrote (not those loaded) is listed for the
store with its hash (`PrefillBatch.write_hashes`): a background thread copies each into the put
buffer (dropped if it is full) and puts it. The next batch first settles its own write slots
(`StoreHook.before`: a listed block in one of them is copied now, on the worker's thread), so
no slot is rewritten before its block is copied, and the copies are off the next batch's path
(measured: 1.4 ms a batch of ~30 gpu-class blocks on the busy VM, when they were made here).
The answer carries, per chunk, the tokens loaded (`BatchResult.loaded_tokens`), which the
engine adds to the request's `cached_tokens`.

Not with tensor parallelism (`EngineConfig` refuses it): a group's ranks would have to agree on
what they loaded before running the forward's collectives.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

import msgspec
import numpy as np

from aioprefill.kvstore.diag import DIAG
from aioprefill.kvstore.identity import StoreIdentity, weights_digest
from aioprefill.kvstore.options import KVStoreOptions
from aioprefill.kvstore.tier import StoreTier
from aioprefill.models import PaddleModel, SimModel
from aioprefill.wire import protocol
from aioprefill.workers.runner import ForwardBatch

__all__ = ["StoreHook", "identity_for", "make_hook"]

log = logging.getLogger("aioprefill.kvstore")


class Slots(Protocol):
    """A runner's prefix-cache slots (`prefix_blocks.BlockStore`, `sim_cache.SimBlocks`)."""

    def slot_arrays(self, slot: int) -> list[np.ndarray]: ...
    def layout(self) -> str: ...
    def loaded(self, slot: int) -> None: ...
    def add_slots(self, extra: int) -> None: ...


def make_hook(spec: protocol.WorkerSpec, runner: Any) -> StoreHook | None:
    """The worker's store tier, started (it connects in the background), or None when the
    engine has no store or the runner keeps no cache slots."""
    slots: Slots | None = getattr(runner, "cache_slots", None)
    if spec.kv_store is None or slots is None or not getattr(runner, "cache_blocks", 0):
        return None
    # A value holds the slot's arrays, padded to the runner's bytes per block (SimRunner's
    # slots hold ids and a CRC, but a block weighs what a real model's KV would).
    payload = max(sum(a.nbytes for a in slots.slot_arrays(0)), runner.block_bytes)
    layout = f"{slots.layout()} P{payload}"
    identity = identity_for(spec.model, spec.kv_store, spec.block_tokens, layout)
    first_guess = getattr(spec.model, "per_token_us", 1000.0) * 1e-6
    tier = StoreTier(spec.kv_store, identity, payload, seconds_per_token=first_guess)
    tier.start()
    # The first attempt to connect takes ~0.1 s with the master up and fails at once with
    # nothing listening: worth waiting for (the first batches already use the store), never
    # longer than this.
    tier.link.tried.wait(spec.kv_store.load_timeout_s)
    engine_blocks = int(runner.cache_blocks)
    slots.add_slots(spec.kv_store.scratch_blocks)
    return StoreHook(tier, slots, spec.block_tokens, payload, engine_blocks)


def identity_for(
    model: SimModel | PaddleModel, options: KVStoreOptions, block_tokens: int, layout: str
) -> StoreIdentity:
    """This worker's place in the store's key space: the model (`model_id`, else the spec
    without its weights path plus sampled bytes of the weight files), dtype, slot layout and
    block size (tensor parallelism is refused with a store, so rank 0 of 1)."""
    weights = getattr(model, "weights", None)
    named = model if weights is None else msgspec.structs.replace(model, weights=None)
    return StoreIdentity(
        model=options.model_id or weights_digest(msgspec.msgpack.encode(named), weights),
        dtype=getattr(model, "dtype", "sim"),
        layout=layout,
        block_tokens=block_tokens,
    )


class StoreHook:
    """Loads before a forward, puts after it (see the module docstring)."""

    def __init__(
        self, tier: StoreTier, slots: Slots, block_tokens: int, payload: int, engine_blocks: int
    ) -> None:
        self.tier = tier
        self.slots = slots
        self.block_tokens = block_tokens
        pad = payload - sum(a.nbytes for a in slots.slot_arrays(0))
        self._pad = [np.zeros(pad, dtype=np.uint8)] if pad else []
        self.written: ForwardBatch | None = None  # the last forward's batch, until put
        # Scratch slots (past the engine's): each batch takes the next ones in turn (so that a
        # slot's put is likely copied before it is taken again) for its chunks' tails.
        self.scratch = np.arange(engine_blocks, engine_blocks + tier.options.scratch_blocks)
        self.next_scratch = 0

    def before(self, batch: ForwardBatch) -> tuple[ForwardBatch, np.ndarray | None]:
        """The batch to run (its tails written to scratch slots, its loaded blocks turned into
        reads) and the tokens loaded per chunk (None when none were)."""
        if batch.write_slots is None:
            return batch, None
        batch = self._with_tails(batch)
        ro, rs, wo, ws, wf = (
            batch.read_offsets, batch.read_slots, batch.write_offsets, batch.write_slots,
            batch.write_first,
        )  # fmt: skip
        assert ro is not None and rs is not None and wo is not None and ws is not None
        assert wf is not None
        self.tier.settle(ws.tolist())  # first: no slot rewritten before its block is copied
        hashes = batch.write_hashes
        if hashes is None or not len(hashes) or not self.tier.is_up():
            return batch, None
        written_hashes = hashes.tolist()
        b = self.block_tokens
        offsets, starts = batch.offsets.tolist(), batch.start_pos.tolist()
        chunks, chains, targets = [], [], []
        for i in range(batch.size):
            reads, first, w0, w1 = int(ro[i + 1] - ro[i]), int(wf[i]), int(wo[i]), int(wo[i + 1])
            if w1 == w0 or starts[i] != reads * b or first != reads:
                continue  # a later chunk, or nothing written from the chunk's start
            a, most = offsets[i], (offsets[i + 1] - offsets[i] - 1) // b
            n = min(most, w1 - w0)
            if n > 0:
                chunks.append(i)
                chains.append([(written_hashes[w0 + j], batch.tokens[a + j * b : a + (j + 1) * b])
                               for j in range(n)])  # fmt: skip
                targets.append(ws[w0 : w0 + n].tolist())
        if not chains:
            return batch, None

        def fill(c: int, j: int, payload: memoryview) -> None:
            self._fill(targets[c][j], payload)

        got = self.tier.load(chains, fill)
        if not any(got):
            return batch, None
        blocks = np.zeros(batch.size, dtype=np.int32)
        blocks[chunks] = got
        return _as_reads(batch, blocks, b), blocks * b

    def _with_tails(self, batch: ForwardBatch) -> ForwardBatch:
        """`batch` with each chunk's tail (the full blocks it computes past its write slots:
        `PrefillBatch.tail_hashes`) written to the next scratch slots too, as many as there
        are (the rest stay unwritten), so that they are loaded or put like any written block."""
        to, th = batch.tail_offsets, batch.tail_hashes
        wo, ws = batch.write_offsets, batch.write_slots
        if to is None or th is None or not len(th) or not len(self.scratch):
            return batch
        wh = batch.write_hashes
        assert wo is not None and ws is not None
        if (wh is None and len(ws)) or not self.tier.is_up():
            return batch  # (puts skipped while the link is down: nothing to write them for)
        wh = np.empty(0, dtype=np.uint64) if wh is None else wh
        room, total = len(self.scratch), len(self.scratch)
        slots, hashes, counts = [], [], []
        for i in range(batch.size):
            k = min(room, int(to[i + 1] - to[i]))
            at = (self.next_scratch + total - room + np.arange(k)) % total
            slots += [ws[wo[i] : wo[i + 1]], self.scratch[at]]
            hashes += [wh[wo[i] : wo[i + 1]], th[to[i] : to[i] + k]]
            counts.append(int(wo[i + 1] - wo[i]) + k)
            room -= k
        self.next_scratch = (self.next_scratch + total - room) % total
        return dataclasses.replace(
            batch,
            write_offsets=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            write_slots=np.concatenate(slots).astype(np.int32),
            write_hashes=np.concatenate(hashes).astype(np.uint64),
            tail_offsets=None,
            tail_hashes=None,
        )

    def _fill(self, slot: int, payload: memoryview) -> None:
        at = 0
        for dst in self.slots.slot_arrays(slot):
            n = dst.nbytes
            src = np.frombuffer(payload, dtype=dst.dtype, count=dst.size, offset=at)
            dst[...] = src.reshape(dst.shape)
            at += n  # (the padding after the arrays, if any, is not read)
        self.slots.loaded(slot)

    def finished(self, batch: ForwardBatch, seconds: float) -> None:
        """The forward of `batch` (as run) took `seconds`: learn the speed per token, and keep
        the batch for `put_written`, which the worker calls once its answer is sent."""
        self.tier.record_forward(seconds, len(batch.tokens))
        self.written = batch
        if DIAG is not None and batch.write_hashes is not None:
            DIAG.wrote(batch.write_hashes.tolist())

    def put_written(self) -> None:
        """List every block the last forward wrote for a put (copied by the put thread, or
        by `before` when the next batch rewrites its slot first); before the worker takes its
        next batch."""
        batch, self.written = self.written, None
        if batch is None:
            return
        hashes, ws = batch.write_hashes, batch.write_slots
        if hashes is None or ws is None:
            return
        blocks = []
        for slot, block_hash in zip(ws.tolist(), hashes.tolist(), strict=True):
            arrays = self.slots.slot_arrays(slot)
            blocks.append((slot, block_hash, self._tokens_of(arrays), arrays + self._pad))
        self.tier.defer(blocks)

    @staticmethod
    def _tokens_of(arrays: list[np.ndarray]) -> np.ndarray:
        # Both slot kinds keep the block's token ids; find them by dtype and shape.
        return next(a for a in arrays if a.dtype == np.int32 and a.ndim == 1)

    def close(self) -> None:
        if DIAG is not None:
            DIAG.write(self.tier.stats.as_dict())
        self.tier.close()


def _as_reads(batch: ForwardBatch, blocks: np.ndarray, b: int) -> ForwardBatch:
    """`batch` with the first `blocks[i]` blocks of chunk i read from its first write slots
    (where they were loaded: engine slots, then scratch ones) instead of computed."""
    ro, rs, wo, ws, wf, wh = (
        batch.read_offsets, batch.read_slots, batch.write_offsets, batch.write_slots,
        batch.write_first, batch.write_hashes,
    )  # fmt: skip
    assert ro is not None and rs is not None and wo is not None and ws is not None
    assert wf is not None and wh is not None
    n, offsets = batch.size, batch.offsets
    keep_tokens, reads, writes, hashes = [], [], [], []
    new_ro, new_wo = [0], [0]
    for i in range(n):
        k = int(blocks[i])
        keep_tokens.append(batch.tokens[offsets[i] + k * b : offsets[i + 1]])
        w0, w1 = int(wo[i]), int(wo[i + 1])
        reads += [rs[ro[i] : ro[i + 1]], ws[w0 : w0 + k]]
        writes.append(ws[w0 + k : w1])
        hashes.append(wh[w0 + k : w1])
        new_ro.append(new_ro[-1] + int(ro[i + 1] - ro[i]) + k)
        new_wo.append(new_wo[-1] + w1 - w0 - k)
    lens = np.diff(offsets) - blocks * b
    return dataclasses.replace(
        batch,
        offsets=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        tokens=np.concatenate(keep_tokens).astype(np.int32),
        start_pos=(batch.start_pos + blocks * b).astype(np.int32),
        read_offsets=np.array(new_ro, dtype=np.int32),
        read_slots=np.concatenate(reads).astype(np.int32),
        write_offsets=np.array(new_wo, dtype=np.int32),
        write_slots=np.concatenate(writes).astype(np.int32),
        write_first=(wf + blocks).astype(np.int32),
        write_hashes=np.concatenate(hashes).astype(np.uint64),
    )
