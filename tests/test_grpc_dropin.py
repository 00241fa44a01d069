"""fabric.grpc as a drop-in for grpcio, against stock grpcio peers: statuses a
handler sets in any form end the call, complete responses followed by
RST_STREAM(NO_ERROR), a request stream ending while its channel closes, and
message compression (identity, deflate, gzip) negotiated both ways."""
import socket
import threading
import zlib
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")

import fabric.grpc as fgrpc  # noqa: E402
from fabric.grpc import _wire  # noqa: E402
from tcp_proxy import Proxy  # noqa: E402

METHOD = "/drop.in/Call"
STREAM_IN = "/drop.in/StreamIn"

# (client, server): the reference pair (stock to stock) shows what grpcio does
PAIRS = ["grpcio>fabric", "fabric>grpcio", "fabric>fabric", "grpcio>grpcio"]


class Deployment:
    """A bytes-in, bytes-out service (no serializers) on a stock or fabric
    server, a stock or fabric client in front, through a counting proxy."""

    def __init__(self, pair, handler, stream_handler=None, server_compression=None,
                 channel_compression=None, options=()):
        client_kind, server_kind = pair.split(">")
        make_server = grpc.server if server_kind == "grpcio" else fgrpc.server
        handlers = {"Call": grpc.unary_unary_rpc_method_handler(handler)}
        if stream_handler is not None:
            handlers["StreamIn"] = grpc.stream_unary_rpc_method_handler(stream_handler)
        self.server = make_server(futures.ThreadPoolExecutor(8), options=list(options),
                                  compression=server_compression,
                                  handlers=[grpc.method_handlers_generic_handler("drop.in", handlers)])
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.proxy = Proxy(port)
        make_channel = grpc.insecure_channel if client_kind == "grpcio" else fgrpc.insecure_channel
        self.channel = make_channel(f"127.0.0.1:{self.proxy.port}", options=list(options),
                                    compression=channel_compression)
        self.call = self.channel.unary_unary(METHOD)
        self.stream_in = self.channel.stream_unary(STREAM_IN)

    def close(self):
        self.channel.close()
        self.server.stop(0)
        self.proxy.close()


@pytest.fixture(params=PAIRS)
def deploy(request):
    made = []

    def make(*args, **kwargs):
        d = Deployment(request.param, *args, **kwargs)
        made.append(d)
        return d
    yield make
    for d in made:
        d.close()


# ------------------------------------------------------------ statuses

def set_int_code(request, context):
    context.set_code(2)                 # as gRPC's own interop service does
    context.set_details("an int code")
    return b""


def abort_int_code(request, context):
    context.abort(5, "aborted with an int")


def bad_trailing_metadata(request, context):
    context.set_trailing_metadata((("Not A Valid Key!", "v"),))
    return b"response"


def non_str_details(request, context):
    context.set_code(grpc.StatusCode.NOT_FOUND)
    context.set_details(404)
    return b""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("handler", [set_int_code, abort_int_code, bad_trailing_metadata, non_str_details])
def test_any_status_a_handler_sets_ends_the_call(deploy, handler):
    d = deploy(handler)
    with pytest.raises(grpc.RpcError) as info:
        d.call(b"x", timeout=10)
    assert info.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED, info.value
    if handler in (set_int_code, abort_int_code):
        assert info.value.code() == grpc.StatusCode.UNKNOWN
    # and the channel still works
    d2 = deploy(lambda r, c: r)
    assert d2.call(b"ok", timeout=10) == b"ok"


# ------------------------------------------------------------ stock servers' habits

@pytest.mark.timeout(120)
def test_concurrent_large_requests_to_a_stock_server():
    # grpcio answers a request it has not read entirely with the response,
    # then RST_STREAM(NO_ERROR): a success (RFC 9113 8.1)
    d = Deployment("fabric>grpcio", lambda r, c: r[:10])
    errors = []
    try:
        def worker():
            for _ in range(10):
                try:
                    assert d.call(bytes(100_000), timeout=20) == bytes(10)
                except Exception as e:          # noqa: BLE001 - reported below
                    errors.append(e)
        threads = [threading.Thread(target=worker) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
    finally:
        d.close()


@pytest.mark.timeout(60)
def test_a_request_stream_ending_while_its_channel_closes_is_quiet():
    seen = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)
    try:
        for _ in range(20):
            d = Deployment("fabric>fabric", lambda r, c: r,
                           stream_handler=lambda it, c: b"".join(it))
            release = threading.Event()

            def requests():
                yield b"a"
                release.wait(5)
                yield b"b"
            f = d.stream_in.future(requests(), timeout=10)
            release.set()
            d.channel.close()
            try:
                f.result(timeout=10)
            except grpc.RpcError:
                pass
            d.server.stop(0)
            d.proxy.close()
    finally:
        threading.excepthook = old_hook
    assert not seen, seen[:3]


@pytest.mark.timeout(60)
def test_sending_on_a_connection_that_is_closing_is_a_connection_failure():
    # close() first sends GOAWAY, then fails the calls: a request stream
    # ending in between must get the connection's failure, not a protocol
    # error from the HTTP/2 core (a traceback from the request thread)
    from fabric.grpc import _http2
    d = Deployment("fabric>fabric", echo, stream_handler=lambda it, c: b"".join(it))
    try:
        assert d.call(b"warm", timeout=10) == b"warm"
        conn = d.channel._connection()
        waiter = _http2.Waiter()
        call = conn.open_call(waiter, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", STREAM_IN.encode()),
                                       (b":authority", b"x"), (b"te", b"trailers"),
                                       (b"content-type", b"application/grpc")])
        with conn.lock:
            conn._close_h2()
        for send in (lambda: conn.end_stream(call), lambda: conn.send_message(call, waiter, b"x"),
                     lambda: conn.send_headers(call, [(b"grpc-status", b"0")], end_stream=True)):
            with pytest.raises(_http2.ConnectionFailed):
                send()
    finally:
        d.close()


# ------------------------------------------------------------ compression

ZEROS = bytes(1 << 20)


def echo(request, context):
    return request


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", [grpc.Compression.Gzip, grpc.Compression.Deflate])
@pytest.mark.parametrize("where", ["channel", "call", "server"])
def test_compression_is_negotiated_and_used(deploy, algorithm, where):
    d = deploy(echo, server_compression=algorithm if where == "server" else None,
               channel_compression=algorithm if where == "channel" else None)
    kwargs = {"compression": algorithm} if where == "call" else {}
    assert d.call(ZEROS, timeout=20, **kwargs) == ZEROS
    if where in ("channel", "call"):
        assert d.proxy.up < 100_000, f"request not compressed: {d.proxy.up} bytes sent"
    else:
        assert d.proxy.down < 100_000, f"response not compressed: {d.proxy.down} bytes received"
        assert d.proxy.up > len(ZEROS), "the request was compressed without being asked to"


@pytest.mark.timeout(60)
def test_handler_chooses_compression_per_call_and_per_message(deploy):
    def handler(request, context):
        if request == b"gzip":
            context.set_compression(grpc.Compression.Gzip)
        elif request == b"plain":
            context.set_compression(grpc.Compression.Gzip)
            context.disable_next_message_compression()
        return ZEROS
    d = deploy(handler)
    d.call(b"none", timeout=20)
    plain = d.proxy.down
    assert plain > len(ZEROS)
    d.call(b"gzip", timeout=20)
    assert d.proxy.down - plain < 100_000
    before = d.proxy.down
    d.call(b"plain", timeout=20)
    assert d.proxy.down - before > len(ZEROS)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pair", ["grpcio>fabric", "fabric>grpcio", "fabric>fabric"])
def test_the_receive_limit_applies_to_the_inflated_size(pair):
    # 64 MiB of zeros is 64 KiB compressed: refused, not inflated
    big = bytes(64 << 20)
    if pair.endswith("fabric"):
        d = Deployment(pair, lambda r, c: b"never", channel_compression=grpc.Compression.Gzip,
                       options=[("grpc.max_send_message_length", -1)])
        try:
            with pytest.raises(grpc.RpcError) as info:
                d.call(big, timeout=20)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        finally:
            d.close()
    else:
        d = Deployment(pair, lambda r, c: big, server_compression=grpc.Compression.Gzip)
        try:
            with pytest.raises(grpc.RpcError) as info:
                d.call(b"x", timeout=20)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        finally:
            d.close()


def test_decompression_stops_at_the_limit():
    import tracemalloc
    bomb = zlib.compress(bytes(256 << 20))          # 256 MiB inflated, 255 KiB on the wire
    tracemalloc.start()
    try:
        with pytest.raises(_wire.WireError) as info:
            _wire.decompress(bomb, "deflate", 4 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert peak < 16 << 20, f"{peak} bytes allocated to refuse the bomb"
    assert _wire.decompress(zlib.compress(b"abc"), "deflate", 3) == b"abc"
    for bad in (b"not deflate", zlib.compress(b"abc")[:-3]):
        with pytest.raises(_wire.WireError) as info:
            _wire.decompress(bad, "deflate", 100)
        assert info.value.code == grpc.StatusCode.INTERNAL


@pytest.mark.timeout(60)
def test_an_unsupported_encoding_is_unimplemented_with_what_is_accepted():
    # gRPC's compression spec; a raw HTTP/2 client, as stock gRPC clients
    # cannot send an unknown encoding (grpcio's server answers INTERNAL,
    # "Error parsing 'grpc-encoding' metadata", before its handler runs)
    server_kind = "fabric"
    import h2.config
    import h2.connection
    import h2.events
    make_server = grpc.server if server_kind == "grpcio" else fgrpc.server
    server = make_server(futures.ThreadPoolExecutor(2), handlers=[grpc.method_handlers_generic_handler(
        "drop.in", {"Call": grpc.unary_unary_rpc_method_handler(echo)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        conn.initiate_connection()
        conn.send_headers(1, [(b":method", b"POST"), (b":scheme", b"http"), (b":path", METHOD.encode()),
                              (b":authority", b"x"), (b"te", b"trailers"),
                              (b"content-type", b"application/grpc"), (b"grpc-encoding", b"snappy")])
        conn.send_data(1, _wire.prefix(3, compressed=True) + b"abc", end_stream=True)
        sock.sendall(conn.data_to_send())
        headers = {}
        ended = False
        while not ended:
            data = sock.recv(65536)
            assert data, "the server closed without answering"
            for ev in conn.receive_data(data):
                if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    headers.update(dict(ev.headers))
                if isinstance(ev, (h2.events.StreamEnded, h2.events.StreamReset)):
                    ended = True
            sock.sendall(conn.data_to_send())
        assert headers.get(b"grpc-status") == b"12", headers
        assert b"gzip" in headers.get(b"grpc-accept-encoding", b""), headers
    finally:
        sock.close()
        server.stop(0)
