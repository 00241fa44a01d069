"""fabric.grpc for asyncio, as grpc.aio: channels and servers whose calls run
as tasks of the event loop (no thread per call or per connection), over
plain TCP (host:port, stock gRPC peers) and fabric streams
(fabric[+backend]://host:port).

    channel = fabric.grpc.aio.insecure_channel("fabric+ucx://10.0.0.1:50051")
    stub = helloworld_pb2_grpc.GreeterStub(channel)
    reply = await stub.SayHello(request)

    server = fabric.grpc.aio.server()
    helloworld_pb2_grpc.add_GreeterServicer_to_server(Greeter(), server)
    server.add_insecure_port("0.0.0.0:50051")
    await server.start()
    await server.wait_for_termination()

The classes subclass grpc.aio's (isinstance checks of other libraries pass);
errors are grpc.aio.AioRpcError, the end of a stream grpc.aio.EOF.
"""
from __future__ import annotations

from grpc.aio import EOF, AioRpcError, Metadata

from fabric.grpc.aio._channel import Channel
from fabric.grpc.aio._context import ServicerContext
from fabric.grpc.aio._server import Server

__all__ = ["insecure_channel", "secure_channel", "server", "Channel", "Server", "ServicerContext", "AioRpcError", "EOF",
           "Metadata"]


def insecure_channel(target, options=None, compression=None, interceptors=None, fabric=None) -> Channel:
    """A grpc.aio.Channel to target (host:port, or fabric[+backend]://host:port)."""
    return Channel(target, options, compression, interceptors, fabric)


def secure_channel(target, credentials, options=None, compression=None, interceptors=None) -> Channel:
    """A grpc.aio.Channel over TLS to target (host:port); credentials from
    grpc.ssl_channel_credentials or fabric.grpc.ssl_channel_credentials."""
    return Channel(target, options, compression, interceptors, None, credentials)


def server(migration_thread_pool=None, handlers=None, interceptors=None, options=None,
           maximum_concurrent_rpcs=None, compression=None, fabric=None) -> Server:
    """A grpc.aio.Server; add_insecure_port takes host:port and fabric[+backend]://host:port."""
    return Server(migration_thread_pool, handlers, interceptors, options, maximum_concurrent_rpcs,
                  compression, fabric)
