"""fabric.grpc against the real grpcio, both ways, and over fabric streams:
gRPC's interop test cases (empty/large unary, client/server streaming,
ping-pong, empty stream, custom metadata, status, unimplemented, cancel after
begin / first response, timeout on a sleeping server, > 4 MiB messages)."""
import os
import queue
import threading
import time
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")
pytest.importorskip("grpc_tools")

import fabric  # noqa: E402
import fabric.grpc as fgrpc  # noqa: E402
from fabric import backends  # noqa: E402
from grpc_interop import ECHO_INITIAL, ECHO_TRAILING, generated, servicer_class, tls_credentials  # noqa: E402

pb, pb_grpc = generated()

COMBOS = ["grpcio-client>fabric-server", "fabric-client>grpcio-server", "fabric>fabric-plain", "fabric>fabric+tcp",
          "fabric>fabric+ucx", "fabric>fabric+verbs",
          # mutual TLS on plain TCP
          "grpcio-client>fabric-server-tls", "fabric-client>grpcio-server-tls", "fabric>fabric-tls"]
if os.environ.get("FABRIC_TEST_BACKENDS") == "verbs":
    COMBOS = ["fabric>fabric+verbs"]
BIG = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class Deployment:
    def __init__(self, combo, options=None, monkeypatch=None):
        self.combo = combo
        self.servicer = servicer_class()()
        client_kind, server_kind = combo.split(">")
        pool = futures.ThreadPoolExecutor(max_workers=16)
        if server_kind.startswith("fabric+"):
            backend = server_kind.split("+", 1)[1]
            ok, why = backends.available().get(backend, (False, "unknown"))
            if not ok:
                pytest.skip(f"backend {backend} unavailable here: {why}")
            if backend == "ucx" and monkeypatch is not None:
                monkeypatch.setenv("UCX_TLS", "sm")        # read when each Fabric opens UCX
            self.server = fgrpc.server(pool, options=options, fabric=fabric.Fabric(backend))
            port = self.server.add_insecure_port(f"{server_kind}://127.0.0.1:0")
            self.channel = fgrpc.insecure_channel(f"{server_kind}://127.0.0.1:{port}", options=options,
                                                  fabric=fabric.Fabric(backend))
        elif server_kind.endswith("-tls"):
            server_module = grpc if server_kind.startswith("grpcio") else fgrpc
            client_module = grpc if client_kind.startswith("grpcio") else fgrpc
            server_creds, channel_creds = tls_credentials(server_module, client_module)
            self.server = server_module.server(pool, options=options)
            port = self.server.add_secure_port("127.0.0.1:0", server_creds)
            self.channel = client_module.secure_channel(f"localhost:{port}", channel_creds, options=options)
        else:
            make_server = grpc.server if server_kind == "grpcio-server" else fgrpc.server
            self.server = make_server(pool, options=options)
            port = self.server.add_insecure_port("127.0.0.1:0")
            make_channel = grpc.insecure_channel if client_kind == "grpcio-client" else fgrpc.insecure_channel
            self.channel = make_channel(f"127.0.0.1:{port}", options=options)
        pb_grpc.add_TestServiceServicer_to_server(self.servicer, self.server)
        self.server.start()
        self.stub = pb_grpc.TestServiceStub(self.channel)
        self.unimplemented = pb_grpc.UnimplementedServiceStub(self.channel)

    def close(self):
        self.channel.close()
        self.server.stop(0)


@pytest.fixture(params=COMBOS)
def deploy(request, monkeypatch):
    made = []

    def make(options=None):
        d = Deployment(request.param, options, monkeypatch)
        made.append(d)
        return d
    yield make
    for d in made:
        d.close()


@pytest.fixture
def d(deploy):
    return deploy()


def payload(n):
    return pb.Payload(body=os.urandom(n))


@pytest.mark.timeout(60)
def test_empty_unary(d):
    assert isinstance(d.stub.EmptyCall(pb.Empty(), timeout=10), pb.Empty)


@pytest.mark.timeout(60)
def test_large_unary(d):
    response = d.stub.UnaryCall(pb.SimpleRequest(response_size=314159, payload=payload(271828)), timeout=20)
    assert len(response.payload.body) == 314159


@pytest.mark.timeout(60)
def test_client_streaming(d):
    sizes = [27182, 8, 1828, 45904]
    response = d.stub.StreamingInputCall(iter([pb.StreamingInputCallRequest(payload=payload(n)) for n in sizes]),
                                         timeout=20)
    assert response.aggregated_payload_size == 74922


@pytest.mark.timeout(60)
def test_server_streaming(d):
    sizes = [31415, 9, 2653, 58979]
    request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters(size=n) for n in sizes])
    assert [len(r.payload.body) for r in d.stub.StreamingOutputCall(request, timeout=20)] == sizes


class Requests:
    """A request iterator fed one message at a time (for ping-pong)."""
    END = object()

    def __init__(self):
        self.q = queue.Queue()

    def put(self, item):
        self.q.put(item)

    def close(self):
        self.q.put(self.END)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.q.get(timeout=30)
        if item is self.END:
            raise StopIteration
        return item


@pytest.mark.timeout(60)
def test_ping_pong(d):
    requests = Requests()
    responses = d.stub.FullDuplexCall(requests, timeout=20)
    for req_size, resp_size in zip([27182, 8, 1828, 45904], [31415, 9, 2653, 58979]):
        requests.put(pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters(size=resp_size)],
                                                   payload=payload(req_size)))
        assert len(next(responses).payload.body) == resp_size
    requests.close()
    assert list(responses) == []
    assert responses.code() == grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_empty_stream(d):
    responses = d.stub.FullDuplexCall(iter([]), timeout=20)
    assert list(responses) == []
    assert responses.code() == grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_custom_metadata(d):
    initial = (ECHO_INITIAL, "test_initial_metadata_value")
    trailing = (ECHO_TRAILING, b"\x0a\x0b\x0a\x0b\x0a\x0b\x00\xff")
    response, call = d.stub.UnaryCall.with_call(pb.SimpleRequest(response_size=314159, payload=payload(271828)),
                                                metadata=(initial, trailing), timeout=20)
    assert len(response.payload.body) == 314159
    assert initial in call.initial_metadata()
    assert trailing in call.trailing_metadata()
    responses = d.stub.FullDuplexCall(iter([pb.StreamingOutputCallRequest(
        response_parameters=[pb.ResponseParameters(size=314159)], payload=payload(271828))]),
        metadata=(initial, trailing), timeout=20)
    assert initial in responses.initial_metadata()
    assert [len(r.payload.body) for r in responses] == [314159]
    assert trailing in responses.trailing_metadata()


@pytest.mark.timeout(60)
def test_status_code_and_message(d):
    status = pb.EchoStatus(code=2, message="test status message")
    with pytest.raises(grpc.RpcError) as exc:
        d.stub.UnaryCall(pb.SimpleRequest(response_status=status), timeout=20)
    assert exc.value.code() == grpc.StatusCode.UNKNOWN
    assert exc.value.details() == "test status message"
    responses = d.stub.FullDuplexCall(iter([pb.StreamingOutputCallRequest(response_status=status)]), timeout=20)
    with pytest.raises(grpc.RpcError) as exc:
        list(responses)
    assert exc.value.code() == grpc.StatusCode.UNKNOWN
    assert exc.value.details() == "test status message"


@pytest.mark.timeout(60)
def test_special_characters_in_status_message(d):
    message = "\t\ntest with whitespace\r\nand Unicode BMP ☺ and non-BMP 😈\t\n %"
    with pytest.raises(grpc.RpcError) as exc:
        d.stub.UnaryCall(pb.SimpleRequest(response_status=pb.EchoStatus(code=2, message=message)), timeout=20)
    assert exc.value.code() == grpc.StatusCode.UNKNOWN
    assert exc.value.details() == message


@pytest.mark.timeout(60)
def test_unimplemented_method_and_service(d):
    with pytest.raises(grpc.RpcError) as exc:
        d.stub.UnimplementedCall(pb.Empty(), timeout=20)
    assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    with pytest.raises(grpc.RpcError) as exc:
        d.unimplemented.UnimplementedCall(pb.Empty(), timeout=20)
    assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.timeout(60)
def test_cancel_after_begin(d):
    requests = Requests()
    future = d.stub.StreamingInputCall.future(requests, timeout=20)
    time.sleep(0.1)
    assert future.cancel()
    assert future.cancelled()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()
    assert future.code() == grpc.StatusCode.CANCELLED
    requests.close()


@pytest.mark.timeout(60)
def test_cancel_after_first_response(d):
    requests = Requests()
    responses = d.stub.FullDuplexCall(requests, timeout=20)
    requests.put(pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters(size=31415)],
                                               payload=payload(27182)))
    assert len(next(responses).payload.body) == 31415
    responses.cancel()
    with pytest.raises(grpc.RpcError) as exc:
        next(responses)
    assert exc.value.code() == grpc.StatusCode.CANCELLED
    assert d.servicer.cancelled.wait(10), "the server never learned of the cancellation"
    requests.close()


@pytest.mark.timeout(60)
def test_timeout_on_sleeping_server(d):
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as exc:
        d.stub.UnaryCall(pb.SimpleRequest(sleep_ms=10000), timeout=0.3)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    assert d.servicer.cancelled.wait(10), "the server kept running past the deadline"


@pytest.mark.timeout(60)
def test_messages_above_4mib_need_raised_limits(deploy):
    d = deploy()
    with pytest.raises(grpc.RpcError) as exc:            # default limits: 4 MiB on receive
        d.stub.UnaryCall(pb.SimpleRequest(response_size=5 << 20), timeout=20)
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    big = deploy(BIG)
    response = big.stub.UnaryCall(pb.SimpleRequest(response_size=6 << 20, payload=payload(5 << 20)), timeout=30)
    assert len(response.payload.body) == 6 << 20
    request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters(size=9 << 20)] * 2)
    assert [len(r.payload.body) for r in big.stub.StreamingOutputCall(request, timeout=30)] == [9 << 20] * 2


@pytest.mark.timeout(90)
def test_many_concurrent_calls_on_one_channel(d):
    errors = []

    def worker(i):
        try:
            for k in range(10):
                n = (i * 7919 + k * 104729) % 70000
                r = d.stub.UnaryCall(pb.SimpleRequest(response_size=n, payload=payload(n // 2)), timeout=30)
                assert len(r.payload.body) == n
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]


@pytest.mark.timeout(60)
def test_futures_and_with_call(d):
    fs = [d.stub.UnaryCall.future(pb.SimpleRequest(response_size=i * 1000), timeout=20) for i in range(8)]
    assert [len(f.result(timeout=20).payload.body) for f in fs] == [i * 1000 for i in range(8)]
    response, call = d.stub.EmptyCall.with_call(pb.Empty(), timeout=20)
    assert call.code() == grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_a_finished_future_has_its_response(d):
    # a done callback runs the moment the call finishes: the response must be
    # stored by then (the call used to finish OK first, result() gave None)
    seen, done = [], threading.Event()

    def on_done(f):
        seen.append(f.result())
        if len(seen) == 16:
            done.set()
    fs = [d.stub.UnaryCall.future(pb.SimpleRequest(response_size=i), timeout=20) for i in range(16)]
    for f in fs:
        f.add_done_callback(on_done)
    assert done.wait(30)
    assert sorted(len(r.payload.body) for r in seen) == list(range(16))
    assert [len(f.result(timeout=1).payload.body) for f in fs] == list(range(16))


@pytest.mark.timeout(60)
def test_one_server_on_plain_tcp_and_a_fabric_address_at_once():
    servicer = servicer_class()()
    server = fgrpc.server(futures.ThreadPoolExecutor(8))
    pb_grpc.add_TestServiceServicer_to_server(servicer, server)
    plain = server.add_insecure_port("127.0.0.1:0")
    fab_port = server.add_insecure_port("fabric+tcp://127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{plain}") as stock, \
                fgrpc.insecure_channel(f"fabric+tcp://127.0.0.1:{fab_port}") as ours:
            for channel in (stock, ours):
                r = pb_grpc.TestServiceStub(channel).UnaryCall(pb.SimpleRequest(response_size=1000), timeout=10)
                assert len(r.payload.body) == 1000
    finally:
        server.stop(0)


@pytest.mark.timeout(60)
def test_unreachable_server_is_unavailable():
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    for target in (f"127.0.0.1:{port}", f"fabric+tcp://127.0.0.1:{port}"):
        with fgrpc.insecure_channel(target) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                pb_grpc.TestServiceStub(channel).EmptyCall(pb.Empty(), timeout=5)
            assert exc.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_bad_targets_are_refused():
    for target in ("nohost", "http://x:1", "fabric+tcp://host", "x:y"):
        with pytest.raises(ValueError):
            fgrpc.insecure_channel(target)


@pytest.mark.timeout(60)
def test_large_messages_over_fabric_go_zero_copy():
    """Large DATA payloads between fabric.grpc peers are written from the
    caller's buffer and read straight into the message's own buffer."""
    servicer = servicer_class()()
    server = fgrpc.server(futures.ThreadPoolExecutor(4), options=BIG)
    pb_grpc.add_TestServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("fabric+tcp://127.0.0.1:0")
    server.start()
    try:
        with fgrpc.insecure_channel(f"fabric+tcp://127.0.0.1:{port}", options=BIG) as channel:
            stub = pb_grpc.TestServiceStub(channel)
            body = os.urandom(3 << 20)
            r = stub.UnaryCall(pb.SimpleRequest(response_size=5 << 20, payload=pb.Payload(body=body)), timeout=20)
            assert len(r.payload.body) == 5 << 20
            counters = channel._conn.counters
            # the 3 MiB request left as views of the serialized bytes, the 5 MiB
            # response was read into its message buffer (all but what came with its frame header)
            assert counters["zero_copy_pieces_sent"] >= 1
            assert counters["direct_bytes_received"] >= (5 << 20) - (1 << 20)
    finally:
        server.stop(0)


@pytest.mark.timeout(60)
def test_garbage_closes_only_that_connection():
    """Bytes that are not HTTP/2 (on plain TCP and on a fabric stream) close
    that connection; the server keeps serving everyone else."""
    import socket
    servicer = servicer_class()()
    server = fgrpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_TestServiceServicer_to_server(servicer, server)
    plain = server.add_insecure_port("127.0.0.1:0")
    fab_port = server.add_insecure_port("fabric+tcp://127.0.0.1:0")
    server.start()
    try:
        s = socket.create_connection(("127.0.0.1", plain), timeout=10)
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(4096))
        s.settimeout(10)
        while s.recv(65536):              # the server answers (GOAWAY) and closes
            pass
        s.close()
        preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(64),      # not HTTP/2 at all
                     preface + b"\x00\x00\x04\x00\x00\x00\x00\x00\x00abcd"):  # DATA on stream 0
            stream = fabric.Fabric("tcp").connect_stream(f"127.0.0.1:{fab_port}", timeout=10)
            stream.write(junk)
            started = time.monotonic()
            with pytest.raises(fabric.FabricError):
                while stream.read(timeout=10):         # the server's SETTINGS / GOAWAY, then closed
                    pass
                raise fabric.ConnectionClosed("end of stream")
            assert time.monotonic() - started < 5
            stream.close()
        for target in (f"127.0.0.1:{plain}", f"fabric+tcp://127.0.0.1:{fab_port}"):
            with fgrpc.insecure_channel(target) as channel:
                assert isinstance(pb_grpc.TestServiceStub(channel).EmptyCall(pb.Empty(), timeout=10), pb.Empty)
    finally:
        server.stop(0)
