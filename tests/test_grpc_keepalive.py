"""Keepalive, GOAWAY and connection lifetimes of fabric.grpc (sync and aio)
against stock grpcio both ways: a graceful GOAWAY (max connection age, stop
with grace) lets open calls finish and new calls move to a new connection;
max_connection_idle closes idle connections; keepalive pings are answered
and detect a connection that went silent; a client pinging more often than
the server's ping policy allows is told to calm down (GOAWAY
ENHANCE_YOUR_CALM too_many_pings) and pings half as often."""
import asyncio
import threading
import time
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")

import grpc.aio  # noqa: E402

import fabric.grpc as fgrpc  # noqa: E402
import fabric.grpc.aio as faio  # noqa: E402
from tcp_proxy import Proxy  # noqa: E402

# serial: these count pings and watch timers over fractions of a second, so
# tools/test.sh runs them after the parallel part, with the machine to themselves
pytestmark = [pytest.mark.timeout(90), pytest.mark.serial]

# (client, server); stock against stock is the reference of what grpcio does
PAIRS = ["fabric>grpcio", "grpcio>fabric", "fabric>fabric", "grpcio>grpcio"]


def sleepy(request, context):
    time.sleep(float(request.decode() or 0))
    return context.peer().encode()


async def sleepy_async(request, context):
    await asyncio.sleep(float(request.decode() or 0))
    return context.peer().encode()


def _handlers(fn):
    return [grpc.method_handlers_generic_handler("t.S", {"Sleep": grpc.unary_unary_rpc_method_handler(fn)})]


class Sync:
    def __init__(self, pair, server_options=(), channel_options=(), proxy=False):
        client, server = pair.split(">")
        self.server = (grpc if server == "grpcio" else fgrpc).server(
            futures.ThreadPoolExecutor(16), handlers=_handlers(sleepy), options=list(server_options))
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.proxy = Proxy(port) if proxy else None
        self.channel = (grpc if client == "grpcio" else fgrpc).insecure_channel(
            f"127.0.0.1:{self.proxy.port if proxy else port}", options=list(channel_options))
        self.sleep = self.channel.unary_unary("/t.S/Sleep")

    def close(self):
        self.channel.close()
        self.server.stop(None)
        if self.proxy is not None:
            self.proxy.close()


def _calls_for(duration, call, threads=4, seconds=b"0.25"):
    """Calls from several threads for duration seconds: (peers seen, errors)."""
    peers, errors = set(), []

    def worker():
        end = time.monotonic() + duration
        while time.monotonic() < end:
            try:
                peers.add(call(seconds, timeout=20))
            except grpc.RpcError as e:
                errors.append((e.code(), e.details()))
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return peers, errors


AGE = [("grpc.max_connection_age_ms", 300), ("grpc.max_connection_age_grace_ms", 10000)]


@pytest.mark.parametrize("pair", PAIRS)
def test_max_connection_age_moves_calls_without_failing_one(pair):
    d = Sync(pair, server_options=AGE)
    try:
        peers, errors = _calls_for(2.0, d.sleep)
    finally:
        d.close()
    assert errors == []
    assert len(peers) >= 2                  # the calls did move to new connections


@pytest.mark.parametrize("pair", PAIRS)
def test_aio_max_connection_age_moves_calls_without_failing_one(pair):
    client, server = pair.split(">")

    async def main():
        s = (grpc.aio if server == "grpcio" else faio).server(handlers=_handlers(sleepy_async), options=AGE)
        port = s.add_insecure_port("127.0.0.1:0")
        await s.start()
        ch = (grpc.aio if client == "grpcio" else faio).insecure_channel(f"127.0.0.1:{port}")
        call = ch.unary_unary("/t.S/Sleep")
        peers, errors = set(), []

        async def worker():
            end = time.monotonic() + 2.0
            while time.monotonic() < end:
                try:
                    peers.add(await call(b"0.25", timeout=20))
                except grpc.RpcError as e:
                    errors.append((e.code(), e.details()))
        try:
            await asyncio.gather(*[worker() for _ in range(4)])
        finally:
            await ch.close()
            await s.stop(None)
        assert errors == []
        assert len(peers) >= 2
    asyncio.run(main())


@pytest.mark.parametrize("pair", ["grpcio>fabric", "fabric>fabric"])
def test_stop_with_grace_finishes_open_calls(pair):
    d = Sync(pair)
    try:
        slow = d.sleep.future(b"1.0", timeout=20)
        time.sleep(0.3)
        stopped = d.server.stop(5)
        assert slow.result(timeout=20)                # the open call finished
        assert stopped.wait(10)
        with pytest.raises(grpc.RpcError) as info:    # and nothing serves new ones
            d.sleep(b"0", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        d.close()


@pytest.mark.parametrize("client", ["grpcio", "fabric"])
def test_aio_stop_with_grace_finishes_open_calls(client):
    async def main():
        s = faio.server(handlers=_handlers(sleepy_async))
        port = s.add_insecure_port("127.0.0.1:0")
        await s.start()
        ch = (grpc.aio if client == "grpcio" else faio).insecure_channel(f"127.0.0.1:{port}")
        try:
            slow = asyncio.ensure_future(ch.unary_unary("/t.S/Sleep")(b"1.0", timeout=20))
            await asyncio.sleep(0.3)
            await s.stop(5)
            assert await slow
        finally:
            await ch.close()
    asyncio.run(main())


@pytest.mark.parametrize("pair", ["grpcio>fabric", "fabric>fabric"])
def test_max_connection_idle_closes_idle_connections(pair):
    d = Sync(pair, server_options=[("grpc.max_connection_idle_ms", 200)], proxy=True)
    try:
        first = d.sleep(b"0", timeout=10)
        time.sleep(2.0)                               # idle: the server closes the connection
        second = d.sleep(b"0", timeout=10)            # and the channel opens another
        busy = d.sleep(b"0.6", timeout=10)            # a call longer than the idle limit is not idle
    finally:
        d.close()
    assert first != second and second == busy
    assert d.proxy.connections == 2


KEEPALIVE = [("grpc.keepalive_time_ms", 100), ("grpc.keepalive_timeout_ms", 300),
             ("grpc.http2.max_pings_without_data", 0)]
PERMISSIVE = [("grpc.http2.min_ping_interval_without_data_ms", 10), ("grpc.http2.max_ping_strikes", 0)]


@pytest.mark.parametrize("pair", PAIRS)
def test_keepalive_pings_are_answered(pair):
    d = Sync(pair, server_options=PERMISSIVE, channel_options=KEEPALIVE, proxy=True)
    try:
        before = d.proxy.up
        assert d.sleep(b"1.5", timeout=20)            # ~15 pings, each answered in time
        pinged = d.proxy.up - before
    finally:
        d.close()
    assert pinged > 8 * 17                            # PING frames are 17 bytes


# (grpcio>fabric: a fabric server pinging a stock client still pings about one
# in three times as often as it should; not understood yet)
@pytest.mark.parametrize("pair", ["fabric>fabric", "grpcio>grpcio"])
def test_a_server_pings_at_its_keepalive_time(pair):
    """Regression: a connection read by a reader thread (a server's, a TLS
    one) scheduled its next tick at the PING ACK's watchdog deadline, so it
    pinged every keepalive_timeout instead of every keepalive_time."""
    server_ka = [("grpc.keepalive_time_ms", 100), ("grpc.keepalive_timeout_ms", 2000),
                 ("grpc.http2.max_pings_without_data", 0)]
    d = Sync(pair, server_options=server_ka, channel_options=PERMISSIVE, proxy=True)
    try:
        assert d.sleep(b"0", timeout=20)
        before = d.proxy.down
        assert d.sleep(b"1.5", timeout=20)            # ~15 pings of the server's
        pinged = d.proxy.down - before
    finally:
        d.close()
    assert pinged > 8 * 17                            # PING frames are 17 bytes (the bug: ~4)


@pytest.mark.parametrize("pair", ["fabric>grpcio", "fabric>fabric"])
def test_keepalive_detects_a_connection_gone_silent(pair):
    d = Sync(pair, server_options=PERMISSIVE, channel_options=KEEPALIVE, proxy=True)
    try:
        call = d.sleep.future(b"30", timeout=25)
        time.sleep(0.5)
        d.proxy.freeze()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            call.result(timeout=20)
        took = time.monotonic() - started
    finally:
        d.close()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE      # not the deadline, 25 s away
    assert took < 15
    assert "keepalive" in info.value.details()


def test_aio_keepalive_detects_a_connection_gone_silent():
    async def main():
        s = faio.server(handlers=_handlers(sleepy_async), options=PERMISSIVE)
        port = s.add_insecure_port("127.0.0.1:0")
        await s.start()
        proxy = Proxy(port)
        ch = faio.insecure_channel(f"127.0.0.1:{proxy.port}", options=KEEPALIVE)
        try:
            call = asyncio.ensure_future(ch.unary_unary("/t.S/Sleep")(b"30", timeout=25))
            await asyncio.sleep(0.5)
            proxy.freeze()
            with pytest.raises(grpc.RpcError) as info:
                await asyncio.wait_for(call, 20)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "keepalive" in info.value.details()
        finally:
            await ch.close()
            await s.stop(None)
            proxy.close()
    asyncio.run(main())


@pytest.mark.parametrize("server", ["grpcio", "fabric"])
def test_a_client_pinging_too_often_is_told_and_backs_off(server):
    """Pings with no call open, against a default ping policy (no pings
    without calls unless permitted): GOAWAY ENHANCE_YOUR_CALM too_many_pings,
    the channel doubles its keepalive time and its next call works."""
    options = [("grpc.keepalive_time_ms", 50), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0)]
    d = Sync(f"fabric>{server}", channel_options=options)
    try:
        assert d.sleep(b"0", timeout=10)
        end = time.monotonic() + 10
        while d.channel._keepalive.time <= 0.05 and time.monotonic() < end:
            time.sleep(0.05)
        assert d.channel._keepalive.time >= 0.1       # told, and backed off
        assert d.sleep(b"0", timeout=10)              # on a new connection
    finally:
        d.close()


def test_a_fabric_server_enforces_its_ping_policy_on_a_stock_client():
    """A stock client pinging an idle connection every 50 ms gets GOAWAY
    too_many_pings from a fabric server, as from a grpcio one, and recovers."""
    options = [("grpc.keepalive_time_ms", 50), ("grpc.keepalive_permit_without_calls", 1),
               ("grpc.http2.max_pings_without_data", 0)]
    d = Sync("grpcio>fabric", channel_options=options, proxy=True)
    try:
        assert d.sleep(b"0", timeout=10)
        end = time.monotonic() + 20                   # grpcio pings about once a second at most
        while not d.proxy.closed and time.monotonic() < end:
            time.sleep(0.05)
        assert d.proxy.closed                         # the server ended the connection
        assert d.sleep(b"0", timeout=10)              # and the client went on with a new one
        assert d.proxy.connections == 2
    finally:
        d.close()
