"""Messages of every size through fabric.grpc's HTTP/2 core, end to end:
empty, small, between one DATA frame and 1 MiB, and large (several
frames, not frame-aligned); unary, client streaming and bidirectional;
sync and asyncio; over plain TCP and fabric streams, against fabric.grpc
and stock grpcio peers both ways."""
import asyncio
import hashlib
import os
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")

import fabric.grpc as fgrpc  # noqa: E402
import fabric.grpc.aio as faio  # noqa: E402
from fabric import backends  # noqa: E402

BIG = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
SIZES = [0, 10, 70000, 3 << 20, (16 << 20) + 7]
IN_GUEST = os.environ.get("FABRIC_TEST_BACKENDS") == "verbs"          # the Soft-RoCE guest: verbs only
TRANSPORTS = ["fabric+verbs"] if IN_GUEST else ["plain", "fabric+tcp", "fabric+ucx", "fabric+verbs"]
PEERS = ["fabric+verbs"] if IN_GUEST else ["fabric-plain", "fabric+tcp", "fabric+ucx", "fabric+verbs",
                                           "grpcio-server", "grpcio-client"]


def handlers():
    def echo(request, context):
        return request

    def digests(request_iterator, context):      # client streaming: one digest per message
        return ",".join(hashlib.sha256(m).hexdigest() for m in request_iterator).encode()

    def chat(request_iterator, context):         # bidirectional: every message back
        for m in request_iterator:
            yield m
    return [grpc.method_handlers_generic_handler("sizes.Sizes", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Digests": grpc.stream_unary_rpc_method_handler(digests),
        "Chat": grpc.stream_stream_rpc_method_handler(chat)})]


def aio_handlers():
    async def echo(request, context):
        return request

    async def digests(request_iterator, context):
        return ",".join([hashlib.sha256(m).hexdigest() async for m in request_iterator]).encode()

    async def chat(request_iterator, context):
        async for m in request_iterator:
            yield m
    return [grpc.method_handlers_generic_handler("sizes.Sizes", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Digests": grpc.stream_unary_rpc_method_handler(digests),
        "Chat": grpc.stream_stream_rpc_method_handler(chat)})]


def blobs():
    return [os.urandom(n) for n in SIZES]


def check_sync_calls(channel):
    data = blobs()
    echo = channel.unary_unary("/sizes.Sizes/Echo")
    for blob in data:
        assert echo(blob, timeout=60) == blob
    digests = channel.stream_unary("/sizes.Sizes/Digests")(iter(data), timeout=60)
    assert digests.decode().split(",") == [hashlib.sha256(b).hexdigest() for b in data]
    assert list(channel.stream_stream("/sizes.Sizes/Chat")(iter(data), timeout=60)) == data


def need(transport):
    if transport.startswith("fabric+"):
        name = transport.split("+", 1)[1]
        ok, why = backends.available().get(name, (False, "unknown"))
        if not ok:
            pytest.skip(f"backend {name} unavailable here: {why}")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sync_calls_of_every_size(transport, monkeypatch):
    need(transport)
    server = fgrpc.server(futures.ThreadPoolExecutor(8), handlers=handlers(), options=BIG)
    address = "127.0.0.1:0" if transport == "plain" else f"{transport}://127.0.0.1:0"
    port = server.add_insecure_port(address)
    server.start()
    target = f"127.0.0.1:{port}" if transport == "plain" else f"{transport}://127.0.0.1:{port}"
    try:
        with fgrpc.insecure_channel(target, options=BIG) as channel:
            check_sync_calls(channel)
            counters = channel._conn.counters
            assert counters["zero_copy_pieces_sent"] >= 3      # the requests of 3 and 16 MiB at least
            if transport != "plain":
                assert counters["direct_bytes_received"] > 16 << 20
    finally:
        server.stop(0)


@pytest.mark.timeout(240)
@pytest.mark.skipif(IN_GUEST, reason="the guest runs the verbs cases only (the host runs this one)")
def test_sync_calls_of_every_size_against_stock_grpcio_both_ways():
    stock = grpc.server(futures.ThreadPoolExecutor(8), handlers=handlers(), options=BIG)
    stock_port = stock.add_insecure_port("127.0.0.1:0")
    stock.start()
    ours = fgrpc.server(futures.ThreadPoolExecutor(8), handlers=handlers(), options=BIG)
    our_port = ours.add_insecure_port("127.0.0.1:0")
    ours.start()
    try:
        with fgrpc.insecure_channel(f"127.0.0.1:{stock_port}", options=BIG) as channel:
            check_sync_calls(channel)
        with grpc.insecure_channel(f"127.0.0.1:{our_port}", options=BIG) as channel:
            check_sync_calls(channel)
    finally:
        stock.stop(0)
        ours.stop(0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("peer", PEERS)
def test_asyncio_calls_of_every_size(peer):
    import grpc.aio
    need(peer)

    async def main():
        server = (grpc.aio if peer == "grpcio-server" else faio).server(handlers=aio_handlers(), options=BIG)
        fabric_peer = peer.startswith("fabric+")
        address = f"{peer}://127.0.0.1:0" if fabric_peer else "127.0.0.1:0"
        port = server.add_insecure_port(address)
        await server.start()
        target = f"{peer}://127.0.0.1:{port}" if fabric_peer else f"127.0.0.1:{port}"
        channel = (grpc.aio if peer == "grpcio-client" else faio).insecure_channel(target, options=BIG)
        try:
            data = blobs()
            echo = channel.unary_unary("/sizes.Sizes/Echo")
            for blob in data:
                assert await echo(blob, timeout=60) == blob
            call = channel.stream_unary("/sizes.Sizes/Digests")()
            for blob in data:
                await call.write(blob)
            await call.done_writing()
            assert (await call).decode().split(",") == [hashlib.sha256(b).hexdigest() for b in data]
            chat = channel.stream_stream("/sizes.Sizes/Chat")()
            for blob in data:
                await chat.write(blob)
                assert await chat.read() == blob
            await chat.done_writing()
            if fabric_peer:
                assert channel._conn.counters["direct_bytes_received"] > 16 << 20
        finally:
            await channel.close()
            await server.stop(None)
    asyncio.run(main())


def test_no_h2_import_on_the_call_path():
    """The HTTP/2 core is fabric's own: h2, hpack and hyperframe are not imported."""
    import subprocess
    import sys
    code = ("import sys, fabric.grpc, fabric.grpc.aio\n"
            "print(sorted(m for m in ('h2', 'hpack', 'hyperframe') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]"
