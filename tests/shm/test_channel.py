"""Channel: frames across a real process boundary, back-pressure, timeouts, close."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import threading

import msgspec
import pytest
import shm_children

from aioprefill.errors import FrameTooLarge, ProtocolError
from aioprefill.shm.channel import Channel, ChannelSpec
from aioprefill.shm.notify import NotifierClosed


@pytest.fixture
def channel():
    ch = Channel.create(256, tag="chan")
    yield ch
    ch.close()
    ch.unlink()


def attach_copy(ch: Channel) -> Channel:
    """The other end, attached in this process on duplicated fds (as a child would get them)."""
    return Channel.attach(ch.spec, *(os.dup(fd) for fd in ch.fds()))


def test_spec_round_trips_through_msgspec(channel: Channel):
    data = msgspec.msgpack.encode(channel.spec)
    assert msgspec.msgpack.decode(data, type=ChannelSpec) == channel.spec
    assert channel.spec.capacity == 256


def test_attach_refuses_a_capacity_mismatch(channel: Channel):
    fds = [os.dup(fd) for fd in channel.fds()]
    spec = ChannelSpec(ring=channel.spec.ring, capacity=512)
    with pytest.raises(ProtocolError, match="capacity"):
        Channel.attach(spec, *fds)
    for fd in fds:  # ownership was taken: closed on failure
        with pytest.raises(OSError):
            os.fstat(fd)


def test_send_nowait_and_recv(channel: Channel):
    other = attach_copy(channel)
    try:
        assert other.recv_nowait() is None
        assert other.wait_blocking(0) is False
        assert channel.send_nowait(b"a", b"bc")
        assert other.wait_blocking(0) is True
        view = other.recv_nowait()
        assert view is not None and bytes(view) == b"abc"
        other.release()
        assert channel.space.drain() == 1  # type: ignore[union-attr]  # one per release
        with pytest.raises(FrameTooLarge):
            channel.send_nowait(b"x" * (channel.max_frame + 1))
    finally:
        other.close()


def test_send_blocking_times_out_then_proceeds(channel: Channel):
    other = attach_copy(channel)
    try:
        frame = b"x" * channel.max_frame
        assert channel.send_blocking(frame, timeout=0)
        assert channel.send_blocking(frame, timeout=0)
        assert channel.send_blocking(frame, timeout=0.02) is False  # full

        def consume() -> None:
            assert other.recv_blocking(timeout=5) is not None
            other.release()

        timer = threading.Timer(0.02, consume)
        timer.start()
        try:
            assert channel.send_blocking(frame, timeout=5) is True
        finally:
            timer.join()
        assert other.recv_blocking(timeout=0) is not None
    finally:
        other.close()


def test_recv_blocking_timeout(channel: Channel):
    assert channel.recv_blocking(timeout=0.01) is None


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_async_send_waits_for_space(channel: Channel):
    other = attach_copy(channel)
    try:
        sent = 0
        while channel.send_nowait(bytes([sent]) * 100):
            sent += 1
        assert sent == 2  # 2 x 112 bytes of 256
        blocked = asyncio.create_task(channel.send(bytes([sent]) * 100))
        await asyncio.sleep(0.02)
        assert not blocked.done()  # waits, does not spin or give up
        view = await other.recv()
        assert bytes(view) == bytes([0]) * 100
        other.release()  # frees space: the waiting send proceeds
        await asyncio.wait_for(blocked, 5)
        for i in range(1, 3):
            view = await other.recv()
            assert bytes(view) == bytes([i]) * 100
            other.release()
        assert other.recv_nowait() is None
    finally:
        other.close()


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_close_wakes_a_waiting_receiver(channel: Channel):
    waiter = asyncio.create_task(channel.wait_async())
    await asyncio.sleep(0.01)
    channel.close()
    with pytest.raises(NotifierClosed):
        await waiter
    assert channel.closed


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_round_trip_across_processes():
    """Frames of random sizes (empty to max_frame, more than fit at once) go to a spawned
    process over one channel and come back reversed over another; order and bytes hold."""
    seed = random.randrange(2**32)
    print(f"seed={seed}")
    rng = random.Random(seed)
    to_child = Channel.create(4096, tag="to-child")
    from_child = Channel.create(4096, tag="from-child")
    frames = [
        rng.randbytes(rng.choice([0, 1, 7, 8, 9, 100, 1000, to_child.max_frame]))
        for _ in range(300)
    ]
    ctx = mp.get_context("spawn")
    proc = ctx.Process(
        target=shm_children.echo,
        args=(
            (to_child.spec.ring, to_child.spec.capacity),
            tuple(shm_children.PassFd(fd) for fd in to_child.fds()),
            (from_child.spec.ring, from_child.spec.capacity),
            tuple(shm_children.PassFd(fd) for fd in from_child.fds()),
            len(frames),
        ),
    )
    try:
        proc.start()

        async def produce() -> None:
            for frame in frames:
                await to_child.send(frame[: len(frame) // 2], frame[len(frame) // 2 :])

        producer = asyncio.create_task(produce())
        for expected in frames:
            view = await asyncio.wait_for(from_child.recv(), 20)
            assert bytes(view) == expected[::-1]
            from_child.release()
        await asyncio.wait_for(producer, 20)
        await asyncio.get_running_loop().run_in_executor(None, proc.join, 20)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        for ch in (to_child, from_child):
            ch.close()
            ch.unlink()
