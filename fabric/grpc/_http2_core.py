"""What the two HTTP/2 drivers (_http2: threads, _aio_http2: asyncio) share,
without I/O: the h2 connection's set-up, h2 events turned into call state,
windows given back, GOAWAY decisions and keepalive bookkeeping.

A driver subclasses ConnectionCore and supplies the I/O and wake-ups:
_now(), _write_h2() (take what h2 produced, in order), _new_call(stream_id),
_wake(call), _wake_window_waiters(), _after_read(later, fn) and
_schedule_tick(when). Methods here run under the driver's lock, if it has
one; what must run outside it is put on `later` (a list the driver runs
once it has released the lock) or, with later=None, run at once.
"""
from __future__ import annotations

import struct

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from fabric.grpc import _h2_fast, _keepalive, _wire

STREAM_WINDOW = 64 << 20                 # per-stream receive window we offer
CONNECTION_WINDOW = 256 << 20            # connection receive window we offer
MAX_FRAME = (1 << 24) - 1                # largest frame we accept (HTTP/2 maximum)
QUEUED_HIGH_WATER = 64 << 20             # unread complete messages per call before we stop opening its window
PROMPT_WINDOW_UPDATE = 1 << 20           # from this many bytes, window goes back at once
MAX_CONCURRENT_STREAMS = 1000
MAX_HEADER_LIST = 64 << 10               # bytes of headers (metadata) per call we accept
SMALL_MESSAGE = 64 << 10                 # up to this, prefix and message go out as one DATA frame
LINGER = 2.0                             # seconds a closing connection waits for the peer's close
GOAWAY_PING = b"fgoaway!"                # opaque data of the PING between our two GOAWAYs
GOAWAY_ACK_WAIT = 1.0                    # seconds we wait for its ACK before the final GOAWAY
LAST_STREAM_ID = 2 ** 31 - 1


class ConnectionFailed(Exception):
    """The HTTP/2 connection (or its byte stream) is gone."""


def encoding_header(headers):
    for k, v in headers:
        if k == b"grpc-encoding":
            return v.decode("ascii", "replace")
    return None


def new_h2_connection(client_side: bool, trusted_peer: bool) -> tuple[h2.connection.H2Connection, bool]:
    """An h2 connection with our settings, not started yet; and whether the
    fast path (fabric.grpc._h2_fast) is in use on it."""
    # Outbound headers are built by fabric.grpc itself (lowercase names, no
    # connection-specific fields), so h2 need not re-check them (that
    # check costs ~10 us a message). What peers send is validated, except
    # on fabric streams (trusted_peer): only fabric.grpc speaks there, and
    # HPACK decoding itself stays strict.
    config = h2.config.H2Configuration(client_side=client_side, header_encoding=None,
                                       validate_outbound_headers=False,
                                       normalize_outbound_headers=False,
                                       validate_inbound_headers=not trusted_peer)
    conn = h2.connection.H2Connection(config)
    fast = _h2_fast.install(conn)
    # Our settings take effect when we send them, not when the peer
    # acknowledges them: a peer may use a larger frame or window as soon
    # as it has read them (grpcio does), before its ACK reaches us.
    codes = h2.settings.SettingCodes
    values = {codes.INITIAL_WINDOW_SIZE: STREAM_WINDOW, codes.MAX_FRAME_SIZE: MAX_FRAME,
              codes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
              codes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST}
    if client_side:
        values[codes.ENABLE_PUSH] = 0
    conn.local_settings = h2.settings.Settings(client=client_side, initial_values=values)
    _h2_fast.accept_frames_up_to(conn, MAX_FRAME)
    return conn, fast


class ConnectionCore:
    """One HTTP/2 connection's state and decisions (see the module's doc)."""

    def _init_core(self, client_side: bool, max_receive: int, on_request, on_close, trusted_peer: bool,
                   keepalive: _keepalive.Settings | None) -> None:
        self.client_side = client_side
        self.max_receive = max_receive
        self.on_request = on_request
        self.on_close = on_close
        self.calls = {}
        self.dead = None                    # reason, once failed
        self.goaway_last_stream = None      # the peer's GOAWAY: streams above it will not be served
        self.goaway_sent_last = None        # ours: streams above it are refused
        self.goaway_started = None          # when our first GOAWAY left
        self._goaway_in_h2 = False          # h2 has sent or taken a GOAWAY (plain h2: it is CLOSED)
        self.keepalive = None if keepalive is None else _keepalive.Keepalive(keepalive, self._now())
        self.h2, self.fast_data = new_h2_connection(client_side, trusted_peer)
        self.counters = {"fast_data_frames_sent": 0, "fast_data_frames_received": 0}

    # ------------------------------------------------------------ the driver's part
    def _now(self) -> float:
        raise NotImplementedError

    def _write_h2(self) -> None:
        """Take what h2 has produced, to be written in order."""
        raise NotImplementedError

    def _new_call(self, stream_id: int):
        raise NotImplementedError

    def _wake(self, call) -> None:
        raise NotImplementedError

    def _wake_window_waiters(self) -> None:
        raise NotImplementedError

    def _after_read(self, later, fn) -> None:
        """fn once the events of the current read are handled."""
        raise NotImplementedError

    def _schedule_tick(self, when: float) -> None:
        """The next keepalive tick at when, replacing any scheduled one."""
        raise NotImplementedError

    def _fail(self, reason: str) -> None:
        raise NotImplementedError

    def reset(self, call, code=h2.errors.ErrorCodes.CANCEL) -> None:
        raise NotImplementedError

    def _start_h2(self) -> None:
        """The connection preface, our SETTINGS and the connection window."""
        self.h2.initiate_connection()
        self.h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self._write_h2()

    # ------------------------------------------------------------ state checks
    def _h2_closed(self) -> bool:
        closed = _h2_fast.connection_closed(self.h2)
        return self._goaway_in_h2 if closed is None else closed

    def _check_alive(self):
        if self.dead is not None:
            raise ConnectionFailed(self.dead)
        if self._h2_closed():
            # close() sent GOAWAY; the connection is not failed yet
            raise ConnectionFailed("the connection is closing")

    def _check_call(self, call):
        self._check_alive()
        if call.peer_done:
            raise ConnectionFailed(f"stream {call.id} was ended by the peer")
        if call.reset_code is not None:
            raise ConnectionFailed(f"stream {call.id} was reset ({call.reset_code})")
        if call.local_closed:
            raise ConnectionFailed(f"stream {call.id} is already closed for sending")

    def _sent_frames(self):
        """HEADERS or DATA leave: pings are due again, strikes forgiven."""
        if self.keepalive is not None:
            self.keepalive.frames_sent()

    def _close_h2(self) -> None:
        """Our GOAWAY on close (h2 is CLOSED after it); quiet if h2 refuses."""
        try:
            self.h2.close_connection()
            self._goaway_in_h2 = True
            self._write_h2()
        except h2.exceptions.ProtocolError:
            pass

    # ------------------------------------------------------------ windows
    def _ack(self, call) -> bool:
        """Return received bytes of call to the peer's windows; True if h2
        has frames to send for it."""
        n, call.unacked = call.unacked, 0
        if not n or self.dead is not None:
            return False
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
        return True

    def _fast_data_taken(self, call, length: int, failure, later) -> None:
        """A large DATA frame of call was read past h2 (failure: the
        message it carried was refused)."""
        call.unacked += length
        if failure is not None and call.failure is None:
            call.failure = failure
        if call.queued_bytes <= QUEUED_HIGH_WATER:
            self._ack(call)
        self._notify(call, later)

    # ------------------------------------------------------------ GOAWAY
    def _goaway_begin(self) -> None:
        """A graceful GOAWAY in two steps, as gRPC servers do: first one that
        names no last stream (stop opening calls here) with a PING; once its
        ACK is back, every call the client opened before it saw the GOAWAY
        has arrived, and the final GOAWAY names the last one. A single
        GOAWAY would refuse calls already on their way."""
        if self.dead is not None or self.goaway_started is not None:
            return
        self.goaway_started = self._now()
        if not self.fast_data:
            # plain h2 sends nothing after a GOAWAY (not even the PING): one
            # GOAWAY, naming the last stream we have now
            self._goaway_finish()
        elif self._send_goaway(LAST_STREAM_ID):
            self.h2.ping(GOAWAY_PING)
            self._write_h2()
        if self.keepalive is not None:
            self._schedule_tick(self.goaway_started + 0.1)     # drain, and the ACK's wait

    def _goaway_finish(self) -> None:
        """The final GOAWAY: streams above the last one we have are refused."""
        if self.goaway_sent_last is not None or self.dead is not None:
            return
        last = self.h2.highest_inbound_stream_id
        if self._send_goaway(last):
            self.goaway_sent_last = last
            if self.keepalive is not None:
                self.keepalive.goaway_sent(self._now())

    def _send_goaway(self, last_stream_id) -> bool:
        """GOAWAY while the open calls finish: h2 moves to CLOSED when it
        sends GOAWAY and would refuse their remaining frames, so its state
        goes back to OPEN where the fast path can; the GOAWAY's rule is kept
        here."""
        try:
            self.h2.close_connection(last_stream_id=last_stream_id)
        except h2.exceptions.ProtocolError:
            return False
        self._goaway_in_h2 = True
        self._write_h2()
        _h2_fast.reopen_after_goaway(self.h2)
        return True

    # ------------------------------------------------------------ keepalive
    def _keepalive_due(self, now: float):
        """What the keepalive asks for now (PING and GOAWAY are done here;
        FAIL and CLOSE are the driver's), and when to tick next."""
        ka = self.keepalive
        if self.goaway_started is not None and self.goaway_sent_last is None and \
                now >= self.goaway_started + GOAWAY_ACK_WAIT:
            self._goaway_finish()             # no ACK for our GOAWAY's PING: finish anyway
        action, next_at = ka.tick(now, len(self.calls))
        if action == _keepalive.PING:
            self.h2.ping(struct.pack(">d", now))
            ka.ping_sent(now)
            self._write_h2()
        elif action == _keepalive.GOAWAY:
            self._goaway_begin()
        if self.goaway_started is not None and self.goaway_sent_last is None:
            next_at = min(next_at or now + 0.1, now + 0.1)
        return action, next_at

    # ------------------------------------------------------------ h2 events
    def _soon(self, later, fn) -> None:
        """fn once the driver's lock is released (at once with later=None)."""
        if later is None:
            fn()
        else:
            later.append(fn)

    def _notify(self, call, later=None) -> None:
        self._wake(call)
        if call.on_event is not None:
            self._soon(later, lambda c=call: c.on_event(c))

    def _handle(self, ev, later) -> None:
        """One h2 event."""
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
                    self._soon(later, lambda c=call: self.reset(c, h2.errors.ErrorCodes.CANCEL))
                # a server ends the call with the status (its trailers), then resets
            if call.queued_bytes <= QUEUED_HIGH_WATER:
                self._ack(call)
            self._notify(call, later)
        elif isinstance(ev, E.RequestReceived):
            if self.goaway_sent_last is not None and ev.stream_id > self.goaway_sent_last:
                try:                              # after our GOAWAY: the client retries elsewhere
                    self.h2.reset_stream(ev.stream_id, error_code=h2.errors.ErrorCodes.REFUSED_STREAM)
                except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                    pass
                return
            call = self._new_call(ev.stream_id)
            call.headers = ev.headers
            call.assembler.encoding = encoding_header(ev.headers)
            self.calls[ev.stream_id] = call
            if ev.stream_ended is not None:
                call.ended = True
            if self.on_request is not None:
                self._soon(later, lambda c=call: self.on_request(self, c))
        elif isinstance(ev, E.ResponseReceived):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.headers = ev.headers
                call.assembler.encoding = encoding_header(ev.headers)
                self._notify(call, later)
        elif isinstance(ev, E.TrailersReceived):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.trailers = ev.headers
                self._notify(call, later)
        elif isinstance(ev, E.StreamEnded):
            call = self.calls.get(ev.stream_id)
            if call is not None:
                call.ended = True
                if call.assembler.partial and call.failure is None:
                    call.failure = _wire.WireError(grpc.StatusCode.INTERNAL, "stream ended inside a message")
                self._notify(call, later)
            self._wake_window_waiters()
        elif isinstance(ev, E.StreamReset):
            call = self.calls.pop(ev.stream_id, None)
            if call is not None:
                if call.ended and ev.error_code == h2.errors.ErrorCodes.NO_ERROR:
                    call.peer_done = True       # complete: the peer only wants no more of our request
                else:
                    call.reset_code = ev.error_code
                self._notify(call, later)
            self._wake_window_waiters()
        elif isinstance(ev, (E.WindowUpdated, E.RemoteSettingsChanged)):
            self._wake_window_waiters()
        elif isinstance(ev, E.ConnectionTerminated):
            self._goaway_in_h2 = True
            self.goaway_last_stream = ev.last_stream_id if ev.last_stream_id is not None else 0
            for sid, call in list(self.calls.items()):
                if self.client_side and sid > self.goaway_last_stream:
                    call.failure = ConnectionFailed("the server went away (GOAWAY) before this call started")
                    self._notify(call, later)
            if ev.error_code:
                if ev.additional_data == _keepalive.TOO_MANY_PINGS and self.keepalive is not None:
                    self.keepalive.told_too_many_pings()
                self.dead = f"the peer ended the connection (GOAWAY {ev.error_code!r}" + (
                    f" {bytes(ev.additional_data)!r})" if ev.additional_data else ")")
            elif self.client_side and not self.calls:    # the calls it still serves go on
                self._after_read(later, lambda: self._fail("the server went away (GOAWAY)"))
            self._wake_window_waiters()
        elif isinstance(ev, E.PingAckReceived):
            if ev.ping_data == GOAWAY_PING:
                self._goaway_finish()
            elif self.keepalive is not None:
                self.keepalive.ping_acknowledged()
                # the tick waiting is the ACK's watchdog: tick now, so the
                # next PING comes keepalive_time after this one, not then
                self._schedule_tick(self._now())
        elif isinstance(ev, E.PingReceived):
            if self.keepalive is not None and not self.client_side and \
                    self.keepalive.ping_received(self._now(), len(self.calls)):
                # grpcio's answer to a client pinging more often than allowed
                try:
                    self.h2.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                                             additional_data=_keepalive.TOO_MANY_PINGS)
                except h2.exceptions.ProtocolError:
                    pass
                self.dead = "the client pinged too often (GOAWAY ENHANCE_YOUR_CALM too_many_pings)"
