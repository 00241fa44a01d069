"""asyncio support: endpoints and listeners progress from the running loop.

The worker's epoll descriptor is watched with loop.add_reader; whenever it is
readable the loop runs one round of non-blocking progress and wakes every
coroutine waiting on that worker, which then re-checks its own operation.
Nothing here blocks the loop.
"""
from __future__ import annotations

import asyncio
import weakref

from fabric.errors import Timeout

_drivers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Driver:
    """Progress of one worker from one event loop."""

    def __init__(self, worker, loop):
        self.worker = worker
        self.loop = loop
        self.waiters: set = set()
        self.fd = worker.fileno()
        self.notify_fd = worker.notify_fileno()
        self.watching = False

    def _on_ready(self):
        self.worker.progress()
        self._wake()

    def _on_notified(self):
        self.worker.drain_notify()
        self._on_ready()

    def _watch(self, on):
        if on and not self.watching:
            self.worker.loop_watch(True)
            self.loop.add_reader(self.fd, self._on_ready)
            self.loop.add_reader(self.notify_fd, self._on_notified)
            self.watching = True
        elif not on and self.watching:
            self.loop.remove_reader(self.fd)
            self.loop.remove_reader(self.notify_fd)
            self.worker.loop_watch(False)
            self.watching = False

    def _wake(self):
        waiters, self.waiters = self.waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, deadline=None):
        """Return after the next round of progress (or at once if progress is
        possible now); raise Timeout past deadline (loop time)."""
        if not self.worker.arm():
            await asyncio.sleep(0)
            return
        if deadline is not None and self.loop.time() >= deadline:
            raise Timeout("operation timed out")
        fut = self.loop.create_future()
        self.waiters.add(fut)
        self._watch(True)
        handle = None
        if deadline is not None:
            handle = self.loop.call_at(deadline, lambda: fut.done() or fut.set_result(None))
        try:
            await fut
        finally:
            self.waiters.discard(fut)
            if handle is not None:
                handle.cancel()
            if not self.waiters:
                # Stop watching only after this turn of the loop: a waiter
                # that re-checks and waits again keeps the watch without churn.
                self.loop.call_soon(self._maybe_unwatch)

    def _maybe_unwatch(self):
        if not self.waiters:
            self._watch(False)


def driver(worker) -> _Driver:
    loop = asyncio.get_running_loop()
    per_loop = _drivers.setdefault(worker, {})
    d = per_loop.get(loop)
    if d is None:
        d = per_loop[loop] = _Driver(worker, loop)
    return d


_recv_locks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _recv_lock(ep) -> asyncio.Lock:
    lock = _recv_locks.get(ep)
    if lock is None:
        lock = _recv_locks[ep] = asyncio.Lock()
    return lock


def _deadline(loop, timeout):
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError("timeout must be >= 0 or None")
    return loop.time() + timeout


async def recv(ep, buf=None, timeout=None):
    """Endpoint.recv / recv_into for asyncio; receives are served in call order."""
    d = driver(ep.worker)
    deadline = _deadline(d.loop, timeout)
    async with _recv_lock(ep):
        try:
            while True:
                result = ep._try_recv(buf)
                if result is not None:
                    return result
                await d.wait(deadline)
        except BaseException:
            ep._cancel_recv()
            raise


async def send(ep, obj, timeout=None):
    """Endpoint.send for asyncio. Cancelling it does not stop the message
    (the buffer stays referenced until the transfer finishes)."""
    d = driver(ep.worker)
    deadline = _deadline(d.loop, timeout)
    req = ep.isend(obj)
    while not req.done():
        await d.wait(deadline)
    req.wait(0)


async def wait_request(req, timeout=None):
    d = driver(req.endpoint.worker)
    deadline = _deadline(d.loop, timeout)
    while not req.done():
        await d.wait(deadline)
    req.wait(0)


async def accept(listener, timeout=None):
    d = driver(listener.worker)
    deadline = _deadline(d.loop, timeout)
    while True:
        ep = listener._try_accept()
        if ep is not None:
            return ep
        await d.wait(deadline)


async def close(ep, linger=None):
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, ep.close, linger)
