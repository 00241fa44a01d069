"""Keepalive pings and connection lifetimes for fabric.grpc's HTTP/2
connections, as grpcio's channel and server options define them. No I/O
here: a connection driver (threaded or asyncio) reports what happened
(calls started and ended, frames sent, pings received and acknowledged) and
asks tick() what is due and when to ask again.

Options (milliseconds unless said): grpc.keepalive_time_ms (ping after this
long without one; client default off, server default 2 hours),
grpc.keepalive_timeout_ms (an unanswered ping fails the connection; 20 s),
grpc.keepalive_permit_without_calls (0/1: ping with no call open; as a
server option it also allows clients to), grpc.http2.max_pings_without_data
(pings sent while we send no DATA/HEADERS before we stop; 2, 0 = no limit),
grpc.max_connection_idle_ms, grpc.max_connection_age_ms (+/-10% jitter as
grpcio), grpc.max_connection_age_grace_ms (after the age's GOAWAY, open calls
get this long), grpc.http2.min_ping_interval_without_data_ms (300 s) and
grpc.http2.max_ping_strikes (2, 0 = no limit): a server's ping policy, which
answers a client pinging more often with GOAWAY ENHANCE_YOUR_CALM
"too_many_pings"; a client told so doubles its keepalive time, as grpcio's.
"""
from __future__ import annotations

import heapq
import random
import threading
import time

TOO_MANY_PINGS = b"too_many_pings"
NO_CALLS_PING_INTERVAL = 7200.0          # what a server allows without calls unless permitted (grpcio)
SERVER_KEEPALIVE_TIME = 7200.0
DEFAULT_TIMEOUT = 20.0

# what tick() may ask for
PING, GOAWAY, CLOSE, FAIL = "ping", "goaway", "close", "fail"


def _seconds(options: dict, key: str, default=None):
    value = options.get(key)
    if value is None:
        return default
    value = int(value)
    if value >= 2 ** 31 - 1 or value < 0:     # INT_MAX: grpcio's "infinite"
        return None
    return value / 1000.0


class Settings:
    """The options of one channel or server."""

    def __init__(self, options: dict, server: bool):
        self.server = server
        self.time = _seconds(options, "grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME if server else None)
        self.timeout = _seconds(options, "grpc.keepalive_timeout_ms", DEFAULT_TIMEOUT) or DEFAULT_TIMEOUT
        self.permit_without_calls = bool(int(options.get("grpc.keepalive_permit_without_calls", 0)))
        self.max_pings_without_data = int(options.get("grpc.http2.max_pings_without_data", 2))
        self.max_idle = _seconds(options, "grpc.max_connection_idle_ms") if server else None
        self.max_age = _seconds(options, "grpc.max_connection_age_ms") if server else None
        self.age_grace = _seconds(options, "grpc.max_connection_age_grace_ms") if server else None
        self.min_ping_interval = _seconds(options, "grpc.http2.min_ping_interval_without_data_ms", 300.0) or 0.0
        self.max_ping_strikes = int(options.get("grpc.http2.max_ping_strikes", 2))

    @property
    def needs_timer(self) -> bool:
        return any(v is not None for v in (self.time, self.max_idle, self.max_age))


class Keepalive:
    """One connection's pings, strikes and lifetime."""

    def __init__(self, settings: Settings, now: float):
        self.settings = settings
        self.interval = settings.time
        self.created = now
        self.idle_since = now
        self.last_ping = now                 # sent, or (client) the connection's start
        self.ping_outstanding = None         # when the unanswered ping left
        self.pings_without_data = 0
        self.strikes = 0
        self.last_ping_received = None
        self.age_limit = None if settings.max_age is None else now + settings.max_age * random.uniform(0.9, 1.1)
        self.goaway_at = None                # when we sent GOAWAY (age or idle)

    # -- what happened
    def frames_sent(self) -> None:
        """We sent HEADERS or DATA: pings are allowed again, strikes forgiven."""
        self.pings_without_data = 0
        self.strikes = 0

    def calls_changed(self, active: int, now: float) -> None:
        if active == 0:
            self.idle_since = now

    def ping_acknowledged(self) -> None:
        self.ping_outstanding = None

    def ping_sent(self, now: float) -> None:
        self.ping_outstanding = now
        self.last_ping = now
        self.pings_without_data += 1

    def told_too_many_pings(self) -> None:
        """The server's GOAWAY ENHANCE_YOUR_CALM too_many_pings: ping half as often."""
        if self.interval is not None:
            self.interval = min(self.interval * 2, 2 ** 31 / 1000.0)
            self.settings.time = max(self.settings.time or 0, self.interval)   # the channel's next connections too

    def ping_received(self, now: float, active: int) -> bool:
        """(server) True when the client broke the ping policy (send GOAWAY
        ENHANCE_YOUR_CALM too_many_pings and close)."""
        s = self.settings
        allowed = s.min_ping_interval if (active or s.permit_without_calls) else NO_CALLS_PING_INTERVAL
        last, self.last_ping_received = self.last_ping_received, now
        if last is not None and now - last < allowed:
            self.strikes += 1
            return s.max_ping_strikes != 0 and self.strikes > s.max_ping_strikes
        return False

    def goaway_sent(self, now: float) -> None:
        self.goaway_at = now

    # -- what is due
    def tick(self, now: float, active: int):
        """(action or None, when to tick next or None). Actions: FAIL (a ping
        went unanswered), CLOSE (after our GOAWAY: no calls left, or the
        grace is over), GOAWAY (max age or idle reached), PING."""
        s = self.settings
        due = []
        if active:
            self.idle_since = now
        if self.ping_outstanding is not None:
            if now >= self.ping_outstanding + s.timeout:
                return FAIL, None
            due.append(self.ping_outstanding + s.timeout)
        if self.goaway_at is not None:
            if active == 0:
                return CLOSE, None
            if s.age_grace is not None and now >= self.goaway_at + s.age_grace:
                return CLOSE, None
            due.append(now + 0.1)             # draining: close soon after the last call ends
        else:
            if self.age_limit is not None:
                if now >= self.age_limit:
                    return GOAWAY, now
                due.append(self.age_limit)
            if s.max_idle is not None:
                if active == 0 and now >= self.idle_since + s.max_idle:
                    return GOAWAY, now
                due.append(max(self.idle_since + s.max_idle, now + min(s.max_idle, 1.0)))
        if self.interval is not None and self.ping_outstanding is None:
            when = self.last_ping + self.interval
            if now >= when:
                allowed = active > 0 or s.permit_without_calls
                if allowed and (s.max_pings_without_data == 0 or self.pings_without_data < s.max_pings_without_data):
                    return PING, now + s.timeout
                self.last_ping = now          # not now: one interval from here
                when = now + self.interval
            due.append(when)
        return None, (min(due) if due else None)


class Timers:
    """One thread that runs callbacks at given times (deadlines, keepalive ticks)."""

    def __init__(self, name: str = "fabric-grpc-timers"):
        self._heap = []
        self._cond = threading.Condition()
        self._seq = 0
        self._thread = None
        self._closed = False
        self._name = name

    def schedule(self, when: float, fn) -> None:
        with self._cond:
            if self._closed:
                return
            self._seq += 1
            heapq.heappush(self._heap, (when, self._seq, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
                self._thread.start()
            self._cond.notify()

    def _run(self):
        while True:
            with self._cond:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, _, fn = heapq.heappop(self._heap)
            try:
                fn()
            except Exception:                 # noqa: BLE001 - one callback's failure is its own
                pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()


_shared = None
_shared_lock = threading.Lock()


def shared_timers() -> Timers:
    """The process's keepalive timer thread (started at first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Timers("fabric-grpc-keepalive")
        return _shared
