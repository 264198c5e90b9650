"""Notifier: counting, blocking waits with timeouts, async waits, and close waking waiters."""

from __future__ import annotations

import asyncio
import fcntl
import os
import threading
import time

import pytest

from aioprefill.errors import AioprefillError
from aioprefill.shm.notify import Notifier, NotifierClosed


@pytest.fixture
def notifier():
    n = Notifier()
    yield n
    n.close()


def test_counts_and_drain(notifier: Notifier):
    assert notifier.drain() == 0
    for _ in range(3):
        notifier.notify()
    assert notifier.drain() == 3
    assert notifier.drain() == 0


def test_flags(notifier: Notifier):
    fd = notifier.fileno()
    assert not os.get_blocking(fd)
    assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC


def test_wrap_existing_fd_sets_flags_and_owns_it():
    raw = os.eventfd(0)  # blocking, inheritable: as a child might receive it
    os.set_inheritable(raw, True)
    n = Notifier(fd=raw)
    try:
        assert not os.get_blocking(raw)
        assert not os.get_inheritable(raw)
        os.eventfd_write(raw, 2)
        assert n.wait(0) is True
    finally:
        n.close()
    with pytest.raises(OSError):
        os.fstat(raw)


@pytest.mark.parametrize("fd", [-1, True, "3"])
def test_bad_fd(fd):
    with pytest.raises(ValueError):
        Notifier(fd=fd)


def test_wait_timeout(notifier: Notifier):
    assert notifier.wait(0) is False
    start = time.monotonic()
    assert notifier.wait(0.05) is False
    assert time.monotonic() - start >= 0.05


def test_wait_pending_returns_at_once(notifier: Notifier):
    notifier.notify()
    assert notifier.wait() is True
    assert notifier.drain() == 0


@pytest.mark.timeout(10)
def test_wait_wakes_on_notify_from_another_thread(notifier: Notifier):
    timer = threading.Timer(0.02, notifier.notify)
    timer.start()
    try:
        assert notifier.wait(5) is True
    finally:
        timer.join()


def test_closed_refuses():
    n = Notifier()
    n.close()
    n.close()  # idempotent
    assert n.closed and n.fileno() == -1
    for call in (n.notify, n.drain, lambda: n.wait(0)):
        with pytest.raises(NotifierClosed):
            call()
    assert issubclass(NotifierClosed, AioprefillError)


def test_failed_init_is_safe_to_close():
    n = Notifier.__new__(Notifier)
    n.close()


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_wait_async(notifier: Notifier):
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, notifier.notify)
    assert await notifier.wait_async() == 1
    notifier.notify()
    notifier.notify()
    assert await notifier.wait_async() == 2  # already pending: no loop round trip


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_wait_async_from_a_thread(notifier: Notifier):
    timer = threading.Timer(0.02, notifier.notify)
    timer.start()
    try:
        assert await asyncio.wait_for(notifier.wait_async(), 5) == 1
    finally:
        timer.join()


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_close_wakes_async_waiters(notifier: Notifier):
    fd = notifier.fileno()
    waiters = [asyncio.create_task(notifier.wait_async()) for _ in range(2)]
    await asyncio.sleep(0.01)
    assert not any(w.done() for w in waiters)
    notifier.close()
    for w in waiters:
        with pytest.raises(NotifierClosed):
            await w
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(NotifierClosed):
        await notifier.wait_async()


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_cancelled_wait_leaves_things_clean(notifier: Notifier):
    waiter = asyncio.create_task(notifier.wait_async())
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    notifier.notify()  # nobody waits: the loop must not spin on the readable fd
    await asyncio.sleep(0.01)
    assert notifier.drain() == 1
    asyncio.get_running_loop().call_later(0.01, notifier.notify)
    assert await asyncio.wait_for(notifier.wait_async(), 5) == 1


@pytest.mark.asyncio
@pytest.mark.timeout(10)
async def test_two_waiters_each_get_a_wake_up(notifier: Notifier):
    first = asyncio.create_task(notifier.wait_async())
    second = asyncio.create_task(notifier.wait_async())
    await asyncio.sleep(0.01)
    notifier.notify()
    done, pending = await asyncio.wait({first, second}, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and next(iter(done)).result() == 1
    notifier.notify()
    assert await asyncio.wait_for(pending.pop(), 5) == 1
