"""Interceptors, as grpcio runs them: server interceptors on fabric.grpc and
fabric.grpc.aio servers (order, metadata, rejecting a call, wrapping the
handler), client interceptors on fabric.grpc.aio channels for the four call
kinds (changing metadata, answering in place of the server); each against
the stock implementation doing the same."""
import asyncio
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")

import grpc.aio  # noqa: E402

import fabric.grpc as fgrpc  # noqa: E402
import fabric.grpc.aio as faio  # noqa: E402


def echo(request, context):
    return request + b"|" + dict(context.invocation_metadata()).get("x-tag", "-").encode()


async def aecho(request, context):
    return echo(request, context)


async def astream_out(request, context):
    for i in range(3):
        yield request + bytes([48 + i])


async def astream_in(request_iterator, context):
    return b"".join([r async for r in request_iterator]) + b"|" + \
        dict(context.invocation_metadata()).get("x-tag", "-").encode()


async def abidi(request_iterator, context):
    async for r in request_iterator:
        yield r.upper()


def sync_handlers():
    return [grpc.method_handlers_generic_handler("t.S", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})]


def async_handlers():
    return [grpc.method_handlers_generic_handler("t.S", {
        "Echo": grpc.unary_unary_rpc_method_handler(aecho),
        "Out": grpc.unary_stream_rpc_method_handler(astream_out),
        "In": grpc.stream_unary_rpc_method_handler(astream_in),
        "Bidi": grpc.stream_stream_rpc_method_handler(abidi)})]


class Recorder(grpc.ServerInterceptor):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def intercept_service(self, continuation, details):
        self.log.append((self.name, details.method))
        return continuation(details)


class Gate(grpc.ServerInterceptor):
    """Rejects calls without the right token; wraps the handler of others."""

    def intercept_service(self, continuation, details):
        if ("token", "open") not in tuple(details.invocation_metadata):
            def deny(request, context):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token")
            return grpc.unary_unary_rpc_method_handler(deny)
        handler = continuation(details)

        def wrapped(request, context):
            return handler.unary_unary(request, context) + b"|gated"
        return grpc.unary_unary_rpc_method_handler(wrapped, handler.request_deserializer,
                                                   handler.response_serializer)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server_kind", ["fabric", "grpcio"])
def test_sync_server_interceptors(server_kind):
    log = []
    make = fgrpc.server if server_kind == "fabric" else grpc.server
    server = make(futures.ThreadPoolExecutor(4), handlers=sync_handlers(),
                  interceptors=[Recorder("outer", log), Recorder("inner", log), Gate()])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.S/Echo")
            assert call(b"a", metadata=(("token", "open"),), timeout=10) == b"a|-|gated"
            with pytest.raises(grpc.RpcError) as exc:
                call(b"a", timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert log[:2] == [("outer", "/t.S/Echo"), ("inner", "/t.S/Echo")]
    finally:
        server.stop(0)


class AioRecorder(grpc.aio.ServerInterceptor):
    def __init__(self, name, log):
        self.name, self.log = name, log

    async def intercept_service(self, continuation, details):
        self.log.append((self.name, details.method))
        return await continuation(details)


class AioGate(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        if ("token", "open") not in tuple(details.invocation_metadata):
            async def deny(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token")
            return grpc.unary_unary_rpc_method_handler(deny)
        return await continuation(details)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server_kind", ["fabric", "grpcio"])
def test_aio_server_interceptors(server_kind):
    log = []

    async def main():
        make = faio.server if server_kind == "fabric" else grpc.aio.server
        server = make(handlers=async_handlers(), interceptors=[AioRecorder("outer", log),
                                                               AioRecorder("inner", log), AioGate()])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.S/Echo")
            assert await call(b"a", metadata=(("token", "open"),), timeout=10) == b"a|-"
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call(b"a", timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await server.stop(0)
    asyncio.run(main())
    assert log[:2] == [("outer", "/t.S/Echo"), ("inner", "/t.S/Echo")]


def tagged(details, tag):
    metadata = grpc.aio.Metadata(*tuple(details.metadata or ()), ("x-tag", tag))
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                      details.wait_for_ready)


class UnaryTagger(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds metadata to the calls of its kind; records them."""

    def __init__(self, tag, seen):
        self.tag, self.seen = tag, seen

    async def intercept_unary_unary(self, continuation, details, request):
        self.seen.append(details.method)
        return await continuation(tagged(details, self.tag), request)


class ServerStreamTagger(UnaryTagger, grpc.aio.UnaryStreamClientInterceptor):
    # also a UnaryUnaryClientInterceptor: grpc.aio uses it for unary calls only
    async def intercept_unary_stream(self, continuation, details, request):
        raise AssertionError("an interceptor serves the first kind it is of")


class OutTagger(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, tag, seen):
        self.tag, self.seen = tag, seen

    async def intercept_unary_stream(self, continuation, details, request):
        self.seen.append(details.method)
        return await continuation(tagged(details, self.tag), request)


class InTagger(OutTagger, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        raise AssertionError("an interceptor serves the first kind it is of")


class ClientStreamTagger(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, tag, seen):
        self.tag, self.seen = tag, seen

    async def intercept_stream_unary(self, continuation, details, request_iterator):
        self.seen.append(details.method)
        return await continuation(tagged(details, self.tag), request_iterator)


class Doubler(grpc.aio.StreamStreamClientInterceptor):
    """Answers with an async iterator of its own in place of the call."""

    def __init__(self, tag, seen):
        self.tag, self.seen = tag, seen

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        self.seen.append(details.method)
        call = await continuation(tagged(details, self.tag), request_iterator)

        async def doubled():
            async for r in call:
                yield r
                yield r
        return doubled()


class Cache(grpc.aio.UnaryUnaryClientInterceptor):
    """Answers b"cached" without calling the server."""

    async def intercept_unary_unary(self, continuation, details, request):
        if request == b"cached?":
            return b"cached"
        return await continuation(details, request)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("client_kind", ["fabric", "grpcio"])
@pytest.mark.parametrize("server_kind", ["fabric", "grpcio"])
def test_aio_client_interceptors_on_every_call_kind(client_kind, server_kind):
    seen = []
    interceptors = [Cache(), UnaryTagger("t1", seen), ServerStreamTagger("t2", seen), OutTagger("t1", seen),
                    InTagger("t2", seen), ClientStreamTagger("t1", seen), Doubler("t1", seen)]

    async def main():
        server = (faio.server if server_kind == "fabric" else grpc.aio.server)(handlers=async_handlers())
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        make = faio.insecure_channel if client_kind == "fabric" else grpc.aio.insecure_channel
        async with make(f"127.0.0.1:{port}", interceptors=interceptors) as channel:
            # two unary interceptors in order: the inner one's tag comes last
            assert await channel.unary_unary("/t.S/Echo")(b"a", timeout=10) == b"a|t2"
            assert await channel.unary_unary("/t.S/Echo")(b"cached?", timeout=10) == b"cached"
            call = channel.unary_stream("/t.S/Out")(b"o", timeout=10)
            assert [r async for r in call] == [b"o0", b"o1", b"o2"]
            assert await call.code() == grpc.StatusCode.OK

            async def parts():
                yield b"x"
                yield b"y"
            assert await channel.stream_unary("/t.S/In")(parts(), timeout=10) == b"xy|t1"
            call = channel.stream_unary("/t.S/In")(timeout=10)
            await call.write(b"p")
            await call.write(b"q")
            await call.done_writing()
            assert await call == b"pq|t1"
            call = channel.stream_stream("/t.S/Bidi")(timeout=10)
            await call.write(b"m")
            await call.done_writing()
            assert [r async for r in call] == [b"M", b"M"]
        await server.stop(0)
    asyncio.run(main())
    # (grpc.aio gives interceptors the method as bytes)
    assert seen == [b"/t.S/Echo", b"/t.S/Echo", b"/t.S/Out", b"/t.S/Out", b"/t.S/In", b"/t.S/In", b"/t.S/Bidi"]


def test_interceptors_of_the_wrong_kind_are_refused():
    with pytest.raises(TypeError):
        fgrpc.server(futures.ThreadPoolExecutor(1), interceptors=[object()])

    async def main():
        with pytest.raises(ValueError):
            faio.server(interceptors=[Recorder("sync", [])])
        with pytest.raises(ValueError):
            faio.insecure_channel("127.0.0.1:1", interceptors=[object()])
    asyncio.run(main())
