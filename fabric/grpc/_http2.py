"""One HTTP/2 connection over a byte stream, for gRPC calls, driven by
threads (the HTTP/2 state machine, HPACK and flow control are the C core's,
fabric/grpc/_h2.pyx).

Reading: on a server, a reader thread per connection. On a client nobody
is dedicated to it (callers_read): the caller that waits reads for
everyone, so a blocking unary call is sent, read and finished on the
caller's own thread with no hand-off; other waiting callers sleep on a lock
of their own and are woken once, by whoever read their response. When the
reading caller is done, it hands the reading to one of them. The byte stream
is read without holding the connection lock, so a peer's large write is
always taken, even while we are writing.

Writing: what the core produces is queued in order under the connection lock
and written by whoever holds the send lock; the reader never waits for the
send lock (if it is held, the holder writes the reader's bytes too), so two
peers writing large messages to each other at once cannot deadlock. Large
DATA payloads are writes of their own, straight from the sender's buffer: a
fabric stream moves them by rendezvous into the peer's message buffer, which
the peer's reader reads into directly (direct_target).
"""
from __future__ import annotations

import collections
import threading
import time
import weakref

from fabric import errors
from fabric.grpc import _h2, _keepalive, _wire
from fabric.grpc._http2_core import LINGER, ConnectionCore, ConnectionFailed, ErrorCodes

IDLE_CHECK_AFTER = 0.05                  # seconds without reading before a call checks the connection
READ_SLICE = 0.05                        # seconds a caller reads before rechecking its own deadline
MAX_DETACHED_WRITES = 4                  # large writes in flight per connection (sender pipelining)


class Waiter:
    """A call's wake-up: a lock held while nobody has news for it. Used
    under the connection lock (waiting, woken)."""
    __slots__ = ("lock", "waiting")

    def __init__(self):
        self.lock = threading.Lock()
        self.lock.acquire()
        self.waiting = False

    def wake(self):
        """(connection lock held)"""
        if self.waiting:
            self.waiting = False
            self.lock.release()


class Connection(ConnectionCore):
    def __init__(self, stream, client_side: bool, max_receive: int = _wire.DEFAULT_MAX_RECEIVE,
                 on_request=None, on_close=None, name: str = "fabric.grpc", callers_read: bool = False,
                 trusted_peer: bool = False, keepalive: _keepalive.Settings | None = None):
        self.stream = stream
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.pending = []                       # output in order, written by the send lock's holder
        self.last_read = time.monotonic()
        self.reading = False                    # the reader role is taken
        self.followers = collections.deque()    # waiters of callers waiting for the reader role
        self.window_waiters = []                # waiters of senders waiting for window
        self._failed = False
        self._init_core(client_side, max_receive, on_request, on_close, trusted_peer, keepalive)
        self._writes_in_flight = collections.deque() if hasattr(stream, "write_nowait") else None
        self._direct = hasattr(stream, "read_into")
        with self.lock:
            self._start_h2()
        self.flush(block=True)
        # callers_read: no reader thread (see the module's doc). Needs a
        # stream whose reads take a timeout; a connection nobody waits on is
        # not read until someone does.
        self.callers_read = callers_read
        if not callers_read:
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
        if self.callers_read:
            self._read_if_free()              # nobody waits on a call: read what came (a PING ACK)
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
        out = self.h2.take_output()
        if out is not None:
            self.pending.extend(out)

    def _wake(self, stream) -> None:
        w = stream.owner
        if w is not None:
            w.wake()

    def _wake_window_waiters(self) -> None:
        waiters, self.window_waiters = self.window_waiters, []
        for w in waiters:
            w.wake()

    def _after_read(self, later, fn) -> None:
        later.append(fn)

    def check_idle(self) -> None:
        """Before a call on a connection nobody has read for a while (no
        reader thread): take what came meanwhile, so a GOAWAY or a close
        by the server (idle or age limits) is seen before we send on it."""
        if self.callers_read and self.dead is None and time.monotonic() - self.last_read > IDLE_CHECK_AFTER:
            self._read_if_free()

    def _read_if_free(self) -> None:
        """Read what is there now, unless someone else reads."""
        with self.lock:
            if self.reading or self.dead is not None:
                return
            self.reading = True
        try:
            self._read_step(0)
        finally:
            with self.lock:
                self.reading = False
                self._promote()

    # ------------------------------------------------------------ waiting
    def await_(self, waiter: Waiter, ready, deadline: float | None, window: bool = False) -> bool:
        """(lock held) Until ready(); False on deadline. With callers_read,
        the waiting thread reads for everyone while nobody else does.
        window: the wait is for send window (woken by WINDOW_UPDATE)."""
        while not ready():
            if self.dead is not None:
                return ready()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            if self.callers_read and not self.reading:
                self.reading = True
                self.lock.release()
                try:
                    self._read_step(READ_SLICE if left is None else min(left, READ_SLICE))
                finally:
                    self.lock.acquire()
                    self.reading = False
                if not ready():
                    continue                    # go on reading ourselves
                self._promote()
                return True
            waiter.waiting = True
            if window:
                self.window_waiters.append(waiter)
            elif self.callers_read:
                self.followers.append(waiter)
            self.lock.release()
            got = waiter.lock.acquire(timeout=READ_SLICE if left is None else min(left, READ_SLICE)) \
                if self.callers_read else waiter.lock.acquire(timeout=-1 if left is None else left)
            self.lock.acquire()
            if not got:
                if waiter.waiting:
                    waiter.waiting = False      # nobody woke us: we are still on a list (removed below)
                    try:
                        (self.window_waiters if window else self.followers).remove(waiter)
                    except ValueError:
                        pass
                else:
                    waiter.lock.acquire()       # woken as we timed out: take the wake-up back
        return True

    def _promote(self) -> None:
        """(lock held, reader role just released) Another waiting caller
        reads now: one waiting for a response, else one waiting for window
        (which only a read can bring)."""
        while self.followers:
            w = self.followers.popleft()
            if w.waiting:
                w.wake()
                return
        if self.window_waiters:
            self.window_waiters.pop(0).wake()

    # ------------------------------------------------------------ writing
    def flush(self, block: bool) -> None:
        """Write queued output in order. block=False: leave it to the
        current writer if there is one (the reader uses this)."""
        if not self.send_lock.acquire(blocking=block):
            return
        held = True
        try:
            while True:
                with self.lock:
                    items = self.pending
                    if not items:
                        self.send_lock.release()   # under the lock: a racing appender sees it free
                        held = False
                        return
                    self.pending = []
                self._write(items)
        except errors.FabricError as e:
            self._fail(f"write failed: {e}")
            if block:
                raise ConnectionFailed(str(e)) from None
        finally:
            if held:
                self.send_lock.release()

    def _write(self, items) -> None:
        """(send lock held) Small frames together, each large payload as a
        write of its own (the peer's fabric receives it as one message it
        can pull straight into place)."""
        if len(items) == 1 and type(items[0]) is bytes:
            self.stream.write(items[0])
            return
        batch = []
        for item in items:
            if type(item) is memoryview:
                if batch:
                    self.stream.write(batch)
                    batch = []
                if type(item.obj) is bytes and self._writes_in_flight is not None:
                    # immutable: the write may still be in flight when the
                    # sender returns; the next message is framed while the
                    # peer pulls this one
                    while len(self._writes_in_flight) >= MAX_DETACHED_WRITES:
                        self._writes_in_flight.popleft().wait()
                    self._writes_in_flight.append(self.stream.write_nowait(item))
                else:
                    self.stream.write(item)
            else:
                batch.append(item)
        if batch:
            self.stream.write(batch)

    # ------------------------------------------------------------ calls
    def open_call(self, waiter: Waiter, headers, message=None, compressed: bool = False,
                  deadline: float | None = None):
        """(client) A new stream with its request headers and, if given, its
        one request message and end of stream, in one write."""
        with self.lock:
            while True:
                self._check_alive()
                if self.goaway_last_stream is not None:
                    raise ConnectionFailed("the server is going away (GOAWAY)")
                if self.h2.can_open:
                    break
                if not self.await_(waiter, lambda: self.dead is not None or self.h2.can_open or
                                   self.goaway_last_stream is not None, deadline, window=True):
                    raise TimeoutError("deadline exceeded waiting for a stream")
            s = self.h2.open_stream(headers, end_stream=False)
            s.owner = waiter
            self._sent_frames()
            done = True
            if message is not None:
                done = self.h2.send_message(s, message, compressed, True)
            self._write_h2()
        self.flush(block=True)
        if not done:
            self._finish_message(s, waiter, deadline)
        return s

    def send_headers(self, stream, headers, end_stream: bool = False, flush: bool = True) -> None:
        with self.lock:
            self._check_call(stream)
            self.h2.send_headers(stream, headers, end_stream)
            self._sent_frames()
            self._write_h2()
        if flush:
            self.flush(block=True)

    def send_message(self, stream, waiter: Waiter, payload, end_stream: bool = False,
                     deadline: float | None = None, encoding: str | None = None) -> None:
        """A length-prefixed gRPC message, cut to the peer's windows and frame
        size; compressed with encoding (gzip, deflate) when that makes it smaller."""
        payload, compressed = _wire.maybe_compress(payload, encoding)
        with self.lock:
            self._check_call(stream)
            self._sent_frames()
            done = self.h2.send_message(stream, payload, compressed, end_stream)
            self._write_h2()
        self.flush(block=True)
        if not done:
            self._finish_message(stream, waiter, deadline)

    def respond(self, stream, headers, payload, compressed: bool, trailers) -> bool:
        """(server) Response headers (None: sent already), one message and
        the trailers in one write, if the windows take the message at once;
        False (nothing sent but the headers) if they do not."""
        with self.lock:
            self._check_call(stream)
            if headers is not None:
                self.h2.send_headers(stream, headers, False)
            self._sent_frames()
            done = self.h2.send_message(stream, payload, compressed, False)
            if done:
                self.h2.send_headers(stream, trailers, True)
            self._write_h2()
        self.flush(block=True)
        return done

    def finish_message(self, stream, waiter: Waiter, deadline) -> None:
        self._finish_message(stream, waiter, deadline)

    def _finish_message(self, stream, waiter: Waiter, deadline) -> None:
        """The rest of a message the windows did not take at once."""
        while True:
            with self.lock:
                ok = self.await_(waiter, lambda: self.dead is not None or stream.reset_code is not None or
                                 stream.peer_done or self.h2.stream_send_window(stream) > 0, deadline, window=True)
                if not ok:
                    raise TimeoutError("deadline exceeded while waiting for flow control")
                self._check_alive()
                if stream.peer_done or stream.reset_code is not None:
                    raise ConnectionFailed(f"stream {stream.id} ended while sending")
                done = self.h2.pump(stream)
                self._write_h2()
            self.flush(block=True)
            if done:
                return

    def end_stream(self, stream) -> None:
        with self.lock:
            self._check_call(stream)
            self.h2.end_stream(stream)
            self._write_h2()
        self.flush(block=True)

    def reset(self, stream, code=ErrorCodes.CANCEL) -> None:
        """RST_STREAM (cancellation); quiet if the stream is already gone."""
        with self.lock:
            if self.dead is None:
                self.h2.reset_stream(stream, int(code))
                self._write_h2()
            elif stream.reset_code is None:
                stream.reset_code = int(code)
            self._wake(stream)
            self._wake_window_waiters()
        try:
            self.flush(block=True)
        except ConnectionFailed:
            pass

    def take_message(self, stream):
        """(lock held) Pop one message; its window goes back to the peer."""
        msg = stream.messages.popleft()
        self.h2.consume(stream, len(msg))
        if self.h2.has_output:
            self._write_h2()
        return msg

    def sent_acks(self) -> None:
        """(no lock) Write window updates take_message() queued: a sender may
        be waiting for them, and nothing else would write them soon."""
        if self.pending:
            try:
                self.flush(block=False)
            except ConnectionFailed:
                pass

    def forget(self, stream) -> None:
        """The call on stream is over (client): drop the connection if the
        server said GOAWAY and this was the last call."""
        with self.lock:
            stream.owner = None
            drained = self.client_side and self.goaway_last_stream is not None and not self.h2.streams \
                and self.dead is None
        if drained:
            self._fail("the server went away (GOAWAY) and no call was left")

    # ------------------------------------------------------------ reading
    def _read_loop(self):
        """The reader thread: holds the reader role for the connection's life."""
        with self.lock:
            self.reading = True
        while self.dead is None:
            self._read_step(None)

    def _read_step(self, timeout) -> bool:
        """One read of the stream (no lock held), handed to the core; False
        once the connection is dead. timeout: seconds to wait for bytes
        (None: until they come)."""
        try:
            data = self.stream.read_message(timeout)
        except errors.Timeout:
            return True
        except errors.FabricError as e:
            self._fail(f"read failed: {e}")
            return False
        if data is None:
            self._fail("the peer closed the connection")
            return False
        self.last_read = time.monotonic()
        try:
            if not self._feed(data):
                return False
            if self._direct:
                return self._read_direct()
            return True
        except errors.FabricError as e:
            self._fail(f"read failed: {e}")
            return False
        except Exception as e:  # pragma: no cover - a bug; fail loudly, not silently
            self._fail(f"internal error in the HTTP/2 reader: {e!r}")
            raise

    def _feed(self, data) -> bool:
        later = []
        with self.lock:
            try:
                touched = self.h2.receive(data)
            except _h2.H2Error as e:
                self.dead = e.text
                self._write_h2()
                touched = ()
            else:
                self._after_receive(touched, later)
                self._write_h2()
        for fn in later:
            fn()
        if self.pending:
            self.flush(block=False)
        if self.dead is not None:
            self._fail(self.dead)
            return False
        return True

    def _read_direct(self) -> bool:
        """The rest of a large DATA frame straight into its message's buffer
        (a fabric stream pulls the sender's payload there)."""
        while True:
            with self.lock:
                target = self.h2.direct_target()
            if target is None:
                return True
            n = self.stream.read_into(target)
            if n == 0:
                self._fail("the peer closed the connection")
                return False
            later = []
            with self.lock:
                touched = self.h2.direct_advance(n)
                self._after_receive(touched, later)
                self._write_h2()
            for fn in later:
                fn()
            if self.pending:
                self.flush(block=False)

    def _fail(self, reason: str):
        callbacks = []
        with self.lock:
            first = not self._failed
            self._failed = True
            if self.dead is None:
                self.dead = reason
            for s in list(self.h2.streams.values()):
                if s.failure is None:
                    s.failure = ConnectionFailed(self.dead)
                self._notify(s, callbacks)
            self._wake_window_waiters()
            while self.followers:
                self.followers.popleft().wake()
        for cb in callbacks:
            cb()
        if first:
            try:
                self.flush(block=False)       # a GOAWAY for a protocol error, if the stream still takes it
            except ConnectionFailed:
                pass
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
        return self.dead is None and self.goaway_last_stream is None and not self.closing
