"""One HTTP/2 connection for gRPC calls in an asyncio event loop (h2 does the
HTTP/2 state machine, HPACK and flow-control bookkeeping; fabric.grpc._wire
the gRPC framing). No threads: a reader task feeds h2 and wakes the calls'
waiters; bytes h2 produces go to the transport in order, written by a writer
task (a fabric stream's write is a coroutine) or at once (a socket's
transport buffers).

Transports: plain TCP through asyncio streams (stock gRPC peers), and
fabric streams through their coroutines (fabric+<backend>:// targets)."""
from __future__ import annotations

import asyncio
import collections

import h2.errors
import h2.exceptions

from fabric import errors
from fabric.grpc import _h2_fast, _keepalive, _tls, _wire
from fabric.grpc._http2_core import (LINGER, QUEUED_HIGH_WATER, SMALL_MESSAGE, ConnectionCore,
                                     ConnectionFailed)

READ_SIZE = 1 << 20
WRITE_HIGH_WATER = 4 << 20          # bytes queued for a fabric stream before senders wait


class SocketTransport:
    """asyncio streams (plain TCP, stock gRPC peers)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.eof_sent = False               # shutdown_write(): nothing more may be written
        sock = writer.get_extra_info("socket")
        if sock is not None:
            import socket
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.peer_address = _wire.format_address(writer.get_extra_info("peername") or ("?", 0))
        self.tls = writer.get_extra_info("ssl_object")         # None on plain TCP
        if self.tls is not None:
            _tls.check_alpn(self.tls)

    def auth_context(self) -> dict:
        return _tls.auth_context(self.tls) if self.tls is not None else {}

    async def read(self):
        try:
            return await self.reader.read(READ_SIZE)
        except (ConnectionError, OSError):
            return b""

    def write(self, data) -> None:
        if not self.writer.is_closing() and not self.eof_sent:
            self.writer.write(data)

    async def drain(self) -> None:
        try:
            await self.writer.drain()
        except (ConnectionError, OSError) as e:
            raise ConnectionFailed(f"write failed: {e}") from None

    def shutdown_write(self) -> bool:
        """FIN (reading goes on until the peer closes); False if impossible."""
        try:
            if self.writer.can_write_eof() and not self.writer.is_closing():
                self.writer.write_eof()
                self.eof_sent = True
                return True
        except (OSError, RuntimeError):
            pass
        return False

    def write_own(self, view) -> None:
        self.write(view)           # asyncio sends it now or copies what is left: never kept

    async def flushed(self) -> None:
        return

    def close(self) -> None:
        self.writer.close()


class _OwnWrite:
    __slots__ = ("view",)

    def __init__(self, view):
        self.view = view

    def __len__(self):
        return self.view.nbytes


class _Marker:
    """In the write queue: resolves once everything before it was written."""
    __slots__ = ("done",)

    def __init__(self, done):
        self.done = done

    def __len__(self):
        return 0


class FabricTransport:
    """A fabric.stream.Stream through its coroutines; writes leave in order
    from one writer task."""

    def __init__(self, stream):
        self.stream = stream
        self.peer_address = stream.peer_address
        self.queue = collections.deque()
        self.queued = 0
        self.wake = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.failed = None
        self.writing = False
        self.loop = asyncio.get_running_loop()
        self.task = self.loop.create_task(self._writer())

    async def read(self):
        try:
            msg = await self.stream.aread_message()
        except errors.FabricError as e:
            self.read_error = e
            return b""
        return b"" if msg is None else msg

    async def read_into(self, buf) -> int:
        """Bytes read into buf (the fabric pulls a write that fits straight
        in), 0 at end of stream."""
        try:
            return await self.stream.aread_into(buf)
        except errors.ConnectionClosed:
            return 0
        except errors.FabricError as e:
            self.read_error = e
            return 0

    def write(self, data) -> None:
        if self.failed is not None:
            return
        self.queue.append(data)
        self.queued += len(data)
        if self.queued > WRITE_HIGH_WATER:
            self.room.clear()
        self.wake.set()

    def write_own(self, view) -> None:
        """A large payload as a write of its own: the peer's fabric gets it as
        one message it can pull straight into place (no copy here)."""
        self.write(_OwnWrite(view))

    async def flushed(self) -> None:
        """Until everything queued so far has been written (a caller's buffer
        that may change afterwards is no longer referenced)."""
        if self.queue or self.writing:
            done = self.loop.create_future()
            self.queue.append(_Marker(done))
            self.wake.set()
            await done
        if self.failed is not None:
            raise ConnectionFailed(self.failed)

    async def drain(self) -> None:
        while not self.room.is_set():
            await self.room.wait()
        if self.failed is not None:
            raise ConnectionFailed(self.failed)

    async def _writer(self):
        while True:
            await self.wake.wait()
            self.wake.clear()
            while self.queue:
                batch = []
                self.writing = True
                while self.queue:
                    item = self.queue.popleft()
                    if item is None:                   # close() after the flush
                        if batch:
                            await self._write(batch)
                        self.writing = False
                        try:
                            self.stream.close()
                        except errors.FabricError:
                            pass
                        return
                    if isinstance(item, _Marker):
                        if batch and not await self._write(batch):
                            return
                        batch = []
                        if not item.done.done():
                            item.done.set_result(None)
                        continue
                    if isinstance(item, _OwnWrite):    # small writes before it, then it alone
                        if batch and not await self._write(batch):
                            return
                        batch = []
                        if not await self._write([item.view]):
                            return
                        continue
                    batch.append(item)
                if batch and not await self._write(batch):
                    return
                self.writing = False

    async def _write(self, batch) -> bool:
        n = sum(len(b) for b in batch)
        try:
            await self.stream.awrite(batch if len(batch) > 1 else batch[0])
        except errors.FabricError as e:
            self.failed = f"write failed: {e}"
            self.writing = False
            for item in self.queue:
                if isinstance(item, _Marker) and not item.done.done():
                    item.done.set_result(None)
            self.queue.clear()
            self.room.set()
            return False
        self.queued -= n
        if self.queued <= WRITE_HIGH_WATER:
            self.room.set()
        return True

    def close(self) -> None:
        if self.queue and self.failed is None and not self.task.done():
            # what is queued (a GOAWAY, the last trailers) leaves first
            self.queue.append(None)
            self.wake.set()
            return
        self.task.cancel()
        try:
            self.stream.close()
        except errors.FabricError:
            pass


class _Signal:
    """Waiters of one stream (or of the connection's windows)."""
    __slots__ = ("waiters",)

    def __init__(self):
        self.waiters = []

    def notify(self):
        waiters, self.waiters = self.waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def wait(self, loop, deadline) -> None:
        fut = loop.create_future()
        self.waiters.append(fut)
        timer = None if deadline is None else loop.call_at(deadline, _expire, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()


def _expire(fut):
    if not fut.done():
        fut.set_result(None)


class AioStream:
    """What one HTTP/2 stream of a call has received, and its send state."""

    def __init__(self, conn: "AioConnection", stream_id: int, max_receive: int):
        self.conn = conn
        self.id = stream_id
        self.headers = None
        self.trailers = None
        self.messages = collections.deque()
        self.queued_bytes = 0
        self.unacked = 0
        self.ended = False
        self.reset_code = None
        self.failure = None
        self.peer_done = False
        self.local_closed = False
        self.assembler = _wire.MessageAssembler(max_receive)
        self.signal = _Signal()
        self.on_event = None            # callback(AioStream) on any change (server: the client went away)

    def over(self) -> bool:
        return self.failure is not None or self.reset_code is not None

    async def wait(self, predicate, deadline) -> bool:
        """Until predicate() or the stream failed or was reset; False on deadline."""
        loop = self.conn.loop
        while not (predicate() or self.over()):
            if deadline is not None and loop.time() >= deadline:
                return False
            await self.signal.wait(loop, deadline)
        return True

    def take_message(self):
        msg = self.messages.popleft()
        self.queued_bytes -= len(msg)
        if self.unacked and self.queued_bytes <= QUEUED_HIGH_WATER:
            self.conn._ack(self)
            self.conn._flush()
        return msg


class AioConnection(ConnectionCore):
    def __init__(self, transport, client_side: bool, max_receive: int = _wire.DEFAULT_MAX_RECEIVE,
                 on_request=None, on_close=None, trusted_peer: bool = False,
                 keepalive: _keepalive.Settings | None = None):
        self.loop = asyncio.get_running_loop()
        self.transport = transport
        self._tick_handle = None
        self.window_signal = _Signal()
        self._init_core(client_side, max_receive, on_request, on_close, trusted_peer, keepalive)
        self._start_h2()
        self.reader = self.loop.create_task(self._read_loop())
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
        self._flush()
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
        self._flush()

    def _new_call(self, stream_id: int) -> "AioStream":
        return AioStream(self, stream_id, self.max_receive)

    def _wake(self, call) -> None:
        call.signal.notify()

    def _wake_window_waiters(self) -> None:
        self.window_signal.notify()

    def _after_read(self, later, fn) -> None:
        self.loop.call_soon(fn)

    # ------------------------------------------------------------ writing
    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.transport.write(data)

    async def open_call(self, headers, end_stream: bool = False, deadline=None) -> AioStream:
        while True:
            if self.dead is not None:
                raise ConnectionFailed(self.dead)
            if self.goaway_last_stream is not None or self._h2_closed():
                raise ConnectionFailed("the server is going away (GOAWAY)")
            if self.h2.open_outbound_streams < self.h2.remote_settings.max_concurrent_streams:
                break
            if deadline is not None and self.loop.time() >= deadline:
                raise TimeoutError("deadline exceeded waiting for a stream")
            await self.window_signal.wait(self.loop, deadline)
        sid = self.h2.get_next_available_stream_id()
        call = AioStream(self, sid, self.max_receive)
        self.calls[sid] = call
        self.h2.send_headers(sid, headers, end_stream=end_stream)
        if end_stream:
            call.local_closed = True
        self._sent_frames()
        self._flush()
        return call

    def send_headers(self, call: AioStream, headers, end_stream: bool = False) -> None:
        self._check_call(call)
        self.h2.send_headers(call.id, headers, end_stream=end_stream)
        if end_stream:
            call.local_closed = True
        self._sent_frames()
        self._flush()

    async def send_message(self, call: AioStream, payload, end_stream: bool = False, deadline=None,
                           encoding: str | None = None) -> None:
        """A length-prefixed gRPC message, cut to the peer's windows."""
        view = memoryview(payload).cast("B")
        compressed = False
        self._sent_frames()
        if encoding is not None and encoding != "identity" and view.nbytes:
            packed = _wire.compress(view, encoding)
            if len(packed) < view.nbytes:
                view, compressed = memoryview(packed), True
        if view.nbytes >= _h2_fast.FAST_DATA_MIN and self.fast_data:
            await self._send_large(call, view, end_stream, deadline, compressed,
                                   detached=type(payload) is bytes or compressed)
            return
        head = _wire.prefix(view.nbytes, compressed)
        if view.nbytes <= SMALL_MESSAGE:
            pieces = [memoryview(head + view.tobytes())]        # one DATA frame
        else:
            pieces = [memoryview(head), view]                   # no copy of the payload: frames slice it
        for i, data in enumerate(pieces):
            last = i == len(pieces) - 1
            while True:
                self._check_call(call)
                window = min(self.h2.local_flow_control_window(call.id), self.h2.max_outbound_frame_size)
                if window <= 0:
                    if deadline is not None and self.loop.time() >= deadline:
                        raise TimeoutError("deadline exceeded while waiting for flow control")
                    await self.window_signal.wait(self.loop, deadline)
                    continue
                n = min(window, data.nbytes)
                fin = end_stream and last and n == data.nbytes
                self.h2.send_data(call.id, data[:n], end_stream=fin)
                if fin:
                    call.local_closed = True
                self._flush()
                data = data[n:]
                if not data.nbytes:
                    break
                await self.transport.drain()
        if view.nbytes > (1 << 20):
            await self.transport.drain()

    async def _send_large(self, call: AioStream, view, end_stream: bool, deadline, compressed: bool,
                          detached: bool) -> None:
        """DATA frames written by us (see _http2.Connection._send_large): each
        frame's header (the message prefix in the first) and its payload go as
        separate writes, straight from the caller's buffer, and h2's state and
        windows are charged as its send_data would."""
        prefix = _wire.prefix(view.nbytes, compressed)
        first = True
        while view.nbytes or first:
            self._check_call(call)
            room = min(self.h2.local_flow_control_window(call.id), self.h2.max_outbound_frame_size)
            head = len(prefix) if first else 0
            if room <= head:
                if deadline is not None and self.loop.time() >= deadline:
                    raise TimeoutError("deadline exceeded while waiting for flow control")
                await self.window_signal.wait(self.loop, deadline)
                continue
            n = min(room - head, view.nbytes)
            _h2_fast.charge_data_sent(self.h2, call.id, head + n)
            self._flush()                              # what h2 had queued goes first
            header = _h2_fast.frame_header(head + n, _h2_fast.DATA, 0, call.id)
            self.transport.write(header + (prefix if first else b""))
            if n:
                self.transport.write_own(view[:n])
            self.counters["fast_data_frames_sent"] += 1
            view = view[n:]
            first = False
            await self.transport.drain()
        if not detached:
            await self.transport.flushed()             # the caller may change its buffer once we return
        if end_stream:
            self.end_stream(call)

    def end_stream(self, call: AioStream) -> None:
        self._check_call(call)
        self.h2.end_stream(call.id)
        call.local_closed = True
        self._flush()

    def reset(self, call: AioStream, code=h2.errors.ErrorCodes.CANCEL) -> None:
        if call.reset_code is None:
            call.reset_code = code
        if self.dead is None:
            try:
                self.h2.reset_stream(call.id, error_code=code)
                self._flush()
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
                pass
        self.calls.pop(call.id, None)
        call.signal.notify()
        self.window_signal.notify()

    def forget(self, call: AioStream) -> None:
        self.calls.pop(call.id, None)
        if self.client_side and self.goaway_last_stream is not None and not self.calls and self.dead is None:
            self._fail("the server went away (GOAWAY) and no call was left")

    # ------------------------------------------------------------ reading
    def _closed_by_peer(self):
        why = getattr(self.transport, "read_error", None)
        self._fail("the peer closed the connection" if why is None
                   else f"the connection failed: {type(why).__name__}: {why}")

    def _feed(self, data) -> bool:
        """Bytes to h2 and its events handled; False once the connection is dead."""
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as e:
            self._flush()
            self._fail(f"HTTP/2 protocol error from the peer: {e}")
            return False
        for ev in events:
            self._handle(ev, None)
        self._flush()
        return self.dead is None

    async def _read_loop(self):
        try:
            if self.fast_data and hasattr(self.transport, "read_into"):
                await self._read_framed()
            else:
                while self.dead is None:
                    data = await self.transport.read()
                    if not data:
                        self._closed_by_peer()
                        return
                    if not self._feed(data):
                        break
            self._fail(self.dead)
        except asyncio.CancelledError:
            self._fail("connection closed locally")
            raise
        except Exception as e:               # noqa: BLE001 - any failure ends the connection
            self._fail(f"connection failed: {e!r}")

    async def _read_framed(self):
        """Frames cut here (see _http2._FramedReader): a large DATA frame of an
        open call is received by _fast_data straight into the message's
        buffer; everything else goes to h2 in order."""
        buf = memoryview(b"")
        preface = 0 if self.client_side else 24      # a client's connection preface precedes its frames
        while self.dead is None:
            more = await self.transport.read()
            if not more:
                self._closed_by_peer()
                return
            more = memoryview(more).cast("B")
            buf = memoryview(bytes(buf) + bytes(more)) if len(buf) else more
            if preface:
                if len(buf) < preface:
                    continue
                if not self._feed(bytes(buf[:preface])):
                    return
                buf, preface = buf[preface:], 0
            to_h2 = []
            while len(buf) >= 9:
                length, ftype, flags, sid = _h2_fast.parse_frame_header(buf)
                if _h2_fast.is_fast_data(self.h2, length, ftype, flags):
                    if to_h2:                            # the HEADERS that open this call may be among them
                        if not self._feed(b"".join(to_h2)):
                            return
                        to_h2 = []
                    call = self.calls.get(sid)
                    if call is not None and call.failure is None:
                        buf = await self._fast_data(call, length, buf[9:])
                        if buf is None:
                            return
                        continue
                if len(buf) < 9 + length:
                    break                                # the rest of this frame comes with the next read
                to_h2.append(buf[:9 + length])
                buf = buf[9 + length:]
            if to_h2 and not self._feed(b"".join(to_h2)):
                return

    async def _fast_data(self, call: AioStream, length: int, rest):
        """One large DATA frame of call: h2 charged as it would be, the payload
        into the call's assembler (pulled by the fabric straight into the
        message buffer where it can). What is left of the current read, or
        None once the connection is dead."""
        try:
            _h2_fast.charge_data_received(self.h2, call.id, length)
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError) as e:
            self._flush()
            self._fail(f"HTTP/2 protocol error from the peer: {e!r}")
            return None
        self.counters["fast_data_frames_received"] += 1
        asm = call.assembler
        left = length
        failure = None
        try:
            while left:
                if len(rest):
                    take = min(left, len(rest))
                    self._deliver(call, asm.feed(rest[:take]))
                    rest, left = rest[take:], left - take
                    continue
                target = asm.direct_target(left)
                if target is not None and len(target):
                    n = await self.transport.read_into(target)
                    if n == 0:
                        self._closed_by_peer()
                        return None
                    asm.advance(n)
                    left -= n
                    self._deliver(call, asm.take_done())
                    continue
                more = await self.transport.read()
                if not more:
                    self._closed_by_peer()
                    return None
                rest = memoryview(more).cast("B")
        except _wire.WireError as e:
            failure = e
        self._fast_data_taken(call, length, failure, None)
        if failure is not None:
            if self.client_side:
                self.reset(call, h2.errors.ErrorCodes.CANCEL)
            while left:                                  # the rest of this frame's payload: dropped
                if len(rest):
                    take = min(left, len(rest))
                    rest, left = rest[take:], left - take
                    continue
                more = await self.transport.read()
                if not more:
                    self._closed_by_peer()
                    return None
                rest = memoryview(more).cast("B")
        self._flush()
        return rest

    def _deliver(self, call: AioStream, messages) -> None:
        for msg in messages:
            call.messages.append(msg)
            call.queued_bytes += len(msg)

    def _fail(self, reason: str):
        first = self.dead is None or not getattr(self, "_failed", False)
        self._failed = True
        if self.dead is None:
            self.dead = reason
        for call in list(self.calls.values()):
            if call.failure is None:
                call.failure = ConnectionFailed(self.dead)
            self._notify(call)
        self.window_signal.notify()
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
        if not self.reader.done():
            self.reader.cancel()

    @property
    def alive(self) -> bool:
        return self.dead is None and self.goaway_last_stream is None
