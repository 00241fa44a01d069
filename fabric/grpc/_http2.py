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
import struct
import threading
import time
import weakref

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from fabric import errors
from fabric.grpc import _keepalive, _wire

STREAM_WINDOW = 64 << 20                 # per-stream receive window we offer
CONNECTION_WINDOW = 256 << 20            # connection receive window we offer
MAX_FRAME = (1 << 24) - 1                # largest frame we accept (HTTP/2 maximum)
QUEUED_HIGH_WATER = 64 << 20             # unread complete messages per call before we stop opening its window
PROMPT_WINDOW_UPDATE = 1 << 20           # from this many bytes, window goes back at once
MAX_CONCURRENT_STREAMS = 1000
MAX_HEADER_LIST = 64 << 10               # bytes of headers (metadata) per call we accept
SMALL_MESSAGE = 64 << 10                 # up to this, prefix and message go out as one DATA frame
FAST_DATA_MIN = 64 << 10                 # DATA frames from this size bypass h2's byte handling
FRAME_HEADER = struct.Struct(">HBBBI")   # length (24 bits as H+B), type, flags, stream id
DATA, END_STREAM_FLAG, PADDED_FLAG = 0x0, 0x1, 0x8
LINGER = 2.0                             # seconds a closing connection waits for the peer's close
IDLE_CHECK_AFTER = 0.05                  # seconds without reading before a call checks the connection
GOAWAY_PING = b"fgoaway!"                # opaque data of the PING between our two GOAWAYs
GOAWAY_ACK_WAIT = 1.0                    # seconds we wait for its ACK before the final GOAWAY


def frame_header(length: int, ftype: int, flags: int, stream_id: int) -> bytes:
    return FRAME_HEADER.pack(length >> 8, length & 0xFF, ftype, flags, stream_id & 0x7FFFFFFF)


def parse_frame_header(view) -> tuple[int, int, int, int]:
    hi, lo, ftype, flags, sid = FRAME_HEADER.unpack_from(view)
    return (hi << 8) | lo, ftype, flags, sid & 0x7FFFFFFF


def _cheap_data_repr(frame) -> str:
    """repr() of a DATA frame's body as hyperframe writes it (the first 10
    bytes of the serialized body, hex, then "..."), from those bytes only."""
    import binascii
    padding = frame.serialize_padding_data()
    size = len(padding) + len(frame.data) + (frame.pad_length if "PADDED" in frame.flags else 0)
    if size == 0:
        return "None"
    head = padding + bytes(memoryview(frame.data)[:11])
    head = (head + b"\0" * 11)[:min(11, size)]
    text = binascii.hexlify(head).decode("ascii")
    return "<hex:" + (text[:20] + "..." if len(text) > 20 else text) + ">"


def install_cheap_frame_buffer(conn: h2.connection.H2Connection) -> None:
    """h2 formats repr(frame) for every frame it receives, logging on or off,
    and hyperframe's repr of a DATA frame re-serializes the whole body and
    hex-encodes all of it before keeping 20 hex digits: three passes over
    every payload (a 4 MiB gRPC message spent 14 ms there). This connection's
    frame buffer hands out DATA frames whose repr reads 10 bytes; hyperframe
    itself, and every other user of h2 in the process, is left as it is.
    Without the hooks it needs (another h2/hyperframe), h2 keeps its own."""
    try:
        from h2.frame_buffer import FrameBuffer
        from hyperframe.frame import DataFrame
    except ImportError:                       # pragma: no cover
        return
    buffer = getattr(conn, "incoming_buffer", None)
    table = getattr(conn, "_frame_dispatch_table", None)      # h2 routes frames by exact type
    if (_CheapFrameBuffer is None or type(buffer) is not FrameBuffer or buffer._data
            or not isinstance(table, dict) or DataFrame not in table
            or not hasattr(DataFrame, "serialize_padding_data") or not hasattr(DataFrame, "_body_repr")):
        return
    table[_CheapFrameBuffer.data_frame] = table[DataFrame]
    cheap = _CheapFrameBuffer(server=not conn.config.client_side)
    cheap.max_frame_size = buffer.max_frame_size
    conn.incoming_buffer = cheap


def _make_cheap_frame_buffer():
    try:
        from h2.frame_buffer import FrameBuffer
        from hyperframe.frame import DataFrame
    except ImportError:                       # pragma: no cover
        return None

    class CheapReprDataFrame(DataFrame):
        __slots__ = ()

        def _body_repr(self) -> str:
            return _cheap_data_repr(self)

    CheapReprDataFrame.__name__ = "DataFrame"     # h2's log lines read as before

    class CheapFrameBuffer(FrameBuffer):
        data_frame = CheapReprDataFrame

        def __next__(self):
            frame = super().__next__()
            if type(frame) is DataFrame:
                frame.__class__ = CheapReprDataFrame
            return frame

    return CheapFrameBuffer


_CheapFrameBuffer = _make_cheap_frame_buffer()


class _MemoHpack:
    """An hpack Encoder or Decoder whose work is remembered: gRPC sends the
    same few header blocks over and over (request headers of a method,
    response headers, OK trailers), and HPACK in pure Python costs ~6 us a
    block (a quarter of h2's time per call). A block is reused only while
    the dynamic table is exactly as it was when the block was made, and only
    if making it left the table unchanged, so the bytes on the wire (and the
    headers handed to h2) are what hpack itself would produce."""

    __slots__ = ("_inner", "_memo", "_version", "_coder")
    MAX_MEMO = 256

    def __init__(self, inner, coder):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_memo", {})
        object.__setattr__(self, "_version", 0)
        object.__setattr__(self, "_coder", coder)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)          # table size, list size limits: a new state
        object.__setattr__(self, "_version", self._version + 1)

    def _state(self):
        table = self._inner.header_table
        entries = table.dynamic_entries
        return table.maxsize, table.resized, len(entries), entries[0] if entries else None

    def _run(self, key, *args):
        hit = self._memo.get(key)
        if hit is not None and hit[0] == self._version:
            return hit[1]
        size, resized, count, first = self._state()
        unchanged = False
        try:
            out = getattr(self._inner, self._coder)(*args)
            if self._coder == "decode":
                out = list(out)
            size2, resized2, count2, first2 = self._state()
            # entries are new tuples when added: identity tells a changed table
            unchanged = size == size2 and resized == resized2 and count == count2 and first is first2
        finally:
            if not unchanged:
                object.__setattr__(self, "_version", self._version + 1)
        if unchanged:
            if len(self._memo) >= self.MAX_MEMO:
                self._memo.clear()
            self._memo[key] = (self._version, out)
        return out

    def encode(self, headers, huffman=True):
        if type(headers) is not list or any(type(h) is not tuple for h in headers):
            return self._plain("encode", headers, huffman)
        return self._run(("e", tuple(headers), huffman), headers, huffman)

    def decode(self, data, raw=False):
        return list(self._run(("d", bytes(data), raw), data, raw))

    def _plain(self, coder, *args):
        """Not memoizable (sensitive or unusual header types): hpack itself."""
        object.__setattr__(self, "_version", self._version + 1)
        return getattr(self._inner, coder)(*args)


def fast_data_supported(conn) -> bool:
    """The large-DATA path keeps h2's bookkeeping through these h2 internals
    (h2 4.x); without them every DATA frame goes through h2."""
    return (hasattr(conn, "_inbound_flow_control_window_manager") and hasattr(conn, "_get_stream_by_id")
            and hasattr(conn, "state_machine"))


def charge_data_sent(conn, stream_id: int, length: int) -> None:
    """h2's state machines and windows, as its send_data would leave them,
    for a DATA frame of length bytes we write ourselves."""
    from h2.connection import ConnectionInputs
    from h2.stream import StreamInputs
    stream = conn._get_stream_by_id(stream_id)
    conn.state_machine.process_input(ConnectionInputs.SEND_DATA)
    stream.state_machine.process_input(StreamInputs.SEND_DATA)
    stream.outbound_flow_control_window -= length
    conn.outbound_flow_control_window -= length


def charge_data_received(conn, stream_id: int, length: int) -> None:
    """The same for a DATA frame we receive ourselves (raises h2's
    ProtocolError or StreamClosedError as its receive_data would)."""
    from h2.connection import ConnectionInputs
    from h2.stream import StreamInputs
    conn.state_machine.process_input(ConnectionInputs.RECV_DATA)
    conn._inbound_flow_control_window_manager.window_consumed(length)
    stream = conn._get_stream_by_id(stream_id)
    stream.state_machine.process_input(StreamInputs.RECV_DATA)
    stream._inbound_window_manager.window_consumed(length)


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


def _encoding_header(headers):
    for k, v in headers:
        if k == b"grpc-encoding":
            return v.decode("ascii", "replace")
    return None


class ConnectionFailed(Exception):
    """The HTTP/2 connection (or its byte stream) is gone."""


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


def reopen_after_goaway(conn: h2.connection.H2Connection) -> None:
    """h2 moves to CLOSED when it sends or receives GOAWAY, and then refuses
    every later frame, also those of the calls the GOAWAY lets finish
    (RFC 9113 6.8): a stock server's graceful GOAWAY (max connection age,
    stop with grace) would fail them all. Back to OPEN; the caller keeps the
    GOAWAY's rule (no new streams, or none above its last stream id)."""
    machine = getattr(conn, "state_machine", None)
    if machine is not None and machine.state == h2.connection.ConnectionState.CLOSED:
        machine.state = (h2.connection.ConnectionState.CLIENT_OPEN if conn.config.client_side
                         else h2.connection.ConnectionState.SERVER_OPEN)


def keep_streams_open_on_goaway(conn: h2.connection.H2Connection) -> None:
    """Reopen as soon as h2 has taken a graceful (NO_ERROR) GOAWAY, before it
    reads the frames after it in the same read (h2 internals; without them
    a GOAWAY ends the calls it should let finish, as before)."""
    from hyperframe.frame import GoAwayFrame
    table = getattr(conn, "_frame_dispatch_table", None)
    if not isinstance(table, dict) or GoAwayFrame not in table:
        return
    original = table[GoAwayFrame]

    def receive_goaway(frame):
        result = original(frame)
        if frame.error_code == 0:
            reopen_after_goaway(conn)
        return result
    table[GoAwayFrame] = receive_goaway


class Connection:
    def __init__(self, stream, client_side: bool, max_receive: int = _wire.DEFAULT_MAX_RECEIVE,
                 on_request=None, on_close=None, name: str = "fabric.grpc", callers_read: bool = False,
                 trusted_peer: bool = False, keepalive: _keepalive.Settings | None = None):
        self.stream = stream
        self.client_side = client_side
        self.max_receive = max_receive
        self.on_request = on_request
        self.on_close = on_close
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.read_lock = threading.Lock()       # the reader role
        self.cond = threading.Condition(self.lock)
        self.window_cond = self.cond            # one condition: every waiter rechecks after progress
        self.pending = []
        self.calls: dict[int, CallStream] = {}
        self.dead = None                    # reason, once failed
        self.goaway_last_stream = None      # the peer's GOAWAY: streams above it will not be served
        self.goaway_sent_last = None        # ours: streams above it are refused
        self.goaway_started = None          # when our first GOAWAY left
        self.last_read = time.monotonic()
        self.keepalive = None if keepalive is None else _keepalive.Keepalive(keepalive, time.monotonic())
        self._local = threading.local()
        # Outbound headers are built by fabric.grpc itself (lowercase names, no
        # connection-specific fields), so h2 need not re-check them (that
        # check costs ~10 us a message). What peers send is validated, except
        # on fabric streams (trusted_peer): only fabric.grpc speaks there, and
        # HPACK decoding itself stays strict.
        config = h2.config.H2Configuration(client_side=client_side, header_encoding=None,
                                           validate_outbound_headers=False,
                                           normalize_outbound_headers=False,
                                           validate_inbound_headers=not trusted_peer)
        self.h2 = h2.connection.H2Connection(config)
        install_cheap_frame_buffer(self.h2)
        keep_streams_open_on_goaway(self.h2)
        self.h2.encoder = _MemoHpack(self.h2.encoder, "encode")
        self.h2.decoder = _MemoHpack(self.h2.decoder, "decode")
        self.fast_data = fast_data_supported(self.h2)
        self.counters = {"fast_data_frames_sent": 0, "fast_data_frames_received": 0}
        self._writes_in_flight = collections.deque() if hasattr(stream, "write_nowait") else None
        # Our settings take effect when we send them, not when the peer
        # acknowledges them: a peer may use a larger frame or window as soon
        # as it has read them (grpcio does), before its ACK reaches us.
        codes = h2.settings.SettingCodes
        values = {codes.INITIAL_WINDOW_SIZE: STREAM_WINDOW, codes.MAX_FRAME_SIZE: MAX_FRAME,
                  codes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
                  codes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST}
        if client_side:
            values[codes.ENABLE_PUSH] = 0
        self.h2.local_settings = h2.settings.Settings(client=client_side, initial_values=values)
        self.h2.max_inbound_frame_size = MAX_FRAME
        self.h2.incoming_buffer.max_frame_size = MAX_FRAME
        with self.lock:
            self.h2.initiate_connection()
            self.h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
            self.pending.append(self.h2.data_to_send())
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
            if self.goaway_started is not None and self.goaway_sent_last is None and \
                    now >= self.goaway_started + GOAWAY_ACK_WAIT:
                self._goaway_finish()             # no ACK for our GOAWAY's PING: finish anyway
            action, next_at = ka.tick(now, len(self.calls))
            if action == _keepalive.PING:
                self.h2.ping(struct.pack(">d", now))
                ka.ping_sent(now)
                self._queue()
            elif action == _keepalive.GOAWAY:
                self._goaway_begin()
            if self.goaway_started is not None and self.goaway_sent_last is None:
                next_at = min(next_at or now + 0.1, now + 0.1)
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

    def _goaway_begin(self):
        """(lock held) A graceful GOAWAY in two steps, as gRPC servers do:
        first one that names no last stream (stop opening calls here) with a
        PING; once its ACK is back, every call the client opened before it
        saw the GOAWAY has arrived, and the final GOAWAY names the last one.
        A single GOAWAY would refuse calls already on their way."""
        if self.dead is not None or self.goaway_started is not None:
            return
        self.goaway_started = time.monotonic()
        if self._send_goaway(2 ** 31 - 1):
            self.h2.ping(GOAWAY_PING)
            self._queue()
        if self.keepalive is not None:
            self._schedule_tick(self.goaway_started + 0.1)     # drain, and the ACK's wait

    def _goaway_finish(self):
        """(lock held) The final GOAWAY: streams above the last one we have are refused."""
        if self.goaway_sent_last is not None or self.dead is not None:
            return
        last = self.h2.highest_inbound_stream_id
        if self._send_goaway(last):
            self.goaway_sent_last = last
            if self.keepalive is not None:
                self.keepalive.goaway_sent(time.monotonic())

    def _send_goaway(self, last_stream_id) -> bool:
        """(lock held) GOAWAY while the open calls finish: h2 moves to CLOSED
        when it sends GOAWAY and would refuse their remaining frames, so its
        state goes back to OPEN; the GOAWAY's rule is kept here."""
        try:
            self.h2.close_connection(last_stream_id=last_stream_id)
        except h2.exceptions.ProtocolError:
            return False
        self._queue()
        reopen_after_goaway(self.h2)
        return True

    def _sent_frames(self):
        """(lock held) HEADERS or DATA leave: pings are due again, strikes forgiven."""
        if self.keepalive is not None:
            self.keepalive.frames_sent()

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
        n, call.unacked = call.unacked, 0
        if n and self.dead is None:
            if n >= PROMPT_WINDOW_UPDATE:
                # h2 returns window only after half of it was consumed; with
                # messages of 16 MiB that stalls a streaming sender every few
                # messages. Large amounts go back at once: the connection's
                # always (even when the stream has closed meanwhile, or the
                # peer's connection window shrinks for good), the stream's if open.
                self.h2.increment_flow_control_window(n)
                try:
                    self.h2.increment_flow_control_window(n, stream_id=call.id)
                except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError,
                        h2.exceptions.FlowControlError):
                    pass
            else:
                try:
                    self.h2.acknowledge_received_data(n, call.id)
                except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                    pass        # the stream is gone; h2 has settled the connection window
            self._queue()

    # ------------------------------------------------------------ calls
    def _check_alive(self):
        if self.dead is not None:
            raise ConnectionFailed(self.dead)
        if self.h2.state_machine.state == h2.connection.ConnectionState.CLOSED:
            # close() sent GOAWAY; the connection is not failed yet
            raise ConnectionFailed("the connection is closing")

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

    def _check_call(self, call: CallStream):
        self._check_alive()
        if call.peer_done:
            raise ConnectionFailed(f"stream {call.id} was ended by the peer")
        if call.reset_code is not None:
            raise ConnectionFailed(f"stream {call.id} was reset ({call.reset_code})")
        if call.local_closed:
            raise ConnectionFailed(f"stream {call.id} is already closed for sending")

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
        if view.nbytes >= FAST_DATA_MIN and self.fast_data:
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
                    charge_data_sent(self.h2, call.id, length)
                    self._queue()                     # anything h2 had queued goes first
                    self.pending.append(frame_header(length, DATA, 0, call.id) + (prefix if first else b""))
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
                charge_data_received(self.h2, call.id, length)
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
        with self.lock:
            call.unacked += length
            if failure is not None and call.failure is None:
                call.failure = failure
            if call.queued_bytes <= QUEUED_HIGH_WATER:
                self.ack(call)
            callbacks = []
            self._notify(call, callbacks)
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

    def _handle(self, ev, callbacks):
        """(lock held) One h2 event."""
        E = h2.events
        if isinstance(ev, E.DataReceived):
            call = self.calls.get(ev.stream_id)
            if call is None or call.failure is not None:
                if ev.flow_controlled_length:
                    try:
                        self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                    except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                        pass
                return
            call.unacked += ev.flow_controlled_length
            try:
                for msg in call.assembler.feed(ev.data):
                    call.messages.append(msg)
                    call.queued_bytes += len(msg)
            except _wire.WireError as e:
                call.failure = e
                if self.client_side:
                    callbacks.append(lambda c=call: self.reset(c, h2.errors.ErrorCodes.CANCEL))
                # a server ends the call with the status (its trailers), then resets
            if call.queued_bytes <= QUEUED_HIGH_WATER:
                self.ack(call)
            self._notify(call, callbacks)
        elif isinstance(ev, E.RequestReceived):
            if self.goaway_sent_last is not None and ev.stream_id > self.goaway_sent_last:
                try:                              # after our GOAWAY: the client retries elsewhere
                    self.h2.reset_stream(ev.stream_id, error_code=h2.errors.ErrorCodes.REFUSED_STREAM)
                except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                    pass
                return
            call = CallStream(self, ev.stream_id, self.max_receive)
            call.headers = ev.headers
            call.assembler.encoding = _encoding_header(ev.headers)
            self.calls[ev.stream_id] = call
            if ev.stream_ended is not None:
                call.ended = True
            if self.on_request is not None:
                callbacks.append(lambda c=call: self.on_request(self, c))
        elif isinstance(ev, E.ResponseReceived):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.headers = ev.headers
                call.assembler.encoding = _encoding_header(ev.headers)
                self._notify(call, callbacks)
        elif isinstance(ev, E.TrailersReceived):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.trailers = ev.headers
                self._notify(call, callbacks)
        elif isinstance(ev, E.StreamEnded):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.ended = True
                if call.assembler.partial and call.failure is None:
                    call.failure = _wire.WireError(grpc.StatusCode.INTERNAL, "stream ended inside a message")
                self._notify(call, callbacks)
            self.window_cond.notify_all()
        elif isinstance(ev, E.StreamReset):
            call = self.calls.pop(ev.stream_id, None)
            if call is not None:
                if call.ended and ev.error_code == h2.errors.ErrorCodes.NO_ERROR:
                    call.peer_done = True       # complete: the peer only wants no more of our request
                else:
                    call.reset_code = ev.error_code
                self._notify(call, callbacks)
            self.window_cond.notify_all()
        elif isinstance(ev, (E.WindowUpdated, E.RemoteSettingsChanged)):
            self.window_cond.notify_all()
        elif isinstance(ev, E.ConnectionTerminated):
            self.goaway_last_stream = ev.last_stream_id if ev.last_stream_id is not None else 0
            for sid, call in list(self.calls.items()):
                if self.client_side and sid > self.goaway_last_stream:
                    call.failure = ConnectionFailed("the server went away (GOAWAY) before this call started")
                    self._notify(call, callbacks)
            if ev.error_code:
                if ev.additional_data == _keepalive.TOO_MANY_PINGS and self.keepalive is not None:
                    self.keepalive.told_too_many_pings()
                self.dead = f"the peer ended the connection (GOAWAY {ev.error_code!r}" + (
                    f" {bytes(ev.additional_data)!r})" if ev.additional_data else ")")
            else:                                 # the calls it still serves go on
                if self.client_side and not self.calls:
                    callbacks.append(lambda: self._fail("the server went away (GOAWAY)"))
            self.window_cond.notify_all()
        elif isinstance(ev, E.PingAckReceived):
            if ev.ping_data == GOAWAY_PING:
                self._goaway_finish()
            elif self.keepalive is not None:
                self.keepalive.ping_acknowledged()
        elif isinstance(ev, E.PingReceived):
            if self.keepalive is not None and not self.client_side and \
                    self.keepalive.ping_received(time.monotonic(), len(self.calls)):
                # grpcio's answer to a client pinging more often than allowed
                try:
                    self.h2.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                                             additional_data=_keepalive.TOO_MANY_PINGS)
                except h2.exceptions.ProtocolError:
                    pass
                self.dead = "the client pinged too often (GOAWAY ENHANCE_YOUR_CALM too_many_pings)"

    def _notify(self, call, callbacks):
        call.cond.notify_all()
        if call.on_event is not None:
            callbacks.append(lambda c=call: c.on_event(c))

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
                try:
                    self.h2.close_connection()
                    self._queue()
                except h2.exceptions.ProtocolError:
                    pass
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
            length, ftype, flags, sid = parse_frame_header(buf)
            if (ftype == DATA and length >= FAST_DATA_MIN and not flags & (PADDED_FLAG | END_STREAM_FLAG)
                    and length <= c.h2.max_inbound_frame_size):
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
