"""One HTTP/2 connection for gRPC calls in an asyncio event loop (the
HTTP/2 state machine, HPACK and flow control are the C core's,
fabric/grpc/_h2.pyx). No threads and no task per call for I/O.

Transports:
- plain TCP (stock gRPC peers, TLS included): an asyncio Protocol whose
  data_received hands the bytes to the core at once (no reader task between
  the socket and the calls); writes go to asyncio's transport, which sends
  at once or copies what it could not send.
- fabric streams (fabric+<backend>:// targets): a reader task awaits the
  stream and reads the rest of large DATA frames straight into their
  message (direct_target); writes are started at once (the engine keeps
  their order), and only large ones that are still moving are waited for,
  by drain() and flushed().

A call waits on its stream's waiter (one future at a time), woken by
whoever handed the core the bytes that changed the stream.
"""
from __future__ import annotations

import asyncio
import collections

from fabric import errors
from fabric.grpc import _h2, _keepalive, _tls, _wire
from fabric.grpc._http2_core import LINGER, ConnectionCore, ConnectionFailed, ErrorCodes

WRITE_HIGH_WATER = 4 << 20          # bytes in flight on a transport before senders wait


class Waiter:
    """A call's wake-up in the loop: one future while someone waits."""
    __slots__ = ("fut",)

    def __init__(self):
        self.fut = None

    def wake(self):
        fut = self.fut
        if fut is not None:
            self.fut = None
            if not fut.done():
                fut.set_result(None)

    async def wait(self, loop, deadline) -> None:
        fut = self.fut = loop.create_future()
        handle = None if deadline is None else loop.call_at(deadline, self.wake)
        try:
            await fut
        finally:
            if handle is not None:
                handle.cancel()
            if self.fut is fut:
                self.fut = None


class SocketTransport(asyncio.Protocol):
    """A TCP connection (TLS or not) as an asyncio Protocol: received bytes
    go to the connection's core at once. on_made(self): (a server) the
    connection is there (make its AioConnection)."""

    def __init__(self, on_made=None):
        self.on_made = on_made
        self.conn = None
        self.transport = None
        self.peer_address = "?"
        self.tls = None
        self.eof_sent = False
        self.paused = False
        self.drained = None              # a future while writing is paused
        self.early = []                  # bytes received before the connection was attached
        self.lost = None

    # -- asyncio.Protocol
    def connection_made(self, transport):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            import socket
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.peer_address = _wire.format_address(transport.get_extra_info("peername") or ("?", 0))
        self.tls = transport.get_extra_info("ssl_object")         # None on plain TCP
        if self.on_made is not None:
            self.on_made(self)

    def check_tls(self):
        if self.tls is not None:
            _tls.check_alpn(self.tls)

    def data_received(self, data):
        conn = self.conn
        if conn is None:
            self.early.append(data)
            return
        conn._on_data(data)

    def eof_received(self):
        if self.conn is not None:
            self.conn._closed_by_peer()
        return False

    def connection_lost(self, exc):
        self.lost = exc or "closed"
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        if self.conn is not None:
            self.conn._closed_by_peer(None if exc is None else f"{type(exc).__name__}: {exc}")

    def pause_writing(self):
        self.paused = True

    def resume_writing(self):
        self.paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    # -- what AioConnection uses
    def attach(self, conn):
        self.conn = conn
        early, self.early = self.early, []
        for data in early:
            conn._on_data(data)
        if self.lost is not None:
            conn._closed_by_peer()

    def auth_context(self) -> dict:
        return _tls.auth_context(self.tls) if self.tls is not None else {}

    def write(self, items) -> None:
        t = self.transport
        if t is None or t.is_closing() or self.eof_sent:
            return
        if len(items) == 1:
            t.write(items[0])
        else:
            t.writelines(items)          # asyncio sends now or copies what is left: never kept

    async def drain(self) -> None:
        while self.paused and self.lost is None:
            if self.drained is None or self.drained.done():
                self.drained = asyncio.get_running_loop().create_future()
            await self.drained
        if self.lost is not None:
            raise ConnectionFailed("write failed: the connection is lost")

    async def flushed(self) -> None:
        return

    def shutdown_write(self) -> bool:
        """FIN (reading goes on until the peer closes); False if impossible."""
        t = self.transport
        try:
            if t is not None and t.can_write_eof() and not t.is_closing():
                t.write_eof()
                self.eof_sent = True
                return True
        except (OSError, RuntimeError):
            pass
        return False

    def start(self) -> None:
        return

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class FabricTransport:
    """A fabric.stream.Stream's endpoint, event-driven: fabric.aio calls
    _on_moved() in the loop whenever the endpoint moved, and it hands every
    message that is there to the core (no reader task in between); writes
    are started at once."""

    def __init__(self, stream):
        self.stream = stream
        self.endpoint = stream.endpoint
        self.peer_address = stream.peer_address
        self.conn = None
        self.in_flight = collections.deque()     # (request, bytes) of writes still moving
        self.in_flight_bytes = 0
        self.failed = None
        self.read_error = None
        self.driver = None
        self.direct = None                       # the buffer a read straight into a message fills
        self.draining = False

    def attach(self, conn):
        self.conn = conn

    def start(self) -> None:
        from fabric import aio
        self.driver = aio.driver(self.endpoint.worker)
        self.driver.watch(self.endpoint, self._on_moved)
        self._on_moved()

    def _on_moved(self):
        """Everything that arrived, to the core; never blocks."""
        if self.draining:
            return
        conn = self.conn
        ep = self.endpoint
        self.draining = True
        try:
            while conn.dead is None:
                if self.direct is not None:
                    try:
                        n = ep._try_recv(self.direct)
                    except errors.MessageTooLarge:
                        self.direct = None       # the message is kept: read it as bytes below
                        continue
                    if n is None:
                        break
                    self.direct = None
                    if n == 0:
                        conn._closed_by_peer()
                        return
                    conn._on_direct(n)
                else:
                    msg = ep._try_recv(None)
                    if msg is None:
                        break
                    if len(msg) == 0:
                        conn._closed_by_peer()
                        return
                    if not conn._on_data(msg):
                        return
                if conn.dead is None:
                    self.direct = conn.h2.direct_target()
        except errors.ConnectionClosed:
            conn._closed_by_peer()
            return
        except errors.FabricError as e:
            self.read_error = e
            conn._closed_by_peer(f"{type(e).__name__}: {e}")
            return
        except Exception as e:               # noqa: BLE001 - any failure ends the connection
            conn._fail(f"connection failed: {e!r}")
            return
        finally:
            self.draining = False
        if self.driver is not None and conn.dead is None:
            self.driver.rearm()

    def write(self, items) -> None:
        if self.failed is not None:
            return
        isend = self.endpoint.isend
        try:
            if len(items) == 1 or all(type(i) is bytes for i in items):
                self._started(isend(items if len(items) > 1 else items[0]))
                return
            batch = []
            for item in items:
                if type(item) is memoryview:          # a large payload: a write of its own
                    if batch:
                        self._started(isend(batch))
                        batch = []
                    self._started(isend(item))
                else:
                    batch.append(item)
            if batch:
                self._started(isend(batch))
        except errors.FabricError as e:
            self.failed = f"write failed: {e}"

    def _started(self, req) -> None:
        q = self.in_flight
        while q and q[0][0].done():              # those done since: forget them
            old, n = q.popleft()
            self.in_flight_bytes -= n
            if old.error is not None and self.failed is None:
                self.failed = f"write failed: {old.error}"
        if not req.done():
            q.append((req, req.nbytes))
            self.in_flight_bytes += req.nbytes
        elif req.error is not None and self.failed is None:
            self.failed = f"write failed: {req.error}"

    async def _wait_oldest(self) -> None:
        req, n = self.in_flight[0]
        try:
            await req.await_done()
        except errors.FabricError as e:
            if self.failed is None:
                self.failed = f"write failed: {e}"
        if self.in_flight and self.in_flight[0][0] is req:
            self.in_flight.popleft()
            self.in_flight_bytes -= n

    async def drain(self) -> None:
        while self.in_flight_bytes > WRITE_HIGH_WATER and self.failed is None:
            await self._wait_oldest()
        if self.failed is not None:
            raise ConnectionFailed(self.failed)

    async def flushed(self) -> None:
        """Until every write started so far has moved (a caller's buffer that
        may change afterwards is no longer referenced)."""
        while self.in_flight and self.failed is None:
            await self._wait_oldest()
        if self.failed is not None:
            raise ConnectionFailed(self.failed)

    def close(self) -> None:
        if self.driver is not None:
            self.driver.unwatch(self.endpoint)
            self.driver = None
            if not self.endpoint.closed:
                self.endpoint._cancel_recv()
        if self.in_flight and self.failed is None:
            # writes still moving (a GOAWAY, the last trailers) leave first:
            # the endpoint drains them (for at most its close linger), then closes
            closing = asyncio.get_running_loop().create_task(self._close_after_writes())
            _closing.add(closing)
            closing.add_done_callback(_closing.discard)
            return
        try:
            self.stream.close()
        except errors.FabricError:
            pass

    async def _close_after_writes(self):
        try:
            await self.stream.endpoint.aclose()
        except errors.FabricError:
            pass


_closing = set()            # close tasks in progress (the loop keeps only weak references to tasks)


class AioConnection(ConnectionCore):
    def __init__(self, transport, client_side: bool, max_receive: int = _wire.DEFAULT_MAX_RECEIVE,
                 on_request=None, on_close=None, trusted_peer: bool = False,
                 keepalive: _keepalive.Settings | None = None):
        self.loop = asyncio.get_running_loop()
        self.transport = transport
        self._tick_handle = None
        self.window_waiters = []
        self._failed = False
        self._init_core(client_side, max_receive, on_request, on_close, trusted_peer, keepalive)
        self._start_h2()
        transport.attach(self)
        transport.start()
        if self.keepalive is not None and keepalive.needs_timer:
            self._schedule_tick(self.loop.time() + 0.05)

    # ------------------------------------------------------------ keepalive and lifetime
    def _keepalive_tick(self):
        self._tick_handle = None
        if self.dead is not None or self.keepalive is None:
            return
        now = self.loop.time()
        ka = self.keepalive
        action, next_at = self._keepalive_due(now)
        if action == _keepalive.FAIL:
            self._fail(f"keepalive watchdog timeout: no PING ACK within {ka.settings.timeout:g} s")
            return
        if action == _keepalive.CLOSE:
            # a FIN, then the client's own close (see _http2.Connection._close_after_goaway)
            reason = "connection closed after GOAWAY (max connection age or idle)"
            shutdown = getattr(self.transport, "shutdown_write", None)
            if shutdown is None or not shutdown():
                self._fail(reason)
            else:
                self.loop.call_later(LINGER, self._fail, reason)
            return
        if next_at is not None:
            self._schedule_tick(next_at)

    def _schedule_tick(self, when) -> None:
        """The next tick replaces any scheduled one."""
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        self._tick_handle = self.loop.call_at(when, self._keepalive_tick)

    def go_away(self) -> None:
        """(server) GOAWAY: the open calls finish, new ones go elsewhere (in
        two steps: ConnectionCore._goaway_begin)."""
        self._goaway_begin()

    # ------------------------------------------------------------ what ConnectionCore needs
    def _now(self) -> float:
        return self.loop.time()

    def _write_h2(self) -> None:
        out = self.h2.take_output()
        if out is not None:
            self.transport.write(out)

    def _wake(self, stream) -> None:
        w = stream.owner
        if w is not None:
            w.wake()

    def _wake_window_waiters(self) -> None:
        waiters, self.window_waiters = self.window_waiters, []
        for w in waiters:
            w.wake()

    def _after_read(self, later, fn) -> None:
        self.loop.call_soon(fn)

    # ------------------------------------------------------------ waiting
    async def await_(self, waiter: Waiter, ready, deadline, window: bool = False) -> bool:
        """Until ready(); False on deadline (loop time)."""
        while not ready():
            if self.dead is not None:
                return ready()
            if deadline is not None and self.loop.time() >= deadline:
                return False
            if window:
                self.window_waiters.append(waiter)
            await waiter.wait(self.loop, deadline)
        return True

    # ------------------------------------------------------------ calls
    async def open_call(self, waiter: Waiter, headers, message=None, compressed: bool = False, deadline=None):
        """(client) A new stream with its request headers and, if given, its
        one request message and end of stream, written at once."""
        while True:
            self._check_alive()
            if self.goaway_last_stream is not None:
                raise ConnectionFailed("the server is going away (GOAWAY)")
            if self.h2.can_open:
                break
            if not await self.await_(waiter, lambda: self.dead is not None or self.h2.can_open or
                                     self.goaway_last_stream is not None, deadline, window=True):
                raise TimeoutError("deadline exceeded waiting for a stream")
        s = self.h2.open_stream(headers, end_stream=False)
        s.owner = waiter
        self._sent_frames()
        done = True
        if message is not None:
            done = self.h2.send_message(s, message, compressed, True)
        self._write_h2()
        if not done:
            await self._finish_message(s, waiter, deadline)
        elif message is not None and len(message) >= _h2.ZERO_COPY_MIN and type(message) is not bytes:
            await self.transport.flushed()       # the caller may change its buffer once we return
        return s

    def start_call(self, owner, headers, message, compressed: bool):
        """(client) Open a stream and send its request at once, without
        waiting: (stream, True) when all of it is written, (stream, False)
        when the windows took only part of the message (finish_message()
        sends the rest), (None, False) when no stream may be opened now."""
        self._check_alive()
        if self.goaway_last_stream is not None:
            raise ConnectionFailed("the server is going away (GOAWAY)")
        if not self.h2.can_open:
            return None, False
        s = self.h2.open_stream(headers, end_stream=False)
        s.owner = owner
        self._sent_frames()
        done = self.h2.send_message(s, message, compressed, True)
        self._write_h2()
        return s, done

    async def finish_message(self, stream, waiter: Waiter, payload, deadline) -> None:
        """The rest of a message start_call() began; once this returns, a
        caller's buffer is no longer referenced."""
        if stream.sending:
            await self._finish_message(stream, waiter, deadline)
        if len(payload) >= _h2.ZERO_COPY_MIN and type(payload) is not bytes:
            await self.transport.flushed()

    def send_headers(self, stream, headers, end_stream: bool = False, write: bool = True) -> None:
        """write=False: the frames leave with the next write (a message that follows)."""
        self._check_call(stream)
        self.h2.send_headers(stream, headers, end_stream)
        self._sent_frames()
        if write:
            self._write_h2()

    async def send_message(self, stream, waiter: Waiter, payload, end_stream: bool = False, deadline=None,
                           encoding: str | None = None, trailers=None) -> None:
        """A length-prefixed gRPC message, cut to the peer's windows; with
        trailers (a server's unary response), they follow in the same write."""
        payload, compressed = _wire.maybe_compress(payload, encoding)
        self._check_call(stream)
        self._sent_frames()
        done = self.h2.send_message(stream, payload, compressed, end_stream)
        if done and trailers is not None:
            self.h2.send_headers(stream, trailers, True)
            trailers = None
        self._write_h2()
        if not done:
            await self._finish_message(stream, waiter, deadline)
        if trailers is not None:
            self.send_headers(stream, trailers, end_stream=True)
        if len(payload) >= _h2.ZERO_COPY_MIN:
            if type(payload) is bytes:
                await self.transport.drain()
            else:
                await self.transport.flushed()   # the caller may change its buffer once we return

    async def _finish_message(self, stream, waiter: Waiter, deadline) -> None:
        """The rest of a message the windows did not take at once."""
        while True:
            ok = await self.await_(waiter, lambda: self.dead is not None or stream.reset_code is not None or
                                   stream.peer_done or self.h2.stream_send_window(stream) > 0, deadline,
                                   window=True)
            if not ok:
                raise TimeoutError("deadline exceeded while waiting for flow control")
            self._check_alive()
            if stream.peer_done or stream.reset_code is not None:
                raise ConnectionFailed(f"stream {stream.id} ended while sending")
            done = self.h2.pump(stream)
            self._write_h2()
            await self.transport.drain()
            if done:
                return

    def end_stream(self, stream) -> None:
        self._check_call(stream)
        self.h2.end_stream(stream)
        self._write_h2()

    def reset(self, stream, code=ErrorCodes.CANCEL) -> None:
        if self.dead is None:
            self.h2.reset_stream(stream, int(code))
            self._write_h2()
        elif stream.reset_code is None:
            stream.reset_code = int(code)
        self._wake(stream)
        self._wake_window_waiters()

    def take_message(self, stream):
        """Pop one message; its window goes back to the peer."""
        msg = stream.messages.popleft()
        self.h2.consume(stream, len(msg))
        if self.h2.has_output:
            self._write_h2()
        return msg

    def forget(self, stream) -> None:
        stream.owner = None
        if self.client_side and self.goaway_last_stream is not None and not self.h2.streams and self.dead is None:
            self._fail("the server went away (GOAWAY) and no call was left")

    # ------------------------------------------------------------ reading
    def _closed_by_peer(self, why=None):
        self._fail("the peer closed the connection" if why is None else f"the connection failed: {why}")

    def _on_data(self, data) -> bool:
        """Bytes from the transport to the core; False once the connection is dead."""
        if self.dead is not None:
            return False
        try:
            touched = self.h2.receive(data)
        except _h2.H2Error as e:
            self.dead = e.text
            self._write_h2()
            self._fail(e.text)
            return False
        if touched or self.h2.events:
            self._after_receive(touched, None)
        self._write_h2()
        if self.dead is not None:
            self._fail(self.dead)
            return False
        return True

    def _on_direct(self, n: int) -> None:
        touched = self.h2.direct_advance(n)
        if touched or self.h2.events:
            self._after_receive(touched, None)
        self._write_h2()

    def _fail(self, reason: str):
        first = not self._failed
        self._failed = True
        if self.dead is None:
            self.dead = reason
        for s in list(self.h2.streams.values()):
            if s.failure is None:
                s.failure = ConnectionFailed(self.dead)
            self._notify(s)
        self._wake_window_waiters()
        if first:
            if self._tick_handle is not None:
                self._tick_handle.cancel()
                self._tick_handle = None
            self.transport.close()
            if self.on_close is not None:
                self.on_close(self)

    # ------------------------------------------------------------ closing
    def close(self, graceful: bool = True) -> None:
        if graceful and self.dead is None:
            self._close_h2()
        self._fail("connection closed locally")

    @property
    def alive(self) -> bool:
        return self.dead is None and self.goaway_last_stream is None and not self.closing
