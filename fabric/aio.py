"""asyncio support: endpoints and listeners progress from the running loop.

One reader per Fabric and loop: the worker's epoll descriptor (every endpoint
of the Fabric is in it, and a fabric like UCX adds one descriptor for all of
its connections). When it is readable the loop progresses only what has
events (Worker.poll_events) and wakes only the coroutines waiting on the
endpoints and listeners that moved: O(events), not O(connections), so one
loop serves thousands of endpoints. Progress made by other threads (or the
Fabric's progress thread) reaches the loop through a second descriptor
(notify_fileno) with the same list of what moved.

Connecting needs no thread: the loop connects a non-blocking socket and the
handshake runs like any other traffic. Nothing here blocks the loop.
Cancelling any of these coroutines leaves the endpoint usable (a receive
that completed meanwhile is kept for the next one) or cleanly closed (a
connect or accept in progress).
"""
from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import weakref

from fabric.errors import ConnectionClosed, ConnectionLost, Timeout

ANY = 0          # wait key: wake on any progress of the worker


class _Waiters:
    """Every coroutine waiting on one worker, whatever loop it runs in: the
    loop that drains the worker's list of what moved may not be the one
    whose coroutine waits for it (a Fabric shared by two threads' loops)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.by_key: dict[int, set] = {}

    def add(self, key, fut):
        with self.lock:
            self.by_key.setdefault(key, set()).add(fut)

    def discard(self, key, fut):
        with self.lock:
            futures = self.by_key.get(key)
            if futures is not None:
                futures.discard(fut)
                if not futures:
                    del self.by_key[key]

    def take(self, keys):
        out = []
        with self.lock:
            for key in keys:
                futures = self.by_key.pop(key, None)
                if futures:
                    out.extend(futures)
            futures = self.by_key.pop(ANY, None)
            if futures:
                out.extend(futures)
        return out

    def take_all(self):
        with self.lock:
            waiters, self.by_key = self.by_key, {}
        return [f for futures in waiters.values() for f in futures]


def _resolve(futures, loop):
    for fut in futures:
        fut_loop = fut.get_loop()
        if fut_loop is loop:
            _resolve_one(fut)
        elif not fut_loop.is_closed():
            fut_loop.call_soon_threadsafe(_resolve_one, fut)


class _Driver:
    """Progress of one worker from one event loop."""

    def __init__(self, worker, loop):
        self.worker = worker
        self._loop = weakref.ref(loop)
        if worker.aio_waiters is None:
            worker.aio_waiters = _Waiters()
        self.shared = worker.aio_waiters
        self.nwaiters = 0
        self.watchers: dict[int, object] = {}      # key -> callback, run when that object moves
        self.fd = -1
        self.notify_fd = -1
        self.watching = False

    @property
    def loop(self):
        return self._loop()

    # -- progress from the loop
    def _run(self):
        try:
            keys = self.worker.poll_events()
        except Exception:
            keys = []
        if self.worker.closed:
            _resolve(self.shared.take_all(), self.loop)
            for fn in list(self.watchers.values()):
                fn()
            self.watchers.clear()
            self._watch(False)
            return
        futures = self.shared.take(keys)
        if futures:
            _resolve(futures, self.loop)
        if self.watchers:
            for key in keys:
                fn = self.watchers.get(key)
                if fn is not None:
                    fn()
        # poll_events() stops after a few rounds even when there is more to
        # do (a large transfer moving a piece per round) and leaves what it
        # touched unarmed: unless armed now, the descriptor may never become
        # readable for it, and only the progress thread's one-second watch of
        # a silent loop would move it (the first 1 MiB call of a fresh
        # fabric+tcp server took 1 s in one run of twenty).
        if self.watching and not self.worker.closed and not self.worker.arm():
            loop = self.loop
            if loop is not None:
                loop.call_soon(self._run)

    def _on_notified(self):
        self.worker.drain_notify()
        self._run()

    def _watch(self, on):
        loop = self.loop
        if on and not self.watching and loop is not None and not self.worker.closed:
            self.fd = self.worker.fileno()
            self.notify_fd = self.worker.notify_fileno()
            self.worker.loop_watch(True)
            loop.add_reader(self.fd, self._run)
            loop.add_reader(self.notify_fd, self._on_notified)
            self.worker.loop_users += 1
            self.watching = True
        elif not on and self.watching:
            self.watching = False
            try:
                if loop is not None and not loop.is_closed():
                    loop.remove_reader(self.fd)
                    loop.remove_reader(self.notify_fd)
            finally:
                self.worker.loop_watch(False)
                self.worker._loop_detached()

    async def wait(self, obj, seen, deadline=None):
        """Return after obj (an Endpoint, a Listener, or the Worker for
        "anything") moved since its _gen was `seen` (read before the caller
        last checked its condition: a move between that check and this wait
        is not missed), or at once if progress is possible now; raise Timeout
        past deadline (loop time)."""
        if self.worker.closed:
            raise ConnectionClosed("the Fabric is closed")
        if not self.worker.arm():
            self._run()
            await asyncio.sleep(0)
            return
        loop = self.loop
        if deadline is not None and loop.time() >= deadline:
            raise Timeout("operation timed out")
        key = ANY if obj is self.worker else obj.key
        fut = loop.create_future()
        self.shared.add(key, fut)
        self.nwaiters += 1
        handle = None
        try:
            # Watch first, compare second: the engine queues moves for
            # poll_events() only once a loop is attached (the first _watch),
            # so a move before that is seen only by the comparison below.
            # Compared first, a move between the two was lost until the
            # deadline (the first coroutine of a loop, with the progress
            # thread delivering).
            self._watch(True)
            if obj._gen != seen:
                fut.set_result(None)             # it moved while we were getting here
            if deadline is not None:
                handle = loop.call_at(deadline, _resolve_one, fut)
            await fut
        finally:
            self.nwaiters -= 1
            self.shared.discard(key, fut)
            if handle is not None:
                handle.cancel()
            if not self.nwaiters:
                # Stop watching only after this turn of the loop: a waiter
                # that re-checks and waits again keeps the watch without churn.
                loop.call_soon(self._maybe_unwatch)

    def _maybe_unwatch(self):
        if not self.nwaiters and not self.watchers:
            self._watch(False)

    def watch(self, obj, fn):
        """Call fn() (in this loop) each time obj moves, until unwatch(obj):
        an event-driven reader instead of a coroutine waiting in turns. fn
        drains what it can (its receives do not block) and calls rearm()."""
        if self.worker.closed:
            raise ConnectionClosed("the Fabric is closed")
        self.watchers[obj.key] = fn
        self._watch(True)

    def unwatch(self, obj):
        if self.watchers.pop(obj.key, None) is not None and not self.watchers and not self.nwaiters:
            loop = self.loop
            if loop is not None and not loop.is_closed():
                loop.call_soon(self._maybe_unwatch)

    def rearm(self):
        """After a watcher drained without blocking: the worker's descriptor
        is armed for the next event, or (progress is possible now) the
        watchers run again soon."""
        if not self.worker.closed and not self.worker.arm():
            loop = self.loop
            if loop is not None:
                loop.call_soon(self._run)


def _resolve_one(fut):
    if not fut.done():
        fut.set_result(None)


def driver(worker) -> _Driver:
    loop = asyncio.get_running_loop()
    drivers = worker.aio_drivers
    if drivers is None:
        drivers = worker.aio_drivers = weakref.WeakKeyDictionary()
    d = drivers.get(loop)
    if d is None:
        d = drivers[loop] = _Driver(worker, loop)
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
                seen = ep._gen
                result = ep._try_recv(buf)
                if result is not None:
                    return result
                try:
                    await d.wait(ep, seen, deadline)
                except Timeout:
                    # what arrived by the deadline still counts
                    result = ep._try_recv(buf)
                    if result is not None:
                        return result
                    raise Timeout("no message arrived in time") from None
        except BaseException:
            # The buffer may be posted to the peer (or a read into it be
            # landing): wait, without blocking the loop, until nothing can
            # write into it any more; the engine bounds this by
            # handshake_timeout. A second cancellation does not cut it short.
            while not ep._withdraw_step():
                seen = ep._gen
                try:
                    await d.wait(ep, seen, d.loop.time() + 0.05)
                except (Timeout, asyncio.CancelledError):
                    pass
                except ConnectionClosed:
                    break
            ep._cancel_recv()
            raise


async def send(ep, obj, timeout=None):
    """Endpoint.send for asyncio. Cancelling it does not stop the message
    (the buffer stays referenced until the transfer finishes)."""
    d = driver(ep.worker)
    deadline = _deadline(d.loop, timeout)
    req = ep.isend(obj)
    while True:
        seen = ep._gen
        if req.done():
            break
        await d.wait(ep, seen, deadline)
    req.wait(0)


async def wait_request(req, timeout=None):
    ep = req.endpoint
    d = driver(ep.worker)
    deadline = _deadline(d.loop, timeout)
    while True:
        seen = ep._gen
        if req.done():
            break
        await d.wait(ep, seen, deadline)
    req.wait(0)


async def accept(listener, timeout=None):
    d = driver(listener.worker)
    deadline = _deadline(d.loop, timeout)
    while True:
        seen = listener._gen
        ep = listener._try_accept()
        if ep is not None:
            return ep
        await d.wait(listener, seen, deadline)


async def close(ep, linger=None):
    """Endpoint.close for asyncio: the loop keeps running while queued sends
    drain (at most `linger` seconds)."""
    if ep.closed:
        ep.close(linger=0)
        return
    d = driver(ep.worker)
    linger = ep.worker.options["close_linger"] if linger is None else linger
    deadline = d.loop.time() + max(0.0, linger)
    try:
        if not ep._close_begin():
            while True:
                seen = ep._gen
                if ep._drained():
                    break
                await d.wait(ep, seen, deadline)
    except Timeout:
        pass
    finally:
        ep.close(linger=0)


async def close_fabric(worker, linger=None):
    """Fabric.aclose: every endpoint drains (at most `linger` seconds) while
    the loop runs, then everything is closed."""
    if worker.closed:
        return
    d = driver(worker)
    linger = worker.options["close_linger"] if linger is None else linger
    deadline = d.loop.time() + max(0.0, linger)
    try:
        if not worker._close_begin():
            while True:
                seen = worker._gen
                if worker._all_drained():
                    break
                await d.wait(worker, seen, deadline)
    except (Timeout, ConnectionClosed):
        pass
    finally:
        worker.close(linger=0)


def _numeric_addresses(host, port):
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.version == 6:
        return [(socket.AF_INET6, (host, port, 0, 0))]
    return [(socket.AF_INET, (host, port))]


async def connect(worker, host, port, timeout=None):
    """Worker.connect for asyncio: the loop connects a non-blocking socket
    (no executor thread for numeric addresses), then the handshake runs."""
    loop = asyncio.get_running_loop()
    deadline = _deadline(loop, timeout)
    addresses = _numeric_addresses(host, port)
    if addresses is None:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = [(family, addr) for family, _, _, _, addr in infos]
    # a busy listener may drop a connection before answering it: try again
    # (like connect(), within the timeout, else the handshake timeout)
    retry_until = deadline if deadline is not None else loop.time() + float(worker.options["handshake_timeout"])
    backoff = 0.01
    while True:
        ep = await _connect_once(worker, loop, host, port, addresses, deadline)
        if ep._state() > 0:
            return ep
        if ep._retryable() and loop.time() + backoff < retry_until:
            ep.close(linger=0)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.25)
            continue
        error = ep._connect_error(f"connect to {host}:{port}")
        ep.close(linger=0)
        raise error


async def _connect_once(worker, loop, host, port, addresses, deadline):
    """One connection attempt: an Endpoint that opened or failed (its
    failure says whether another attempt may succeed)."""
    last = None
    sock = None
    for family, addr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            remaining = None if deadline is None else max(0.0, deadline - loop.time())
            await asyncio.wait_for(loop.sock_connect(sock, addr), remaining)
            break
        except asyncio.TimeoutError:
            sock.close()
            raise Timeout(f"connect to {host}:{port} timed out") from None
        except OSError as e:
            sock.close()
            sock = None
            last = e
        except BaseException:
            sock.close()
            raise
    if sock is None:
        reason = last.strerror if last is not None and last.strerror else last
        raise ConnectionLost(f"cannot connect to {host}:{port}: {reason}")
    ep = worker._attach_connected(sock.detach(), True, host)
    d = driver(worker)
    hs = loop.time() + float(worker.options["handshake_timeout"])
    hs_deadline = hs if deadline is None else min(hs, deadline)
    try:
        while True:
            seen = ep._gen
            ep._poll()
            if ep._state() != 0:
                break
            try:
                await d.wait(ep, seen, hs_deadline)
            except Timeout:
                raise Timeout(f"connect to {host}:{port}: no handshake from the peer") from None
    except BaseException:
        ep.close(linger=0)
        raise
    return ep
