"""fabric.grpc._h2_fast, the one place that uses h2/hyperframe/hpack
internals: it is in use with the h2 this project pins, it steps aside
(plain h2) when a version or an internal is not what it was written for,
calls work over plain h2 (small and large messages, unary and streaming,
sync and asyncio, against fabric.grpc and stock grpcio peers), and importing
fabric.grpc changes no class of another library."""
import asyncio
import enum
import hashlib
import json
import os
import subprocess
import sys
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")

import fabric.grpc as fgrpc  # noqa: E402
import fabric.grpc.aio as faio  # noqa: E402
from fabric.grpc import _h2_fast  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
# small, between one DATA frame and 1 MiB, and large (several frames, not frame-aligned)
SIZES = [0, 10, 70000, 3 << 20, (16 << 20) + 7]


def handlers():
    def echo(request, context):
        return request

    def digests(request_iterator, context):      # client streaming: one digest per message
        return ",".join(hashlib.sha256(m).hexdigest() for m in request_iterator).encode()

    def chat(request_iterator, context):         # bidirectional: every message back
        for m in request_iterator:
            yield m
    return [grpc.method_handlers_generic_handler("plain.Plain", {
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
    return [grpc.method_handlers_generic_handler("plain.Plain", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Digests": grpc.stream_unary_rpc_method_handler(digests),
        "Chat": grpc.stream_stream_rpc_method_handler(chat)})]


@pytest.fixture
def plain_h2(monkeypatch):
    """Connections made from here on use h2's public API only."""
    monkeypatch.setattr(_h2_fast, "AVAILABLE", False)
    monkeypatch.setattr(_h2_fast, "REASON", "forced by the test")


def blobs():
    return [os.urandom(n) for n in SIZES]


def check_sync_calls(channel):
    data = blobs()
    echo = channel.unary_unary("/plain.Plain/Echo")
    for blob in data:
        assert echo(blob, timeout=60) == blob
    digests = channel.stream_unary("/plain.Plain/Digests")(iter(data), timeout=60)
    assert digests.decode().split(",") == [hashlib.sha256(b).hexdigest() for b in data]
    assert list(channel.stream_stream("/plain.Plain/Chat")(iter(data), timeout=60)) == data


def fast_frames(conn):
    return conn.counters["fast_data_frames_sent"] + conn.counters["fast_data_frames_received"]


def test_the_fast_path_is_in_use_with_the_pinned_h2():
    if os.environ.get("FABRIC_GRPC_PLAIN_H2", "") not in ("", "0"):
        pytest.skip("FABRIC_GRPC_PLAIN_H2 is set")
    assert _h2_fast.AVAILABLE, _h2_fast.REASON
    assert _h2_fast.REASON == ""


def test_the_probe_refuses_other_versions_and_missing_internals(monkeypatch):
    import h2
    import h2.connection
    import h2.stream
    from hyperframe.frame import DataFrame
    monkeypatch.delenv("FABRIC_GRPC_PLAIN_H2", raising=False)
    assert _h2_fast._probe() is None
    with monkeypatch.context() as m:
        m.setattr(h2, "__version__", "5.0.0")
        assert "h2 5.0.0" in _h2_fast._probe()
    with monkeypatch.context() as m:
        m.setattr(h2, "__version__", "4.0.0")
        assert "h2 4.0.0" in _h2_fast._probe()
    for cls, name in ((h2.connection.H2Connection, "_get_stream_by_id"), (DataFrame, "_body_repr"),
                      (DataFrame, "serialize_padding_data")):
        owner = next(c for c in cls.__mro__ if name in vars(c))      # where it is defined
        with monkeypatch.context() as m:
            m.delattr(owner, name)
            assert name in _h2_fast._probe()
    with monkeypatch.context() as m:                # an h2 whose state machine has other inputs
        m.setattr(h2.connection, "ConnectionInputs", enum.Enum("ConnectionInputs", ["SEND_DATA"]))
        assert "RECV_DATA" in _h2_fast._probe()
    with monkeypatch.context() as m:                # an instance attribute h2 might drop
        original = h2.stream.H2Stream.__init__

        def without_window_manager(self, *args, **kwargs):
            original(self, *args, **kwargs)
            del self._inbound_window_manager
        m.setattr(h2.stream.H2Stream, "__init__", without_window_manager)
        assert "_inbound_window_manager" in _h2_fast._probe()
    with monkeypatch.context() as m:
        m.setenv("FABRIC_GRPC_PLAIN_H2", "1")
        assert "FABRIC_GRPC_PLAIN_H2" in _h2_fast._probe()


def test_plain_h2_leaves_the_connection_alone(plain_h2):
    import h2.config
    import h2.connection
    from h2.frame_buffer import FrameBuffer
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    before = dict(conn._frame_dispatch_table)
    encoder, decoder = conn.encoder, conn.decoder
    assert _h2_fast.install(conn) is False
    assert conn._frame_dispatch_table == before and type(conn.incoming_buffer) is FrameBuffer
    assert conn.encoder is encoder and conn.decoder is decoder
    assert _h2_fast.connection_closed(conn) is None and _h2_fast.reopen_after_goaway(conn) is False


@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", ["plain", "fabric+tcp"])
def test_sync_calls_over_plain_h2(plain_h2, transport):
    server = fgrpc.server(futures.ThreadPoolExecutor(8), handlers=handlers(), options=BIG)
    address = "127.0.0.1:0" if transport == "plain" else f"{transport}://127.0.0.1:0"
    port = server.add_insecure_port(address)
    server.start()
    target = f"127.0.0.1:{port}" if transport == "plain" else f"{transport}://127.0.0.1:{port}"
    try:
        with fgrpc.insecure_channel(target, options=BIG) as channel:
            check_sync_calls(channel)
            assert not channel._conn.fast_data and fast_frames(channel._conn) == 0
    finally:
        server.stop(0)


@pytest.mark.timeout(240)
def test_plain_h2_against_stock_grpcio_both_ways(plain_h2):
    stock = grpc.server(futures.ThreadPoolExecutor(8), handlers=handlers(), options=BIG)
    stock_port = stock.add_insecure_port("127.0.0.1:0")
    stock.start()
    ours = fgrpc.server(futures.ThreadPoolExecutor(8), handlers=handlers(), options=BIG)
    our_port = ours.add_insecure_port("127.0.0.1:0")
    ours.start()
    try:
        with fgrpc.insecure_channel(f"127.0.0.1:{stock_port}", options=BIG) as channel:
            check_sync_calls(channel)
            assert fast_frames(channel._conn) == 0
        with grpc.insecure_channel(f"127.0.0.1:{our_port}", options=BIG) as channel:
            check_sync_calls(channel)
    finally:
        stock.stop(0)
        ours.stop(0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("peer", ["fabric-plain", "fabric+tcp", "grpcio-server", "grpcio-client"])
def test_asyncio_calls_over_plain_h2(plain_h2, peer):
    import grpc.aio

    async def main():
        server = (grpc.aio if peer == "grpcio-server" else faio).server(handlers=aio_handlers(), options=BIG)
        address = "fabric+tcp://127.0.0.1:0" if peer == "fabric+tcp" else "127.0.0.1:0"
        port = server.add_insecure_port(address)
        await server.start()
        target = f"fabric+tcp://127.0.0.1:{port}" if peer == "fabric+tcp" else f"127.0.0.1:{port}"
        channel = (grpc.aio if peer == "grpcio-client" else faio).insecure_channel(target, options=BIG)
        try:
            data = blobs()
            echo = channel.unary_unary("/plain.Plain/Echo")
            for blob in data:
                assert await echo(blob, timeout=60) == blob
            call = channel.stream_unary("/plain.Plain/Digests")()
            for blob in data:
                await call.write(blob)
            await call.done_writing()
            assert (await call).decode().split(",") == [hashlib.sha256(b).hexdigest() for b in data]
            chat = channel.stream_stream("/plain.Plain/Chat")()
            for blob in data:
                await chat.write(blob)
                assert await chat.read() == blob
            await chat.done_writing()
            if peer != "grpcio-client":
                assert not channel._conn.fast_data and fast_frames(channel._conn) == 0
        finally:
            await channel.close()
            await server.stop(None)
    asyncio.run(main())


PLAIN_BY_ENV = r"""
import os, sys
from concurrent import futures
sys.path[:0] = [os.environ["FABRIC_ROOT"], os.path.join(os.environ["FABRIC_ROOT"], "tests")]
import fabric.grpc as fgrpc
from fabric.grpc import _h2_fast
from test_grpc_h2_fast import BIG, check_sync_calls, fast_frames, handlers
assert not _h2_fast.AVAILABLE and "FABRIC_GRPC_PLAIN_H2" in _h2_fast.REASON
server = fgrpc.server(futures.ThreadPoolExecutor(8), handlers=handlers(), options=BIG)
port = server.add_insecure_port("fabric+tcp://127.0.0.1:0")
server.start()
with fgrpc.insecure_channel(f"fabric+tcp://127.0.0.1:{port}", options=BIG) as channel:
    check_sync_calls(channel)
    assert fast_frames(channel._conn) == 0
server.stop(0)
"""


@pytest.mark.timeout(240)
def test_the_environment_variable_selects_plain_h2():
    env = dict(os.environ, FABRIC_GRPC_PLAIN_H2="1", FABRIC_ROOT=ROOT)
    subprocess.run([sys.executable, "-c", PLAIN_BY_ENV], env=env, check=True, timeout=200)


SNAPSHOT = r"""
import inspect, json, os, sys
sys.path.insert(0, os.environ["FABRIC_ROOT"])
import h2.connection, h2.frame_buffer, h2.stream, h2.settings, hpack.hpack, hpack.table, hyperframe.frame

def snapshot():
    out = {}
    for module in (h2.connection, h2.frame_buffer, h2.stream, h2.settings, hpack.hpack, hpack.table,
                   hyperframe.frame):
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and cls.__module__ == module.__name__:
                out[f"{module.__name__}.{name}"] = {k: repr(v) for k, v in vars(cls).items()}
    frame = hyperframe.frame.DataFrame(1, data=bytes(range(100)))
    out["repr(DataFrame)"] = repr(frame)
    out["H2Connection() dispatch"] = sorted(
        c.__name__ for c in h2.connection.H2Connection()._frame_dispatch_table)
    return out

before = snapshot()
import fabric.grpc, fabric.grpc.aio, fabric.grpc._http2, fabric.grpc._aio_http2, fabric.grpc._h2_fast
from fabric.grpc import _http2_core
_http2_core.new_h2_connection(client_side=True, trusted_peer=False)     # a connection of ours
after = snapshot()
print(json.dumps({"same": before == after,
                  "changed": sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))}))
"""


def test_importing_fabric_grpc_leaves_h2_and_hyperframe_classes_alone():
    env = dict(os.environ, FABRIC_ROOT=ROOT)
    env.pop("FABRIC_GRPC_PLAIN_H2", None)
    out = subprocess.run([sys.executable, "-c", SNAPSHOT], env=env, check=True, timeout=120,
                         capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["same"], result["changed"]
