"""A fabric.grpc server or client in its own process, for tests that kill
one side mid-call.

    python tests/grpc_peer.py serve sync|aio ADDRESS     # prints the port, serves until killed
    python tests/grpc_peer.py hang sync|aio TARGET N     # opens N calls that never end, prints "ready"
    python tests/grpc_peer.py serve stock ADDRESS        # the same service on a stock grpcio server

Service /peer.Peer: Echo (unary, the request back), Hang (unary that ends only
when cancelled), Count (server streaming: the request's number of 8-byte
messages), Drip (server streaming, a message every 10 ms until cancelled).
"""
import asyncio
import os
import sys
import threading
import time
from concurrent import futures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

import fabric.grpc as fgrpc  # noqa: E402
import fabric.grpc.aio as faio  # noqa: E402

OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def sync_handlers():
    def echo(request, context):
        return request

    def hang(request, context):
        done = threading.Event()
        context.add_callback(done.set)
        done.wait(600)
        return b""

    def count(request, context):
        for i in range(int(request.decode())):
            yield i.to_bytes(8, "little")

    def drip(request, context):
        i = 0
        while context.is_active():
            yield i.to_bytes(8, "little")
            i += 1
            time.sleep(0.01)
    return [grpc.method_handlers_generic_handler("peer.Peer", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Hang": grpc.unary_unary_rpc_method_handler(hang),
        "Count": grpc.unary_stream_rpc_method_handler(count),
        "Drip": grpc.unary_stream_rpc_method_handler(drip)})]


def aio_handlers():
    async def echo(request, context):
        return request

    async def hang(request, context):
        await asyncio.sleep(600)
        return b""

    async def count(request, context):
        for i in range(int(request.decode())):
            yield i.to_bytes(8, "little")

    async def drip(request, context):
        i = 0
        while True:
            yield i.to_bytes(8, "little")
            i += 1
            await asyncio.sleep(0.01)
    return [grpc.method_handlers_generic_handler("peer.Peer", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Hang": grpc.unary_unary_rpc_method_handler(hang),
        "Count": grpc.unary_stream_rpc_method_handler(count),
        "Drip": grpc.unary_stream_rpc_method_handler(drip)})]


def serve(kind, address):
    if kind in ("sync", "stock"):
        make = grpc.server if kind == "stock" else fgrpc.server
        server = make(futures.ThreadPoolExecutor(64), handlers=sync_handlers(), options=OPTIONS)
        port = server.add_insecure_port(address)
        server.start()
        print(port, flush=True)
        server.wait_for_termination()
        return

    async def main():
        server = faio.server(handlers=aio_handlers(), options=OPTIONS)
        port = server.add_insecure_port(address)
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()
    asyncio.run(main())


def hang(kind, target, n):
    n = int(n)
    if kind == "sync":
        channel = fgrpc.insecure_channel(target, options=OPTIONS)
        calls = [channel.unary_unary("/peer.Peer/Hang").future(b"", timeout=600) for _ in range(n)]
        channel.unary_unary("/peer.Peer/Echo")(b"x", timeout=30)   # all of them are on the wire
        print("ready", flush=True)
        for c in calls:
            c.exception()
        return

    async def main():
        channel = faio.insecure_channel(target, options=OPTIONS)
        calls = [asyncio.ensure_future(channel.unary_unary("/peer.Peer/Hang")(b"", timeout=600))
                 for _ in range(n)]
        await channel.unary_unary("/peer.Peer/Echo")(b"x", timeout=30)
        print("ready", flush=True)
        await asyncio.gather(*calls, return_exceptions=True)
    asyncio.run(main())


if __name__ == "__main__":
    {"serve": serve, "hang": hang}[sys.argv[1]](*sys.argv[2:])
