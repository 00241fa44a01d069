"""What the two HTTP/2 drivers (_http2: threads, _aio_http2: asyncio) share,
without I/O: the HTTP/2 core's set-up (fabric/grpc/_h2.pyx, in C), what a
read changed (new calls, calls to wake, connection events), GOAWAY in two
steps, keepalive bookkeeping.

A driver subclasses ConnectionCore and supplies the I/O and wake-ups:
_now(), _write_h2() (take what the core produced, in order), _wake(stream),
_wake_window_waiters(), _after_read(later, fn), _schedule_tick(when),
_fail(reason) and reset(stream, code). Methods here run under the driver's
lock, if it has one; what must run outside it is put on `later` (a list the
driver runs once it has released the lock) or, with later=None, run at once.

A call is an _h2.Stream: its headers, messages, trailers, end and reset are
kept there by the core; `stream.owner` is the driver's waiter for it.
"""
from __future__ import annotations

import struct

from fabric.grpc import _h2, _keepalive

STREAM_WINDOW = 64 << 20                 # per-stream receive window we offer
CONNECTION_WINDOW = 256 << 20            # connection receive window we offer
MAX_FRAME = (1 << 24) - 1                # largest frame we accept (HTTP/2 maximum)
QUEUED_HIGH_WATER = 64 << 20             # unread complete messages per call before we stop opening its window
MAX_CONCURRENT_STREAMS = 1000
MAX_HEADER_LIST = 64 << 10               # bytes of headers (metadata) per call we accept
LINGER = 2.0                             # seconds a closing connection waits for the peer's close
GOAWAY_PING = b"fgoaway!"                # opaque data of the PING between our two GOAWAYs
GOAWAY_ACK_WAIT = 1.0                    # seconds we wait for its ACK before the final GOAWAY
LAST_STREAM_ID = 2 ** 31 - 1
ErrorCodes = _h2.ErrorCodes


class ConnectionFailed(Exception):
    """The HTTP/2 connection (or its byte stream) is gone."""


def new_core(client_side: bool, max_receive: int, trusted_peer: bool) -> _h2.Connection:
    """An HTTP/2 core with our settings, not started yet. Our settings take
    effect when we send them, not when the peer acknowledges them: a peer
    may use a larger frame or window as soon as it has read them (grpcio
    does). Headers from fabric streams (trusted_peer: only fabric.grpc
    speaks there) are not re-checked against RFC 9113's field rules; HPACK
    decoding itself stays strict."""
    core = _h2.Connection(client_side, initial_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW,
                          max_frame=MAX_FRAME, max_concurrent=MAX_CONCURRENT_STREAMS,
                          max_header_list=MAX_HEADER_LIST, max_receive=max_receive,
                          queued_high_water=QUEUED_HIGH_WATER)
    core.validate = not trusted_peer
    return core


class ConnectionCore:
    """One HTTP/2 connection's state and decisions (see the module's doc)."""

    def _init_core(self, client_side: bool, max_receive: int, on_request, on_close, trusted_peer: bool,
                   keepalive: _keepalive.Settings | None) -> None:
        self.client_side = client_side
        self.max_receive = max_receive
        self.on_request = on_request
        self.on_close = on_close
        self.dead = None                    # reason, once failed
        self.goaway_last_stream = None      # the peer's GOAWAY: streams above it will not be served
        self.goaway_sent_last = None        # ours (final): streams above it are refused
        self.goaway_started = None          # when our first GOAWAY left
        self.closing = False                # close() sent GOAWAY: no new calls from us
        self._pings_seen = 0
        self.keepalive = None if keepalive is None else _keepalive.Keepalive(keepalive, self._now())
        self.h2 = new_core(client_side, max_receive, trusted_peer)

    @property
    def calls(self) -> dict:
        """Open streams by id."""
        return self.h2.streams

    @property
    def counters(self) -> dict:
        return self.h2.counters

    # ------------------------------------------------------------ the driver's part
    def _now(self) -> float:
        raise NotImplementedError

    def _write_h2(self) -> None:
        """Take what the core has produced, to be written in order."""
        raise NotImplementedError

    def _wake(self, stream) -> None:
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

    def reset(self, stream, code=ErrorCodes.CANCEL) -> None:
        raise NotImplementedError

    def _start_h2(self) -> None:
        """The connection preface, our SETTINGS and the connection window."""
        self.h2.initiate()
        self._write_h2()

    # ------------------------------------------------------------ state checks
    def _check_alive(self):
        if self.dead is not None:
            raise ConnectionFailed(self.dead)
        if self.closing:
            raise ConnectionFailed("the connection is closing")

    def _check_call(self, stream):
        self._check_alive()
        if stream.peer_done:
            raise ConnectionFailed(f"stream {stream.id} was ended by the peer")
        if stream.reset_code is not None:
            raise ConnectionFailed(f"stream {stream.id} was reset ({stream.reset_code})")
        if stream.local_closed:
            raise ConnectionFailed(f"stream {stream.id} is already closed for sending")

    def _sent_frames(self):
        """HEADERS or DATA leave: pings are due again, strikes forgiven."""
        if self.keepalive is not None:
            self.keepalive.frames_sent()

    def _close_h2(self) -> None:
        """Our GOAWAY on close."""
        if self.dead is None and not self.closing:
            self.closing = True
            self.h2.goaway(self.h2.highest_inbound if not self.client_side else 0)
            self._write_h2()

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
        self.h2.goaway(LAST_STREAM_ID)
        self.h2.ping(GOAWAY_PING)
        self._write_h2()
        if self.keepalive is not None:
            self._schedule_tick(self.goaway_started + 0.1)     # drain, and the ACK's wait

    def _goaway_finish(self) -> None:
        """The final GOAWAY: streams above the last one we have are refused."""
        if self.goaway_sent_last is not None or self.dead is not None:
            return
        last = self.h2.highest_inbound
        self.h2.goaway(last)
        self._write_h2()
        self.goaway_sent_last = last
        if self.keepalive is not None:
            self.keepalive.goaway_sent(self._now())

    # ------------------------------------------------------------ keepalive
    def _keepalive_due(self, now: float):
        """What the keepalive asks for now (PING and GOAWAY are done here;
        FAIL and CLOSE are the driver's), and when to tick next."""
        ka = self.keepalive
        if self.goaway_started is not None and self.goaway_sent_last is None and \
                now >= self.goaway_started + GOAWAY_ACK_WAIT:
            self._goaway_finish()             # no ACK for our GOAWAY's PING: finish anyway
        action, next_at = ka.tick(now, len(self.h2.streams))
        if action == _keepalive.PING:
            self.h2.ping(struct.pack(">d", now))
            ka.ping_sent(now)
            self._write_h2()
        elif action == _keepalive.GOAWAY:
            self._goaway_begin()
        if self.goaway_started is not None and self.goaway_sent_last is None:
            next_at = min(next_at or now + 0.1, now + 0.1)
        return action, next_at

    # ------------------------------------------------------------ what a read changed
    def _soon(self, later, fn) -> None:
        """fn once the driver's lock is released (at once with later=None)."""
        if later is None:
            fn()
        else:
            later.append(fn)

    def _notify(self, stream, later=None) -> None:
        self._wake(stream)
        if stream.on_event is not None:
            self._soon(later, lambda s=stream: s.on_event(s))

    def _after_receive(self, touched, later) -> None:
        """The streams a read changed, and the connection's events."""
        for s in touched:
            if s.is_new:
                self.h2.accepted(s)
                if s.reset_code is None and self.on_request is not None:
                    self._soon(later, lambda s=s: self.on_request(self, s))
            else:
                if s.failure is not None and self.client_side and s.reset_code is None and \
                        not s.local_closed and not s.ended:
                    # a response we cannot take (oversized, broken): stop it
                    self._soon(later, lambda s=s: self.reset(s, ErrorCodes.CANCEL))
                self._notify(s, later)
        ev = self.h2.take_events()
        if ev:
            self._connection_events(ev, later)

    def _connection_events(self, ev: int, later) -> None:
        h2c = self.h2
        if ev & _h2.EV_PING_ACK:
            acks, h2c.ping_acks = h2c.ping_acks, []
            for data in acks:
                if data == GOAWAY_PING:
                    self._goaway_finish()
                elif self.keepalive is not None:
                    self.keepalive.ping_acknowledged()
                    # the tick waiting is the ACK's watchdog: tick now, so the
                    # next PING comes keepalive_time after this one, not then
                    self._schedule_tick(self._now())
        if ev & _h2.EV_PING:
            fresh = h2c.pings_received - self._pings_seen
            self._pings_seen = h2c.pings_received
            if self.keepalive is not None and not self.client_side:
                now = self._now()
                for _ in range(fresh):
                    if self.keepalive.ping_received(now, len(h2c.streams)):
                        # grpcio's answer to a client pinging more often than allowed
                        h2c.goaway(h2c.highest_inbound, ErrorCodes.ENHANCE_YOUR_CALM, _keepalive.TOO_MANY_PINGS)
                        self._write_h2()
                        self.dead = "the client pinged too often (GOAWAY ENHANCE_YOUR_CALM too_many_pings)"
                        break
        if ev & _h2.EV_GOAWAY:
            last, code, debug = h2c.goaway_received
            self.goaway_last_stream = last
            for sid, s in list(h2c.streams.items()):
                if self.client_side and sid > last and s.failure is None:
                    s.failure = ConnectionFailed("the server went away (GOAWAY) before this call started")
                    self._notify(s, later)
            if code:
                if debug == _keepalive.TOO_MANY_PINGS and self.keepalive is not None:
                    self.keepalive.told_too_many_pings()
                self.dead = f"the peer ended the connection (GOAWAY {ErrorCodes(code)!r}" + (
                    f" {bytes(debug)!r})" if debug else ")") if code in ErrorCodes._value2member_map_ else \
                    f"the peer ended the connection (GOAWAY error {code:#x})"
            elif self.client_side and not any(sid <= last for sid in h2c.streams):
                self._after_read(later, lambda: self._fail("the server went away (GOAWAY)"))
        if ev & _h2.EV_WINDOW:
            self._wake_window_waiters()
