"""`--kv-transfer vllm-mooncake`: the prefill side of vLLM's MooncakeConnector at run time.

vLLM's protocol runs the other way round from a pull: the router invents a `transfer_id` and
sends it to both nodes; the decode node asks (one msgpack `XferMetadata` on this node's ZMQ
ROUTER: its transfer engine, its block ids and where its pages live) and the prefill node
writes (one `batch_transfer_sync_write` per request) and answers `XferResponse`.

`VllmPD` holds the pieces: the bootstrap server (`vllm_bootstrap.py`), the ROUTER, a Mooncake
transfer engine, and the table of transfers by `transfer_id`. A transfer opens with whichever
arrives first, the prefill request's KV export (`offer`) or the decode's message (which then
waits for it); it closes, and the export with it, when every decode rank paired with it got
its answer, or at its deadline (`timeout_s` after it opened). A message that cannot be served
(malformed, an expired or unknown id, a geometry that does not fit: `transfer/vllm/geometry`)
is answered ERROR with the reason, logged, and never stops the side channel. The packing into
a registered staging buffer and the blocking write run on threads, off the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aioprefill.errors import InvalidConfig, InvalidRequest
from aioprefill.optional import import_optional
from aioprefill.serve.vllm_bootstrap import BootstrapServer
from aioprefill.transfer.backend import new_engine
from aioprefill.transfer.vllm import geometry, messages, pages
from aioprefill.transfer.vllm.messages import ERROR, FINISH, XferResponse
from aioprefill.transfer.vllm.staging import Staging

__all__ = ["VllmPD", "VllmPDOptions"]

log = logging.getLogger("aioprefill.serve")

_MAX_OPEN = 65536  # transfers open at once (a peer inventing ids cannot grow the table further)
_TOMBSTONES = 65536  # closed transfer ids remembered, so a late message is refused at once


@dataclass(slots=True, frozen=True, kw_only=True)
class VllmPDOptions:
    """`host`: what decode nodes and the router reach (bootstrap, side channel, transfer
    engine); `layout` / `dtype` / `block_size`: the decode's pages (`geometry.Settings`);
    `timeout_s`: a transfer's deadline from when it opened."""

    host: str = "127.0.0.1"
    bootstrap_port: int = 8998
    protocol: str = "tcp"
    layout: str = "cpu"
    dtype: str | None = None
    block_size: int | None = None
    timeout_s: float = 120.0
    write_threads: int = 4

    def __post_init__(self) -> None:
        for name, wrong in (
            ("host", not self.host or ":" in self.host),
            ("bootstrap_port", not 0 < self.bootstrap_port < 65536),
            ("timeout_s", not self.timeout_s > 0),
            ("write_threads", self.write_threads < 1),
        ):
            if wrong:
                raise InvalidConfig(f"vllm-mooncake {name}: {getattr(self, name)!r}")
        geometry.Settings(self.layout, self.dtype, self.block_size)  # InvalidRequest if wrong


@dataclass(slots=True, eq=False)
class _Transfer:
    tid: str
    ready: asyncio.Future[None]
    timer: asyncio.TimerHandle
    export: Any = None  # the request's KVExport once offered
    num_tokens: int = 0
    need: int = 0  # decode ranks to answer (their TP size, from the first message)
    answered: set[int] = field(default_factory=set)
    busy: int = 0  # writes running
    closing: str = ""  # finished while a write ran: closed when the last one ends


class VllmPD:
    """The vLLM MooncakeConnector producer of one server (started with the engine)."""

    def __init__(self, options: VllmPDOptions, shape: geometry.KVShape) -> None:
        self.options = options
        self.shape = shape
        self.settings = geometry.Settings(options.layout, options.dtype, options.block_size)
        self.engine_id = f"aioprefill-{uuid.uuid4()}"
        self.counts: collections.Counter[str] = collections.Counter()
        self.seconds = {"pack": 0.0, "write": 0.0}  # on the writing threads, summed
        self._open: dict[str, _Transfer] = {}
        self._closed: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._pool = ThreadPoolExecutor(options.write_threads, thread_name_prefix="vllm-pd")
        self._te: Any = None
        self._ctx: Any = None
        self._sock: Any = None
        self._bootstrap: BootstrapServer | None = None
        self.side_channel = ""

    @property
    def num_open(self) -> int:
        return len(self._open)

    def stats(self) -> dict[str, Any]:
        seconds = {f"{k}_s": round(v, 6) for k, v in self.seconds.items()}
        staging = self._staging.mapped if self._te is not None else 0
        return {"engine_id": self.engine_id, "open": len(self._open), "staging_buffers": staging,
                **self.counts, **seconds}  # fmt: skip

    async def start(self) -> None:
        zmq = import_optional("zmq", "vllm-pd")
        import_optional("zmq.asyncio", "vllm-pd")

        o = self.options
        loop = asyncio.get_running_loop()
        self._te, self.session = await loop.run_in_executor(
            self._pool, new_engine, o.host, o.protocol
        )
        self._staging = Staging(self._te)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{o.host}")
        self.side_channel = f"tcp://{o.host}:{port}"
        self._bootstrap = BootstrapServer(
            o.host, o.bootstrap_port, self.engine_id, self.side_channel
        )
        await self._bootstrap.start()
        self._spawn(self._serve())
        log.warning(
            "vllm-mooncake: bootstrap http://%s:%d, side channel %s, engine %s, pages %s",
            o.host, o.bootstrap_port, self.side_channel, self.engine_id, self.settings,
        )  # fmt: skip

    async def close(self) -> None:
        if self._bootstrap is not None:
            await self._bootstrap.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for tid in list(self._open):
            self._finish(tid, "server closing")
        if self._sock is not None:
            self._sock.close(0)
            self._ctx.term()
        self._pool.shutdown(wait=True)
        if self._te is not None:
            self._staging.close()
        self._te = None

    # ---- the prefill request's side ------------------------------------------------------

    def offer(self, tid: str, export: Any) -> None:
        """The prefill request for `tid` finished with its KV export: kept for the decode."""
        state = self._closed.get(tid)
        if state is not None:  # the decode gave up (deadline) or released it already
            export.close()
            self.counts["offered_after_close"] += 1
            return
        t = self._open.get(tid) or self._opened(tid)
        if t is None or t.export is not None:
            export.close()
            if t is not None:
                raise InvalidRequest(f"kv_transfer_params.transfer_id {tid!r} is already in use")
            raise InvalidRequest("too many vLLM transfers open")
        t.export, t.num_tokens = export, export.num_tokens
        if not t.ready.done():
            t.ready.set_result(None)

    def fail(self, tid: str, reason: str) -> None:
        """The prefill request for `tid` failed: its decode is answered ERROR now, or when
        it asks."""
        t = self._open.get(tid) or (None if tid in self._closed else self._opened(tid))
        if t is not None and t.export is None:
            self._finish(tid, f"the prefill request failed: {reason}")

    def _opened(self, tid: str) -> _Transfer | None:
        if len(self._open) >= _MAX_OPEN:
            return None
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.options.timeout_s, self._expire, tid)
        t = self._open[tid] = _Transfer(tid, loop.create_future(), timer)
        return t

    def _expire(self, tid: str) -> None:
        self.counts["expired"] += 1
        log.warning("vllm-mooncake: transfer %s expired after %.0f s", tid, self.options.timeout_s)
        self._finish(tid, f"transfer {tid} expired ({self.options.timeout_s:.0f} s)")

    def _finish(self, tid: str, reason: str) -> None:
        t = self._open.get(tid)
        if t is None:
            return
        if t.busy:  # a thread still reads the export: closed when the last write ends
            t.closing = t.closing or reason
            return
        del self._open[tid]
        t.timer.cancel()
        if not t.ready.done():
            t.ready.set_exception(InvalidRequest(reason))
            t.ready.exception()  # retrieved: nobody may be waiting
        if t.export is not None:
            t.export.close()
        self._closed[tid] = reason
        while len(self._closed) > _TOMBSTONES:
            self._closed.popitem(last=False)
        self.counts["released"] += 1

    # ---- the decode's side: the ROUTER ---------------------------------------------------

    def _spawn(self, job: Any) -> None:
        task = asyncio.ensure_future(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2:
                self.counts["refused"] += 1
                log.error("vllm-mooncake: a message of %d frames refused", len(frames))
                if len(frames) > 1:
                    await self._reply(frames[0], ERROR, [], "expected one msgpack frame")
                continue
            self._spawn(self._message(frames[0], frames[1]))

    async def _message(self, who: bytes, payload: bytes) -> None:
        reqs: list[str] = []
        tids: list[str] = []
        try:
            meta = messages.decode_metadata(payload)
            reqs = list(meta.req_blocks)
            tids = [tid for tid, _ in meta.req_blocks.values()]
            regions = None
            if any(groups for _, groups in meta.req_blocks.values()):
                regions = geometry.check_metadata(meta, self.shape, self.settings)
            jobs = [
                self._request(meta, regions, d_req, tid, groups)
                for d_req, (tid, groups) in meta.req_blocks.items()
            ]
            results = await asyncio.gather(*jobs)
        except InvalidRequest as exc:
            self.counts["refused"] += 1
            log.error("vllm-mooncake: refused a decode's message for %s: %s", reqs, exc)
            await self._reply(who, ERROR, reqs, str(exc))
            for tid in tids:  # its decode request fails: nothing will ask for these again
                self._finish(tid, f"refused: {exc}")
            return
        failed = [(d, err) for d, err in zip(reqs, results, strict=True) if err]
        for d_req, err in failed:
            log.error("vllm-mooncake: request %s failed: %s", d_req, err)
        ok = [d for d, err in zip(reqs, results, strict=True) if not err]
        status = ERROR if failed and not ok else FINISH  # vLLM's: FINISH with err_reqs if some
        msg = "; ".join(err for _, err in failed) or None
        answer = XferResponse(status, ok or None, [d for d, _ in failed] or None, msg)
        await self._send(who, answer)

    async def _reply(self, who: bytes, status: int, reqs: list[str], msg: str | None) -> None:
        ok, err = (None, reqs) if status == ERROR else (reqs, None)
        await self._send(who, XferResponse(status, ok_reqs=ok, err_reqs=err, err_msg=msg))

    async def _send(self, who: bytes, answer: XferResponse) -> None:
        with contextlib.suppress(Exception):  # a peer gone: nothing to tell
            await self._sock.send_multipart([who, messages.encode(answer)])

    async def _request(
        self,
        meta: messages.XferMetadata,
        regions: geometry.Regions | None,
        d_req: str,
        tid: str,
        groups: list[list[int]],
    ) -> str | None:
        """Serve one request of a message: None, or why it failed."""
        if not groups:  # release-only: the decode needs nothing (a local hit, or it failed)
            self.counts["release_only"] += 1
            self._finish(tid, "released by the decode")
            return None
        if len(groups) != 1:
            return f"req_blocks: {len(groups)} KV groups, this prefill node exports one"
        if tid in self._closed:
            return f"transfer_id {tid!r}: {self._closed[tid]}"
        t = self._open.get(tid) or self._opened(tid)
        if t is None:
            return "too many vLLM transfers open"
        t.need = max(t.need, meta.remote_tp_size)
        rank = meta.remote_tp_rank
        try:
            await asyncio.shield(t.ready)
            assert regions is not None
            plan = geometry.plan(regions, groups[0], t.num_tokens)
            t.busy += 1
            try:
                loop = asyncio.get_running_loop()
                kv = (t.export.keys, t.export.values)  # mapped here, on the loop
                job = self._pool.submit(self._write, kv, regions, plan)
                pack_s, write_s = await asyncio.wrap_future(job, loop=loop)
            finally:
                t.busy -= 1
            self.counts["written"] += 1
            self.counts["bytes"] += plan.nbytes
            self.seconds["pack"] += pack_s
            self.seconds["write"] += write_s
            return None
        except InvalidRequest as exc:
            self.counts["failed"] += 1
            return str(exc)
        except Exception as exc:  # the write failed: the decode is told, the channel goes on
            self.counts["failed"] += 1
            return f"transfer failed: {exc}"
        finally:
            t.answered.add(rank)
            done = t.closing or (len(t.answered) >= t.need and "done")
            if done and not t.busy and self._open.get(tid) is t:
                self._finish(tid, done)

    def _write(
        self, kv: tuple[Any, Any], regions: geometry.Regions, plan: geometry.Plan
    ) -> tuple[float, float]:
        """On a thread: pack the pages into a fresh registered staging buffer, write them
        with one batch_transfer_sync_write, unregister; (seconds packing, seconds writing)."""
        started = time.perf_counter()
        buf = self._staging.take(plan.nbytes)
        try:
            pages.pack(
                *kv,
                regions.geometry,
                layers=regions.layers,
                first_head=regions.first_head,
                first_block=plan.first_block,
                num_blocks=plan.num_blocks,
                out=memoryview(buf.mm)[: plan.nbytes],
            )
            packed = time.perf_counter()
            src = [buf.addr + s for s in plan.src_offsets]
            rc = self._te.batch_transfer_sync_write(regions.session, src, plan.dst, plan.lengths)
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_write to {regions.session}: {rc}")
        finally:
            self._staging.give(buf)
        done = time.perf_counter()
        return packed - started, done - packed
