"""fabric.grpc.aio against grpc.aio, both ways, and over fabric streams: gRPC's
interop test cases (empty/large unary, client/server streaming, ping-pong,
empty stream, custom metadata, status and special messages, unimplemented
method and service, cancel after begin / first response, timeout on a
sleeping server), grpc.aio's call objects and ServicerContext, and
isinstance checks against grpc.aio's classes."""
import asyncio
import os

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")
pytest.importorskip("grpc_tools")

import grpc.aio  # noqa: E402

import fabric  # noqa: E402
import fabric.grpc as fgrpc  # noqa: E402
import fabric.grpc.aio as faio  # noqa: E402
from fabric import backends  # noqa: E402
from grpc_interop import ECHO_INITIAL, ECHO_TRAILING, async_servicer_class, generated, tls_credentials  # noqa: E402

pb, pb_grpc = generated()

COMBOS = ["grpcio-client>fabric-server", "fabric-client>grpcio-server", "fabric>fabric-plain",
          "fabric>fabric+tcp", "fabric>fabric+ucx", "fabric>fabric+verbs",
          # mutual TLS on plain TCP
          "grpcio-client>fabric-server-tls", "fabric-client>grpcio-server-tls", "fabric>fabric-tls"]
if os.environ.get("FABRIC_TEST_BACKENDS") == "verbs":
    COMBOS = ["fabric>fabric+verbs"]
BIG = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class Deployment:
    async def start(self, combo, options=None, monkeypatch=None):
        self.servicer = async_servicer_class()()
        client_kind, server_kind = combo.split(">")
        if server_kind.startswith("fabric+"):
            backend = server_kind.split("+", 1)[1]
            ok, why = backends.available().get(backend, (False, "unknown"))
            if not ok:
                pytest.skip(f"backend {backend} unavailable here: {why}")
            if backend == "ucx" and monkeypatch is not None:
                monkeypatch.setenv("UCX_TLS", "sm")
            self.fabrics = [fabric.Fabric(backend), fabric.Fabric(backend)]
            self.server = faio.server(options=options, fabric=self.fabrics[0])
            port = self.server.add_insecure_port(f"{server_kind}://127.0.0.1:0")
            self.channel = faio.insecure_channel(f"{server_kind}://127.0.0.1:{port}", options=options,
                                                 fabric=self.fabrics[1])
        elif server_kind.endswith("-tls"):
            self.fabrics = []
            stock_server, stock_client = server_kind.startswith("grpcio"), client_kind.startswith("grpcio")
            server_creds, channel_creds = tls_credentials(grpc if stock_server else fgrpc, grpc if stock_client else fgrpc)
            self.server = (grpc.aio if stock_server else faio).server(options=options)
            port = self.server.add_secure_port("127.0.0.1:0", server_creds)
            self.channel = (grpc.aio if stock_client else faio).secure_channel(f"localhost:{port}", channel_creds,
                                                                               options=options)
        else:
            self.fabrics = []
            self.server = (grpc.aio.server if server_kind == "grpcio-server" else faio.server)(options=options)
            port = self.server.add_insecure_port("127.0.0.1:0")
            make_channel = grpc.aio.insecure_channel if client_kind == "grpcio-client" else faio.insecure_channel
            self.channel = make_channel(f"127.0.0.1:{port}", options=options)
        pb_grpc.add_TestServiceServicer_to_server(self.servicer, self.server)
        await self.server.start()
        self.stub = pb_grpc.TestServiceStub(self.channel)
        self.unimplemented = pb_grpc.UnimplementedServiceStub(self.channel)
        return self

    async def close(self):
        await self.channel.close()
        await self.server.stop(0)
        for f in self.fabrics:
            f.close()


@pytest.fixture(params=COMBOS)
def combo(request):
    return request.param


def run(combo, monkeypatch, test, options=None, timeout=60):
    """Run test(deployment) in a fresh event loop, bounded in time."""
    async def main():
        d = await Deployment().start(combo, options, monkeypatch)
        try:
            await asyncio.wait_for(test(d), timeout)
        finally:
            await d.close()
    asyncio.run(main())


def payload(n):
    return pb.Payload(body=os.urandom(n))


@pytest.mark.timeout(90)
def test_empty_and_large_unary(combo, monkeypatch):
    async def test(d):
        assert isinstance(await d.stub.EmptyCall(pb.Empty(), timeout=10), pb.Empty)
        call = d.stub.UnaryCall(pb.SimpleRequest(response_size=314159, payload=payload(271828)), timeout=20)
        assert isinstance(call, grpc.aio.UnaryUnaryCall)
        response = await call
        assert len(response.payload.body) == 314159
        assert await call.code() == grpc.StatusCode.OK
        assert call.done() and not call.cancelled()
    run(combo, monkeypatch, test)


@pytest.mark.timeout(90)
def test_client_streaming_by_iterator_and_by_write(combo, monkeypatch):
    sizes = [27182, 8, 1828, 45904]

    async def test(d):
        async def requests():
            for n in sizes:
                yield pb.StreamingInputCallRequest(payload=payload(n))
        response = await d.stub.StreamingInputCall(requests(), timeout=20)
        assert response.aggregated_payload_size == 74922
        call = d.stub.StreamingInputCall(timeout=20)
        assert isinstance(call, grpc.aio.StreamUnaryCall)
        for n in sizes:
            await call.write(pb.StreamingInputCallRequest(payload=payload(n)))
        await call.done_writing()
        assert (await call).aggregated_payload_size == 74922
        # a plain iterable works too
        response = await d.stub.StreamingInputCall(iter([pb.StreamingInputCallRequest(payload=payload(5))]),
                                                   timeout=20)
        assert response.aggregated_payload_size == 5
    run(combo, monkeypatch, test)


@pytest.mark.timeout(90)
def test_server_streaming_by_iteration_and_by_read(combo, monkeypatch):
    sizes = [31415, 9, 2653, 58979]
    request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters(size=n) for n in sizes])

    async def test(d):
        call = d.stub.StreamingOutputCall(request, timeout=20)
        assert isinstance(call, grpc.aio.UnaryStreamCall)
        assert [len(r.payload.body) async for r in call] == sizes
        call = d.stub.StreamingOutputCall(request, timeout=20)
        got = []
        while True:
            r = await call.read()
            if r is grpc.aio.EOF:
                break
            got.append(len(r.payload.body))
        assert got == sizes
        assert await call.code() == grpc.StatusCode.OK
    run(combo, monkeypatch, test)


@pytest.mark.timeout(90)
def test_ping_pong_and_empty_stream(combo, monkeypatch):
    async def test(d):
        call = d.stub.FullDuplexCall(timeout=20)
        assert isinstance(call, grpc.aio.StreamStreamCall)
        for req_size, resp_size in zip([27182, 8, 1828, 45904], [31415, 9, 2653, 58979]):
            await call.write(pb.StreamingOutputCallRequest(
                response_parameters=[pb.ResponseParameters(size=resp_size)], payload=payload(req_size)))
            assert len((await call.read()).payload.body) == resp_size
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        empty = d.stub.FullDuplexCall(timeout=20)
        await empty.done_writing()
        assert [r async for r in empty] == []
        assert await empty.code() == grpc.StatusCode.OK
    run(combo, monkeypatch, test)


@pytest.mark.timeout(90)
def test_custom_metadata(combo, monkeypatch):
    initial = (ECHO_INITIAL, "test_initial_metadata_value")
    trailing = (ECHO_TRAILING, b"\x0a\x0b\x0a\x0b\x0a\x0b\x00\xff")

    async def test(d):
        call = d.stub.UnaryCall(pb.SimpleRequest(response_size=314159, payload=payload(271828)),
                                metadata=(initial, trailing), timeout=20)
        assert len((await call).payload.body) == 314159
        assert initial in tuple(await call.initial_metadata())
        assert trailing in tuple(await call.trailing_metadata())
        assert isinstance(await call.initial_metadata(), grpc.aio.Metadata)
        call = d.stub.FullDuplexCall(metadata=(initial, trailing), timeout=20)
        await call.write(pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters(size=314159)],
                                                       payload=payload(271828)))
        await call.done_writing()
        assert initial in tuple(await call.initial_metadata())
        assert [len(r.payload.body) async for r in call] == [314159]
        assert trailing in tuple(await call.trailing_metadata())
    run(combo, monkeypatch, test)


@pytest.mark.timeout(90)
def test_status_code_and_special_messages(combo, monkeypatch):
    async def test(d):
        for message in ("test status message", "\t\ntest with whitespace\r\nand Unicode BMP ☺ and non-BMP 😈\t\n %"):
            status = pb.EchoStatus(code=2, message=message)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await d.stub.UnaryCall(pb.SimpleRequest(response_status=status), timeout=20)
            assert exc.value.code() == grpc.StatusCode.UNKNOWN
            assert exc.value.details() == message
            call = d.stub.FullDuplexCall(timeout=20)
            await call.write(pb.StreamingOutputCallRequest(response_status=status))
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call.read()
            assert exc.value.code() == grpc.StatusCode.UNKNOWN
            assert exc.value.details() == message
            assert await call.details() == message
    run(combo, monkeypatch, test)


@pytest.mark.timeout(90)
def test_unimplemented_method_and_service(combo, monkeypatch):
    async def test(d):
        for stub in (d.stub, d.unimplemented):
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await stub.UnimplementedCall(pb.Empty(), timeout=20)
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    run(combo, monkeypatch, test)


@pytest.mark.timeout(90)
def test_cancel_after_begin_and_after_first_response(combo, monkeypatch):
    async def test(d):
        call = d.stub.StreamingInputCall(timeout=20)
        await asyncio.sleep(0.1)
        assert call.cancel()
        assert call.cancelled()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await call.code() == grpc.StatusCode.CANCELLED

        call = d.stub.FullDuplexCall(timeout=20)
        await call.write(pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters(size=31415)],
                                                       payload=payload(27182)))
        assert len((await call.read()).payload.body) == 31415
        assert call.cancel()
        assert not call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
        await asyncio.wait_for(d.servicer.cancelled.wait(), 10)     # the server learned of it
    run(combo, monkeypatch, test)


@pytest.mark.timeout(90)
def test_timeout_on_sleeping_server(combo, monkeypatch):
    async def test(d):
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await d.stub.UnaryCall(pb.SimpleRequest(sleep_ms=10000), timeout=0.3)
        assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert loop.time() - started < 5
        await asyncio.wait_for(d.servicer.cancelled.wait(), 10)     # the handler was cancelled
    run(combo, monkeypatch, test)


@pytest.mark.timeout(90)
def test_messages_above_4mib_need_raised_limits(combo, monkeypatch):
    async def refused(d):
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await d.stub.UnaryCall(pb.SimpleRequest(response_size=5 << 20), timeout=20)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    run(combo, monkeypatch, refused)

    async def allowed(d):
        response = await d.stub.UnaryCall(pb.SimpleRequest(response_size=6 << 20, payload=payload(5 << 20)),
                                          timeout=30)
        assert len(response.payload.body) == 6 << 20
        request = pb.StreamingOutputCallRequest(response_parameters=[pb.ResponseParameters(size=9 << 20)] * 2)
        assert [len(r.payload.body) async for r in d.stub.StreamingOutputCall(request, timeout=30)] == [9 << 20] * 2
    run(combo, monkeypatch, allowed, options=BIG)


@pytest.mark.timeout(120)
def test_many_concurrent_calls_on_one_channel(combo, monkeypatch):
    async def test(d):
        responses = await asyncio.gather(*[d.stub.UnaryCall(pb.SimpleRequest(response_size=i), timeout=30)
                                           for i in range(500)])
        assert [len(r.payload.body) for r in responses] == list(range(500))
    run(combo, monkeypatch, test, timeout=90)


def test_classes_are_grpc_aio_classes():
    async def main():
        server = faio.server()
        channel = faio.insecure_channel("127.0.0.1:1")
        assert isinstance(server, grpc.aio.Server)
        assert isinstance(channel, grpc.aio.Channel)
        assert isinstance(channel.unary_unary("/a/b"), grpc.aio.UnaryUnaryMultiCallable)
        assert isinstance(channel.unary_stream("/a/b"), grpc.aio.UnaryStreamMultiCallable)
        assert isinstance(channel.stream_unary("/a/b"), grpc.aio.StreamUnaryMultiCallable)
        assert isinstance(channel.stream_stream("/a/b"), grpc.aio.StreamStreamMultiCallable)
        assert not isinstance(channel.stream_stream("/a/b"), grpc.aio.StreamUnaryMultiCallable)
        await channel.close()
        await server.stop(0)
    asyncio.run(main())


@pytest.mark.timeout(60)
def test_unreachable_server_is_unavailable():
    async def main():
        async with faio.insecure_channel("127.0.0.1:1") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await channel.unary_unary("/a/b")(b"x", timeout=5)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_server_context_has_what_grpc_aio_gives():
    seen = {}

    async def handler(request, context):
        assert isinstance(context, grpc.aio.ServicerContext)
        seen["peer"] = context.peer()
        seen["remaining"] = context.time_remaining()
        context.add_done_callback(lambda ctx: seen.setdefault("done", True))
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no", trailing_metadata=(("why", "because"),))

    async def main():
        server = faio.server(handlers=[grpc.method_handlers_generic_handler(
            "t.S", {"M": grpc.unary_unary_rpc_method_handler(handler)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await channel.unary_unary("/t.S/M")(b"x", timeout=5)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert ("why", "because") in tuple(exc.value.trailing_metadata())
        await server.stop(0)
        assert await server.wait_for_termination(1)
    asyncio.run(main())
    assert seen["peer"].startswith("ipv4:127.0.0.1:"), seen
    # grpc core rounds the grpc-timeout it sends up to a coarse unit (10 ms
    # steps were seen), so the server may see a little more than 5 s
    assert 0 < seen["remaining"] <= 5.1 and seen["done"], seen


AIO_TRANSPORTS = ["plain", "fabric+tcp"]
if os.environ.get("FABRIC_TEST_BACKENDS") == "verbs":
    AIO_TRANSPORTS = ["fabric+verbs"]          # the guest: only what needs rxe0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", AIO_TRANSPORTS)
@pytest.mark.parametrize("compression", [None, grpc.Compression.Gzip])
def test_large_messages_go_zero_copy_and_arrive_intact(transport, compression):
    """Large DATA frames are written from the caller's buffer (frame header
    and payload apart) and, on a fabric stream, received into the message's
    own buffer; sizes around frame and window boundaries, a mutable buffer
    changed right after write() returned, and gzip'd messages arrive intact."""
    import hashlib

    async def digest_each(request_iterator, context):
        out = []
        async for m in request_iterator:
            out.append(hashlib.sha256(m).hexdigest())
        return ",".join(out).encode()

    async def main():
        handler = grpc.method_handlers_generic_handler("big.Big", {
            "Digests": grpc.stream_unary_rpc_method_handler(digest_each),
            "Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)})
        name = transport.split("+", 1)[-1]
        fabrics = [] if transport == "plain" else [fabric.Fabric(name), fabric.Fabric(name)]
        server = faio.server(handlers=[handler], options=BIG, fabric=fabrics[0] if fabrics else None)
        address = "127.0.0.1:0" if transport == "plain" else f"{transport}://127.0.0.1:0"
        port = server.add_insecure_port(address)
        await server.start()
        target = f"127.0.0.1:{port}" if transport == "plain" else f"{transport}://127.0.0.1:{port}"
        channel = faio.insecure_channel(target, options=BIG, compression=compression,
                                        fabric=fabrics[1] if fabrics else None)
        try:
            sizes = [65536, 65536 + 1, (1 << 20) - 5, 16 << 20, (16 << 20) + 7, 3 << 20]
            blobs = [os.urandom(n) for n in sizes]
            call = channel.stream_unary("/big.Big/Digests")()
            expected = []
            for blob in blobs:
                mutable = bytearray(blob)
                await call.write(mutable)
                expected.append(hashlib.sha256(blob).hexdigest())
                mutable[:] = b"\0" * len(mutable)           # the call must not see this
            await call.done_writing()
            assert (await call).decode().split(",") == expected
            big = os.urandom(5 << 20)
            assert await channel.unary_unary("/big.Big/Echo")(big, timeout=60) == big
            # large payloads left as views of the caller's buffer, and (over a fabric)
            # the response was read straight into its message buffer
            assert channel._conn.counters["zero_copy_pieces_sent"] >= len(sizes)
            if transport != "plain" and compression is None:
                assert channel._conn.counters["direct_bytes_received"] >= (5 << 20) - (1 << 20)
        finally:
            await channel.close()
            await server.stop(None)
            for f in fabrics:
                f.close()
    asyncio.run(main())
