"""One HTTP/2 connection over a byte stream, for gRPC calls (h2 does the
HTTP/2 state machine, HPACK and flow-control bookkeeping).

Threads: a reader thread per connection reads the byte stream *without*
holding the connection lock (so a peer's large write is always taken, even
while we are writing) and feeds h2 under the lock. Bytes h2 produces are
queued in order under the lock and written by whoever holds the send lock; the
reader never waits for the send lock (if it is held, the holder writes the
reader's bytes too), so two peers writing large messages to each other at once
cannot deadlock. Application threads wait on per-call conditions.
"""
from __future__ import annotations

import collections
import threading
import time
import weakref

import h2.errors
import h2.exceptions

from fabric import errors
from fabric.grpc import _h2_fast, _http2_core, _keepalive, _wire
from fabric.grpc._h2_fast import MemoHpack as _MemoHpack  # noqa: F401  (bench/h2_cost.py uses it from here)
from fabric.grpc._http2_core import (LINGER, QUEUED_HIGH_WATER, SMALL_MESSAGE, ConnectionCore,
                                     ConnectionFailed)

IDLE_CHECK_AFTER = 0.05                  # seconds without reading before a call checks the connection


class _Own:
    """A pending buffer written as a stream write of its own (so the peer's
    fabric receives it as one message it can pull straight into place).
    detached: the buffer is immutable (bytes), so the write may still be in
    flight when the sender returns (the view keeps the bytes alive)."""
    __slots__ = ("view", "detached")

    def __init__(self, view, detached=False):
        self.view = view
        self.detached = detached


MAX_DETACHED_WRITES = 4                  # large writes in flight per connection (sender pipelining)

class CallStream:
    """What one HTTP/2 stream of a call has received, and its send side."""

    def __init__(self, conn: "Connection", stream_id: int, max_receive: int):
        self.conn = conn
        self.id = stream_id
        self.cond = conn.cond
        self.headers = None                 # initial headers (list of pairs)
        self.trailers = None                # trailers (list of pairs)
        self.messages = collections.deque()
        self.queued_bytes = 0
        self.unacked = 0                    # received DATA not yet returned to the peer's window
        self.ended = False                  # END_STREAM received
        self.reset_code = None              # RST_STREAM received (or sent)
        self.failure = None                 # connection lost, protocol error, oversized message
        self.assembler = _wire.MessageAssembler(max_receive)
        self.on_event = None                # optional callback(CallStream), called without the lock
        self.local_closed = False
        self.peer_done = False              # the peer ended the call (trailers) and reset it with
                                            # NO_ERROR: our sends stop, the call succeeded (RFC 9113 8.1)

    # -- receive side (application threads)
    def wait(self, predicate, deadline: float | None) -> bool:
        """Wait (lock held by caller) until predicate() or an ending; False on deadline."""
        return self.conn.await_(lambda: predicate() or self.failure is not None or self.reset_code is not None,
                                deadline)

    def take_message(self):
        """Pop one message (lock held); reopen the window if we were holding
        it. The caller must call sent_acks() once it has released the lock."""
        msg = self.messages.popleft()
        self.queued_bytes -= len(msg)
        if self.unacked and self.queued_bytes <= QUEUED_HIGH_WATER:
            self.conn.ack(self)
        return msg

    def sent_acks(self):
        """(no lock) Write window updates take_message() queued: a sender may be
        waiting for them, and nothing else would write them soon (measured:
        30 ms stalls in 16 MiB streams)."""
        if self.conn.pending:
            try:
                self.conn.flush(block=False)
            except ConnectionFailed:
                pass


class Connection(ConnectionCore):
    def __init__(self, stream, client_side: bool, max_receive: int = _wire.DEFAULT_MAX_RECEIVE,
                 on_request=None, on_close=None, name: str = "fabric.grpc", callers_read: bool = False,
                 trusted_peer: bool = False, keepalive: _keepalive.Settings | None = None):
        self.stream = stream
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.read_lock = threading.Lock()       # the reader role
        self.cond = threading.Condition(self.lock)
        self.window_cond = self.cond            # one condition: every waiter rechecks after progress
        self.pending = []
        self.last_read = time.monotonic()
        self._local = threading.local()
        self._init_core(client_side, max_receive, on_request, on_close, trusted_peer, keepalive)
        self._writes_in_flight = collections.deque() if hasattr(stream, "write_nowait") else None
        with self.lock:
            self._start_h2()
        self.flush(block=True)
        if self.fast_data and hasattr(stream, "read_into"):
            self.reader = _FramedReader(self)
        else:
            self.reader = _PlainReader(self)
        # callers_read: no reader thread; whichever application thread waits
        # reads for everyone (no hand-off between a reader thread and the
        # caller on the way of every response). Needs a stream whose reads
        # take a timeout (fabric streams); a connection nobody waits on is
        # not read until someone does.
        self.callers_read = callers_read and isinstance(self.reader, _FramedReader)
        if not self.callers_read:
            self.reader_thread = threading.Thread(target=self._read_loop, name=f"{name}-reader", daemon=True)
            self.reader_thread.start()
        self._tick_generation = 0
        if self.keepalive is not None and keepalive.needs_timer:
            self._schedule_tick(time.monotonic() + 0.05)

    # ------------------------------------------------------------ keepalive and lifetime
    def _close_after_goaway(self):
        """No call left after our GOAWAY: end the connection with a FIN, not
        a close: closing a socket with unread input (the client's last
        WINDOW_UPDATE, say) sends RST, and a RST makes the client's kernel
        drop the responses it has not read yet. The reader sees the client's
        own close (or the time runs out) and fails the connection then."""
        reason = "connection closed after GOAWAY (max connection age or idle)"
        shutdown = getattr(self.stream, "shutdown_write", None)
        if shutdown is None:                  # a fabric stream: its own close protocol
            try:
                self.flush(block=True)
            except ConnectionFailed:
                pass
            self._fail(reason)
            return
        try:
            self.flush(block=True)
            shutdown()
        except (ConnectionFailed, errors.FabricError, OSError):
            self._fail(reason)
            return
        _keepalive.shared_timers().schedule(time.monotonic() + LINGER, lambda: self._fail(reason))

    def _schedule_tick(self, when):
        """The next tick replaces any scheduled one. The timer holds the
        connection weakly: a closed one is not kept until its tick (a
        server's idle connections tick every two hours)."""
        self._tick_generation += 1
        generation = self._tick_generation
        ref = weakref.ref(self)

        def tick():
            conn = ref()
            if conn is not None:
                conn._keepalive_tick(generation)
        _keepalive.shared_timers().schedule(when, tick)

    def _keepalive_tick(self, generation):
        """(timer thread) Pings, their watchdog, max age and idle."""
        if self.dead is not None or generation != self._tick_generation or self.keepalive is None:
            return
        if self.callers_read and self.read_lock.acquire(blocking=False):
            try:                              # nobody waits on a call: read what came (a PING ACK)
                self.reader.step(0)
            finally:
                self.read_lock.release()
        now = time.monotonic()
        with self.lock:
            if self.dead is not None:
                return
            ka = self.keepalive
            action, next_at = self._keepalive_due(now)
        if action == _keepalive.FAIL:
            self._fail(f"keepalive watchdog timeout: no PING ACK within {ka.settings.timeout:g} s")
            return
        if action == _keepalive.CLOSE:
            self._close_after_goaway()
            return
        self.flush(block=False)
        if self.callers_read and ka.ping_outstanding is not None:
            # no reader thread: look for the ACK soon (a waiting caller may read it first)
            next_at = now + 0.05 if next_at is None else min(next_at, now + 0.05)
        if next_at is not None:
            with self.lock:
                self._schedule_tick(next_at)

    def go_away(self) -> None:
        """(server) GOAWAY: the open calls finish, new ones go elsewhere."""
        with self.lock:
            self._goaway_begin()
        self.flush(block=False)

    # ------------------------------------------------------------ what ConnectionCore needs
    def _now(self) -> float:
        return time.monotonic()

    def _write_h2(self) -> None:
        self._queue()

    def _new_call(self, stream_id: int) -> "CallStream":
        return CallStream(self, stream_id, self.max_receive)

    def _wake(self, call) -> None:
        call.cond.notify_all()

    def _wake_window_waiters(self) -> None:
        self.window_cond.notify_all()

    def _after_read(self, later, fn) -> None:
        later.append(fn)

    def check_idle(self) -> None:
        """Before a call on a connection nobody has read for a while (no
        reader thread): take what came meanwhile, so a GOAWAY or a close
        by the server (idle or age limits) is seen before we send on it."""
        if self.callers_read and self.dead is None and time.monotonic() - self.last_read > IDLE_CHECK_AFTER \
                and self.read_lock.acquire(blocking=False):
            try:
                self.reader.step(0)
            finally:
                self.read_lock.release()

    # ------------------------------------------------------------ waiting
    def await_(self, predicate, deadline: float | None) -> bool:
        """(lock held) Wait until predicate(); False on deadline. With
        callers_read, the waiting thread reads for everyone while nobody else
        does."""
        while not predicate():
            if self.dead is not None:
                return predicate()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if self.callers_read and self.read_lock.acquire(blocking=False):
                self.lock.release()
                try:
                    self.reader.step(READ_SLICE if left is None else min(left, READ_SLICE))
                finally:
                    self.read_lock.release()
                    self.lock.acquire()
                    self.cond.notify_all()          # the role is free; progress may concern others
                continue
            self.cond.wait(left)
        return True

    # ------------------------------------------------------------ writing
    def cork(self):
        """with conn.cork(): the calling thread's frames leave in one write
        at the end (headers + message + end of a unary call, say)."""
        return _Cork(self)

    def _flush_app(self) -> None:
        if not getattr(self._local, "corked", 0):
            self.flush(block=True)

    def flush(self, block: bool) -> None:
        """Write queued bytes in order. block=False: leave them to the
        current writer if there is one (the reader thread uses this)."""
        if not self.send_lock.acquire(blocking=block):
            return
        held = True
        try:
            while True:
                with self.lock:
                    items = self.pending
                    self.pending = []
                    if not items:
                        self.send_lock.release()   # under the lock: a racing appender sees it free
                        held = False
                        return
                batch = []
                for item in items:
                    if isinstance(item, _Own):
                        if batch:
                            self.stream.write(batch)
                            batch = []
                        if item.detached and self._writes_in_flight is not None:
                            # ordered after everything written before it; the
                            # next message is framed while the peer pulls this one
                            while len(self._writes_in_flight) >= MAX_DETACHED_WRITES:
                                self._writes_in_flight.popleft().wait()
                            self._writes_in_flight.append(self.stream.write_nowait(item.view))
                        else:
                            self.stream.write(item.view)
                    elif item:
                        batch.append(item)
                if batch:
                    self.stream.write(batch)
        except errors.FabricError as e:
            self._fail(f"write failed: {e}")
            if block:
                raise ConnectionFailed(str(e)) from None
        finally:
            if held:
                self.send_lock.release()

    def _queue(self) -> None:
        """(lock held) Queue what h2 has produced."""
        data = self.h2.data_to_send()
        if data:
            self.pending.append(data)

    def ack(self, call: CallStream) -> None:
        """(lock held) Return received bytes of call to the peer's windows."""
        if self._ack(call):
            self._queue()

    # ------------------------------------------------------------ calls
    def open_call(self, headers, end_stream: bool = False) -> CallStream:
        """Client: a new stream with its request headers sent."""
        with self.lock:
            while True:
                self._check_alive()
                if self.goaway_last_stream is not None:
                    raise ConnectionFailed("the server is going away (GOAWAY)")
                if self.h2.open_outbound_streams < self.h2.remote_settings.max_concurrent_streams:
                    break
                self.await_(lambda: self.dead is not None or self.h2.open_outbound_streams
                            < self.h2.remote_settings.max_concurrent_streams, time.monotonic() + 1.0)
            sid = self.h2.get_next_available_stream_id()
            call = CallStream(self, sid, self.max_receive)
            self.calls[sid] = call
            self.h2.send_headers(sid, headers, end_stream=end_stream)
            self._sent_frames()
            self._queue()
        self._flush_app()
        return call

    def send_headers(self, call: CallStream, headers, end_stream: bool = False) -> None:
        with self.lock:
            self._check_call(call)
            self.h2.send_headers(call.id, headers, end_stream=end_stream)
            if end_stream:
                call.local_closed = True
            self._sent_frames()
            self._queue()
        self._flush_app()

    def send_message(self, call: CallStream, payload, end_stream: bool = False,
                     deadline: float | None = None, encoding: str | None = None) -> None:
        """A length-prefixed gRPC message, cut to the peer's windows and frame
        size; compressed with encoding (gzip, deflate) when that makes it smaller."""
        view = memoryview(payload).cast("B")
        compressed = False
        if self.keepalive is not None:
            self.keepalive.frames_sent()
        if encoding is not None and encoding != "identity" and view.nbytes:
            packed = _wire.compress(view, encoding)
            if len(packed) < view.nbytes:
                payload, view, compressed = packed, memoryview(packed), True
        if view.nbytes >= _h2_fast.FAST_DATA_MIN and self.fast_data:
            self._send_large(call, view, end_stream, deadline, detached=type(payload) is bytes,
                             compressed=compressed)
            return
        if view.nbytes <= SMALL_MESSAGE:
            pieces = [memoryview(_wire.prefix(view.nbytes, compressed) + view.tobytes())]    # one DATA frame
        else:
            pieces = [memoryview(_wire.prefix(view.nbytes, compressed)), view]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            while True:
                must_flush = False
                with self.lock:
                    while True:
                        self._check_call(call)
                        window = self.h2.local_flow_control_window(call.id)
                        if window > 0 or piece.nbytes == 0:
                            break
                        if self.pending:
                            must_flush = True       # let the peer see what we have before we wait
                            break
                        if not self._await_window(call, deadline):
                            raise TimeoutError("deadline exceeded while waiting for flow control")
                    if not must_flush:
                        n = min(window, self.h2.max_outbound_frame_size, piece.nbytes)
                        done = n == piece.nbytes
                        fin = bool(last and end_stream and done)
                        self.h2.send_data(call.id, piece[:n].tobytes() if n else b"", end_stream=fin)
                        if fin:
                            call.local_closed = True
                        self._queue()
                if must_flush:
                    self.flush(block=True)
                    continue
                if not done:
                    self.flush(block=True)          # a large message: frames leave as they are cut
                piece = piece[n:]
                if done:
                    break
        self._flush_app()

    def _window(self, call: CallStream, deadline) -> int:
        """(lock held) Bytes we may send on call now; waits for WINDOW_UPDATE.
        Returns 0 if queued bytes must be written before waiting."""
        while True:
            self._check_call(call)
            window = self.h2.local_flow_control_window(call.id)
            if window > 0:
                return window
            if self.pending:
                return 0
            if not self._await_window(call, deadline):
                raise TimeoutError("deadline exceeded while waiting for flow control")

    def _await_window(self, call: CallStream, deadline) -> bool:
        """(lock held) Wait for send window on call (or its end); False on deadline."""
        def ready():
            if self.dead is not None or call.reset_code is not None or call.failure is not None \
                    or call.peer_done:
                return True
            try:
                return self.h2.local_flow_control_window(call.id) > 0
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
                return True
        return self.await_(ready, deadline)

    def _send_large(self, call: CallStream, view: memoryview, end_stream: bool, deadline,
                    detached: bool = False, compressed: bool = False) -> None:
        """DATA frames written by us, straight from the caller's buffer: each
        frame's header (with the message prefix in the first) is one stream
        write and its payload another, so the fabric moves the payload by
        rendezvous without a copy. h2's state machine and windows are kept
        exactly as its own send_data would."""
        prefix = _wire.prefix(view.nbytes, compressed)
        first = True
        while view.nbytes or first:
            with self.lock:
                window = self._window(call, deadline)
                while window and first and min(window, self.h2.max_outbound_frame_size) < len(prefix):
                    if not self.await_(lambda: self.dead is not None or call.reset_code is not None
                                       or call.peer_done or min(
                            self.h2.local_flow_control_window(call.id), self.h2.max_outbound_frame_size)
                            >= len(prefix), deadline):
                        raise TimeoutError("deadline exceeded while waiting for flow control")
                    window = self._window(call, deadline)
                if window:
                    room = min(window, self.h2.max_outbound_frame_size)
                    head = len(prefix) if first else 0
                    n = min(room - head, view.nbytes)
                    if n < 0:
                        n = 0
                    length = head + n
                    _h2_fast.charge_data_sent(self.h2, call.id, length)
                    self._queue()                     # anything h2 had queued goes first
                    header = _h2_fast.frame_header(length, _h2_fast.DATA, 0, call.id)
                    self.pending.append(header + (prefix if first else b""))
                    self.counters["fast_data_frames_sent"] += 1
                    if n:
                        self.pending.append(_Own(view[:n], detached))
                    view = view[n:]
                    first = False
            self.flush(block=True)
        if end_stream:
            self.end_stream(call)
        else:
            self._flush_app()

    def end_stream(self, call: CallStream) -> None:
        with self.lock:
            self._check_call(call)
            self.h2.end_stream(call.id)
            call.local_closed = True
            self._queue()
        self._flush_app()

    def reset(self, call: CallStream, code=h2.errors.ErrorCodes.CANCEL) -> None:
        """RST_STREAM (cancellation); quiet if the stream is already gone."""
        with self.lock:
            if call.reset_code is None:
                call.reset_code = code
            if self.dead is None:
                try:
                    self.h2.reset_stream(call.id, error_code=code)
                    self._queue()
                except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError, KeyError):
                    pass
            self.calls.pop(call.id, None)
            call.cond.notify_all()
            self.window_cond.notify_all()
        try:
            self.flush(block=True)
        except ConnectionFailed:
            pass

    def forget(self, call: CallStream) -> None:
        with self.lock:
            self.calls.pop(call.id, None)
            drained = self.client_side and self.goaway_last_stream is not None and not self.calls \
                and self.dead is None
        if drained:                           # the server said GOAWAY and our last call is over
            self._fail("the server went away (GOAWAY) and no call was left")

    # ------------------------------------------------------------ reading
    def _read_loop(self):
        """The reader thread: holds the reader role for the connection's life."""
        with self.read_lock:
            while self.dead is None:
                self.reader.step(None)

    def _feed_h2(self, chunks) -> bool:
        """Hand bytes to h2 and act on its events; False once the connection is dead."""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        callbacks = []
        with self.lock:
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError as e:
                self._queue()
                self.dead = f"HTTP/2 protocol error from the peer: {e}"
                events = []
            for ev in events:
                self._handle(ev, callbacks)
            self._queue()
        for cb in callbacks:
            cb()
        self.flush(block=False)
        if self.dead is not None:
            self._fail(self.dead)
            return False
        return True

    def _fast_data(self, call: CallStream, length: int, rest: memoryview):
        """Receive one large DATA frame of call: h2's windows and stream state
        are charged as h2 would, the payload goes to the call's assembler
        (straight into the message buffer where it can). Returns what is left
        of the current read, or None if the connection died."""
        with self.lock:
            try:
                _h2_fast.charge_data_received(self.h2, call.id, length)
            except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError) as e:
                self.dead = f"HTTP/2 protocol error from the peer: {e!r}"
        if self.dead is not None:
            self._fail(self.dead)
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
                    rest = rest[take:]
                    left -= take
                    continue
                target = asm.direct_target(left)
                if target is not None and len(target):
                    n = self.stream.read_into(target)
                    if n == 0:
                        self._fail("the peer closed the connection")
                        return None
                    asm.advance(n)
                    left -= n
                    self._deliver(call, asm.take_done())
                    continue
                rest = self._read_more()
                if rest is None:
                    return None
        except _wire.WireError as e:
            failure = e
        callbacks = []
        with self.lock:
            self._fast_data_taken(call, length, failure, callbacks)
            self._queue()
        if failure is not None:
            if self.client_side:
                self.reset(call, h2.errors.ErrorCodes.CANCEL)
            # the rest of this frame's payload is still on the stream: drop it
            while left:
                if len(rest):
                    take = min(left, len(rest))
                    rest, left = rest[take:], left - take
                    continue
                rest = self._read_more()
                if rest is None:
                    return None
        for cb in callbacks:
            cb()
        self.flush(block=False)
        return rest

    def _read_more(self):
        """The next read of the stream as bytes, or None (connection failed)."""
        more = self.stream.read_message()
        if more is None:
            self._fail("the peer closed the connection")
            return None
        return memoryview(more).cast("B")

    def _deliver(self, call: CallStream, messages) -> None:
        if not messages:
            return
        with self.lock:
            for msg in messages:
                call.messages.append(msg)
                call.queued_bytes += len(msg)
            call.cond.notify_all()

    def _fail(self, reason: str):
        callbacks = []
        with self.lock:
            first = self.dead is None or not getattr(self, "_failed", False)
            self._failed = True
            if self.dead is None:
                self.dead = reason
            for call in list(self.calls.values()):
                if call.failure is None:
                    call.failure = ConnectionFailed(self.dead)
                self._notify(call, callbacks)
            self.window_cond.notify_all()
        for cb in callbacks:
            cb()
        if first:
            self.stream.close()
            if self.on_close is not None:
                self.on_close(self)

    # ------------------------------------------------------------ closing
    def close(self, graceful: bool = True) -> None:
        if graceful and self.dead is None:
            with self.lock:
                self._close_h2()
            try:
                self.flush(block=True)
            except ConnectionFailed:
                pass
        self._fail("connection closed locally")

    @property
    def alive(self) -> bool:
        return self.dead is None and self.goaway_last_stream is None


class _Cork:
    __slots__ = ("conn",)

    def __init__(self, conn):
        self.conn = conn

    def __enter__(self):
        local = self.conn._local
        local.corked = getattr(local, "corked", 0) + 1
        return self

    def __exit__(self, *exc):
        local = self.conn._local
        local.corked -= 1
        if local.corked == 0:
            try:
                self.conn.flush(block=True)
            except ConnectionFailed:
                if exc[0] is None:
                    raise
        return False


READ_SLICE = 0.05        # seconds a caller reads before rechecking its own deadline


class _PlainReader:
    """Reads a byte stream without message boundaries (TCP sockets): all to h2."""

    def __init__(self, conn):
        self.conn = conn

    def step(self, timeout) -> bool:
        c = self.conn
        try:
            data = c.stream.read_message()
        except errors.FabricError as e:
            c._fail(f"read failed: {e}")
            return False
        if data is None:
            c._fail("the peer closed the connection")
            return False
        try:
            return c._feed_h2([data])
        except Exception as e:  # pragma: no cover - a bug; fail loudly, not silently
            c._fail(f"internal error in the HTTP/2 reader: {e!r}")
            raise


class _FramedReader:
    """Reads a stream with read_into (a fabric stream, or a socket): frames are
    cut here; large DATA frames of open calls are received by the connection
    itself (into the message's final buffer: pulled there by the fabric, or
    received there from the socket); everything else goes to h2 in order."""

    def __init__(self, conn):
        self.conn = conn
        self.buf = memoryview(b"")
        self.preface = 0 if conn.client_side else 24     # a client's connection preface precedes its frames

    def step(self, timeout) -> bool:
        c = self.conn
        try:
            more = c.stream.read_message(timeout)
        except errors.Timeout:
            return True
        except errors.FabricError as e:
            c._fail(f"read failed: {e}")
            return False
        if more is None:
            c._fail("the peer closed the connection")
            return False
        c.last_read = time.monotonic()
        more = memoryview(more).cast("B")
        self.buf = memoryview(bytes(self.buf) + bytes(more)) if len(self.buf) else more
        try:
            return self._process()
        except errors.FabricError as e:
            c._fail(f"read failed: {e}")
            return False
        except Exception as e:  # pragma: no cover - a bug; fail loudly, not silently
            c._fail(f"internal error in the HTTP/2 reader: {e!r}")
            raise

    def _process(self) -> bool:
        c = self.conn
        buf = self.buf
        to_h2 = []
        if self.preface:
            if len(buf) < self.preface:
                return True
            if not c._feed_h2([buf[:self.preface]]):      # h2 checks it now
                return False
            buf = buf[self.preface:]
            self.preface = 0
        while len(buf) >= 9:
            length, ftype, flags, sid = _h2_fast.parse_frame_header(buf)
            if _h2_fast.is_fast_data(c.h2, length, ftype, flags):
                if to_h2:                         # the HEADERS that open this call may be among them
                    if not c._feed_h2(to_h2):
                        return False
                    to_h2 = []
                call = c.calls.get(sid)
                if call is not None and call.failure is None:
                    buf = c._fast_data(call, length, buf[9:])
                    if buf is None:
                        return False
                    continue
            if len(buf) < 9 + length:             # a frame spread over several reads: gather it
                frame = bytearray(9 + length)
                frame[:len(buf)] = buf
                have = len(buf)
                while have < len(frame):
                    n = c.stream.read_into(memoryview(frame)[have:])
                    if n == 0:
                        c._fail("the peer closed the connection")
                        return False
                    have += n
                buf = memoryview(frame)
            to_h2.append(buf[:9 + length])
            buf = buf[9 + length:]
        self.buf = buf
        if to_h2:
            return c._feed_h2(to_h2)
        return True