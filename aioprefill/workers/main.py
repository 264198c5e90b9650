"""The worker process: attach the channels, load the model, report ready, serve batches.

The loop blocks in `poll()` on two fds: the inbound channel's eventfd (a batch is waiting) and
a pidfd of the engine (the engine died: exit rather than linger as an orphan). Each batch is
decoded (copied out of the ring, whose slot is released at once), run through the model, and
answered with one `BatchResult` — or `BatchFailed` when the model raised — whose eventfd write
tells the engine that this forward is done. Nothing here sleeps or polls on a timer.

Heavy imports (paddle) happen here, inside the child, never in the engine process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from aioprefill.errors import ProtocolError
from aioprefill.shm import spill
from aioprefill.shm.channel import Channel
from aioprefill.wire import protocol
from aioprefill.wire.protocol import (
    BatchDone,
    BatchFailed,
    BatchResult,
    PrefillBatch,
    Ready,
    Shutdown,
    Spilled,
    StartFailed,
)
from aioprefill.workers.group import EXIT_GROUP_BROKEN, CollectiveError
from aioprefill.workers.runner import ForwardBatch, ModelRunner
from aioprefill.workers.store_hook import StoreHook, make_hook

__all__ = ["make_runner", "worker_main"]


def make_runner(spec: protocol.WorkerSpec) -> ModelRunner:
    """The worker's model; for a rank of a group, once the group has formed (its collectives
    connected), so Ready means the whole group can run."""
    from aioprefill.config import PADDLE_EXTRA_HINT, PaddleModel

    place = spec.parallel
    grouped = place.size > 1
    if isinstance(spec.model, PaddleModel) and spec.model.architecture.startswith("ModernBert"):
        from aioprefill.workers.paddle.modernbert import ModernBertRunner

        return ModernBertRunner(spec.model, spec.worker)
    if isinstance(spec.model, PaddleModel) and spec.model.is_encoder:
        from aioprefill.workers.paddle.encoder import EncoderRunner

        return EncoderRunner(spec.model, spec.worker)
    if isinstance(spec.model, PaddleModel):
        try:
            from aioprefill.workers.paddle.runner import PaddleRunner
        except ModuleNotFoundError as exc:  # EngineConfig checks first; this is the backstop
            raise ModuleNotFoundError(f"{exc}; PaddleModel needs {PADDLE_EXTRA_HINT}") from exc

        group = None
        if grouped:
            from aioprefill.workers.collectives import PaddleGroup

            group = PaddleGroup(place.rank, place.size, place.master, spec.collective_timeout_s)
        return PaddleRunner(
            spec.model,
            spec.worker,
            group=group,
            mode=place.mode if grouped else "none",
            prefix_cache_bytes=spec.prefix_cache_bytes,
            block_tokens=spec.block_tokens,
        )
    from aioprefill.workers.barrier import SocketBarrier
    from aioprefill.workers.sim import SimRunner

    barrier = None
    if grouped:
        barrier = SocketBarrier(place.rank, place.size, place.master, spec.collective_timeout_s)
    return SimRunner(
        spec.model,
        barrier,
        writes_kv=not grouped or place.mode != "tp" or place.rank == 0,
        cache_bytes=spec.prefix_cache_bytes,
        block_tokens=spec.block_tokens,
    )


def _set_process_name(name: str) -> None:
    """Name the process for `ps`/`top` (Linux truncates to 15 bytes)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this worker when its parent dies.

    The parent is the engine (spawn) or the forkserver, which exits when the engine does. The
    engine pidfd watched by the serve loop only wakes a worker that waits for a batch; this
    also ends one that is mid-forward, hung, or blocked on a result ring nobody drains. (The
    signal follows the parent *thread*: the engine starts workers from its event-loop thread.)
    """
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


WORKER_ENV_PREFIX = "AIOPREFILL_"  # the variables a worker takes from its engine (WorkerSpec.env)


def _adopt_engine_env(env: dict[str, str]) -> None:
    """Set the engine's AIOPREFILL_* variables here, dropping others: a forkserver's children
    inherit the environment the forkserver started with (its first engine's), not this engine's
    (measured: a second engine with another `AIOPREFILL_CPU_GEMM` ran the first one's products)."""
    for name in [name for name in os.environ if name.startswith(WORKER_ENV_PREFIX)]:
        if name not in env:
            del os.environ[name]
    os.environ.update(env)


def worker_main(spec_bytes: bytes, to_fds: tuple[int, int], from_fds: tuple[int, int]) -> None:
    """Entry point of a worker process (the target of `multiprocessing.Process`)."""
    started_ns = time.monotonic_ns()
    spec = protocol.decode_worker_spec(spec_bytes)
    _set_process_name(f"aioprefill-w{spec.worker}")
    _adopt_engine_env(spec.env)
    # Ctrl-C in the terminal reaches the whole process group: let the engine decide.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    inbox = Channel.attach(spec.to_worker, *to_fds)
    outbox = Channel.attach(spec.from_worker, *from_fds)
    try:
        _serve(spec, inbox, outbox, started_ns)
    except CollectiveError as exc:
        # The group is broken (a peer died or hung): exiting closes our sockets, which breaks
        # any peer still waiting at once, and the engine restarts the whole group.
        print(f"aioprefill worker {spec.worker} rank {spec.parallel.rank}: {exc}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_GROUP_BROKEN)
    finally:
        inbox.close()
        outbox.close()


def _serve(spec: protocol.WorkerSpec, inbox: Channel, outbox: Channel, started_ns: int) -> None:
    try:
        runner = make_runner(spec)
        hook = make_hook(spec, runner)  # the KV store tier (None: no kv_store)
    except Exception as exc:  # report why, then exit: the engine raises WorkerStartFailed
        msg = StartFailed(worker=spec.worker, error_type=type(exc).__name__, message=str(exc))
        outbox.send_blocking(protocol.encode(msg), timeout=5.0)
        return
    ready = Ready(
        worker=spec.worker,
        pid=os.getpid(),
        device=runner.device,
        started_ns=started_ns,
        ready_ns=time.monotonic_ns(),
        # its prefix cache (a runner without one reports 0: the engine then plans no reads)
        cache_blocks=getattr(runner, "cache_blocks", 0),
        block_bytes=getattr(runner, "block_bytes", 0),
    )
    outbox.send_blocking(protocol.encode(ready))
    try:
        _serve_batches(spec, runner, hook, inbox, outbox)
    finally:
        if hook is not None:
            hook.close()


def _serve_batches(
    spec: protocol.WorkerSpec,
    runner: ModelRunner,
    hook: StoreHook | None,
    inbox: Channel,
    outbox: Channel,
) -> None:
    poller = select.poll()
    data_fd = inbox.fds()[0]
    poller.register(data_fd, select.POLLIN)
    try:
        engine_fd = os.pidfd_open(spec.engine_pid)
    except ProcessLookupError:
        return  # the engine died while we started: nobody will send a batch or read a result
    except (OSError, AttributeError):
        engine_fd = -1  # no pidfd (kernel < 5.3): rely on PR_SET_PDEATHSIG and Shutdown
    else:
        poller.register(engine_fd, select.POLLIN)
    out_buffer = bytearray(1 << 16)
    spill_above = spill.threshold(outbox.max_frame)
    # Tensor-parallel ranks > 0 computed the same results as rank 0: they only acknowledge.
    acknowledge_only = spec.parallel.mode == "tp" and spec.parallel.rank > 0
    try:
        while True:
            for fd, _ in poller.poll():
                if fd == engine_fd:
                    return  # the engine died: nobody will read our results
            inbox.wait_blocking(0)  # consume the eventfd count
            while (view := inbox.recv_nowait()) is not None:
                try:
                    msg = protocol.decode_to_worker(view)
                finally:
                    inbox.release()
                if isinstance(msg, Shutdown):
                    return
                answer: BatchResult | BatchDone | BatchFailed = _run_batch(runner, hook, msg)
                if acknowledge_only and isinstance(answer, BatchResult):
                    answer = BatchDone(
                        answer.batch_id, answer.forward_start_ns, answer.forward_end_ns
                    )
                reply = protocol.encode_into(answer, out_buffer)
                try:
                    if len(reply) > spill_above:  # big outputs: a segment, not the ring
                        name = spill.spill(reply, spec.engine_pid)
                        outbox.send_blocking(
                            protocol.encode(Spilled(msg.batch_id, name, len(reply)))
                        )
                    else:
                        outbox.send_blocking(reply)
                finally:
                    reply.release()  # out_buffer may grow for the next reply
                if hook is not None:  # after the answer: off the caller's time to first token
                    _guarded(hook.put_written, None)
    finally:
        if engine_fd >= 0:
            os.close(engine_fd)


def _run_batch(
    runner: ModelRunner, hook: StoreHook | None, msg: PrefillBatch
) -> BatchResult | BatchFailed:
    # The forward starts when the worker holds the decoded batch: turning it into model inputs
    # (checks, arrays, tensors) is the forward's work, and the bubble is the time before it.
    start_ns = time.monotonic_ns()
    try:
        ids, offsets, tokens, start_pos, flags = msg.arrays()
        options, top_k, kv_names = msg.option_arrays()
        cache = msg.cache_arrays()
        if msg.free_ids:
            runner.free(msg.free_array())
        batch = ForwardBatch(
            request_ids=ids,
            offsets=offsets,
            tokens=tokens,
            start_pos=start_pos,
            is_last=(flags & protocol.FLAG_LAST_CHUNK).view(np.bool_),
            options=options,
            top_k=top_k,
            kv_names=kv_names,
            **_labels(msg),
            token_types=np.frombuffer(msg.token_types, np.uint8) if msg.token_types else None,
            **({} if cache is None else dict(zip(_CACHE_FIELDS, cache, strict=True))),
        )
        loaded = None
        if hook is not None:
            batch, loaded = _guarded(hook.before, (batch, None), batch)
        forward_ns = time.monotonic_ns()
        out = runner.forward(batch)
        end_ns = time.monotonic_ns()
        if hook is not None:  # its blocks are offered once the answer is sent
            hook.finished(batch, (end_ns - forward_ns) / 1e9)
    except CollectiveError:
        raise  # not this batch's fault: the group broke
    except Exception as exc:
        end_ns = time.monotonic_ns()
        with contextlib.suppress(Exception):
            runner.free(np.frombuffer(msg.request_ids, dtype="<i8"))
        tb = traceback.format_exception_only(exc)[-1].strip()
        return BatchFailed(
            batch_id=msg.batch_id,
            forward_start_ns=start_ns,
            forward_end_ns=end_ns,
            error_type=type(exc).__name__,
            message=tb,
        )
    return BatchResult(
        batch_id=msg.batch_id,
        forward_start_ns=start_ns,
        forward_end_ns=end_ns,
        request_ids=np.ascontiguousarray(out.request_ids, dtype="<i8").tobytes(),
        tokens=np.ascontiguousarray(out.tokens, dtype="<i4").tobytes(),
        logprobs=np.ascontiguousarray(out.logprobs, dtype="<f8").tobytes(),
        top_k_ids=_column(out.top_k_ids, "<i4"),
        top_k_logprobs=_column(out.top_k_logprobs, "<f4"),
        prompt_logprobs=_column(out.prompt_logprobs, "<f4"),
        embeddings=_column(out.embeddings, "<f4"),
        embed_dim=int(out.embeddings.shape[1]) if out.embeddings.size else 0,
        prompt_top_k_ids=_column(out.prompt_top_k_ids, "<i4"),
        prompt_top_k_logprobs=_column(out.prompt_top_k_logprobs, "<f4"),
        label_logprobs=_column(out.label_logprobs, "<f4"),
        loaded_tokens=b"" if loaded is None else loaded.astype("<i4").tobytes(),
        scores=_column(out.scores, "<f4"),
    )


def _guarded(step: Callable[..., Any], instead: Any, *args: Any) -> Any:
    """A store step that must never fail a batch: on a bug, log it and go on without."""
    try:
        return step(*args)
    except Exception:
        logging.getLogger("aioprefill.kvstore").exception("KV store step failed; computing")
        return instead


_CACHE_FIELDS = (
    *("read_offsets", "read_slots", "write_offsets", "write_slots", "write_first"),
    *("write_hashes", "tail_offsets", "tail_hashes"),
)


def _labels(msg: PrefillBatch) -> dict[str, np.ndarray]:
    """ForwardBatch's label_offsets / label_ids from PrefillBatch.labels, checked."""
    if not msg.labels:
        return {}
    n = msg.size
    column = np.frombuffer(msg.labels, dtype="<i4") if len(msg.labels) % 4 == 0 else None
    if column is None or len(column) < n + 1:
        raise ProtocolError(f"PrefillBatch.labels is not {n + 1} int32 offsets and ids")
    offsets, ids = column[: n + 1], column[n + 1 :]
    if offsets[0] != 0 or offsets[n] != len(ids) or np.diff(offsets).min() < 0:
        raise ProtocolError("PrefillBatch.labels offsets do not cover its ids")
    if len(ids) and ids.min() < 0:
        raise ProtocolError("PrefillBatch.labels has a negative token id")
    return {"label_offsets": offsets, "label_ids": ids}


def _column(array: np.ndarray, dtype: str) -> bytes:
    return np.ascontiguousarray(array, dtype=dtype).tobytes() if array.size else b""
