"""fabric.grpc and fabric.grpc.aio at scale and with peers killed mid-call,
over plain TCP and fabric streams: hundreds of channels to one server with
checked payloads of mixed sizes and streams, a server process killed under
open calls (every one fails UNAVAILABLE, none hangs), and a client process
killed under open calls (the server cancels them and serves on)."""
import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")

import grpc.aio  # noqa: E402

import fabric  # noqa: E402
import fabric.grpc as fgrpc  # noqa: E402
import fabric.grpc.aio as faio  # noqa: E402
from fabric import backends  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from grpc_peer import OPTIONS, aio_handlers, sync_handlers  # noqa: E402

TRANSPORTS = {"plain": None, "fabric+tcp": ("tcp", {}), "fabric+ucx": ("ucx", {"UCX_TLS": "sm"}),
              "fabric+verbs": ("verbs", {})}
NAMES = ["plain", "fabric+tcp", "fabric+ucx", "fabric+verbs"]
if os.environ.get("FABRIC_TEST_BACKENDS") == "verbs":
    NAMES = ["fabric+verbs"]
CONNECTIONS = int(os.environ.get("FABRIC_TEST_CONNECTIONS", "200"))

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(params=NAMES)
def transport(request, monkeypatch):
    spec = TRANSPORTS[request.param]
    if spec is not None:
        backend, env = spec
        ok, why = backends.available().get(backend, (False, "unknown"))
        if not ok:
            pytest.skip(f"backend {backend} unavailable here: {why}")
        for k, v in env.items():
            monkeypatch.setenv(k, v)            # this process's Fabrics and the peers'
    return request.param


def _fabric_for(transport):
    return None if transport == "plain" else fabric.Fabric(TRANSPORTS[transport][0])


def _listen_address(transport):
    return "127.0.0.1:0" if transport == "plain" else f"{transport}://127.0.0.1:0"


def _target(transport, port):
    return f"127.0.0.1:{port}" if transport == "plain" else f"{transport}://127.0.0.1:{port}"


def _connections(transport):
    # Soft-RoCE under TCG: every verbs connection costs a QP set-up at ~20x slower Python
    return min(CONNECTIONS, 32) if transport == "fabric+verbs" else CONNECTIONS


def payload(i, size):
    seed = hashlib.sha256(f"{i}:{size}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def sizes_for(i):
    return (0, 8, 1000, 70000, (1 << 20) + 3 if i % 16 == 0 else 100)


def test_hundreds_of_aio_channels(transport):
    n = _connections(transport)

    async def main():
        server_fabric, client_fabric = _fabric_for(transport), _fabric_for(transport)
        server = faio.server(handlers=aio_handlers(), options=OPTIONS, fabric=server_fabric)
        port = server.add_insecure_port(_listen_address(transport))
        await server.start()
        channels = [faio.insecure_channel(_target(transport, port), options=OPTIONS, fabric=client_fabric)
                    for _ in range(n)]

        async def use(i, channel):
            echo = channel.unary_unary("/peer.Peer/Echo")
            for size in sizes_for(i):
                data = payload(i, size)
                assert await echo(data, timeout=120) == data
            got = [int.from_bytes(m, "little") async for m in channel.unary_stream("/peer.Peer/Count")(b"20", timeout=120)]
            assert got == list(range(20))
            return i
        try:
            done = await asyncio.gather(*[use(i, ch) for i, ch in enumerate(channels)])
            assert sorted(done) == list(range(n))
        finally:
            for ch in channels:
                await ch.close()
            await server.stop(None)
            for f in (server_fabric, client_fabric):
                if f is not None:
                    f.close()
    asyncio.run(main())


def test_hundreds_of_sync_channels(transport):
    n = _connections(transport)
    server_fabric, client_fabric = _fabric_for(transport), _fabric_for(transport)
    server = fgrpc.server(futures.ThreadPoolExecutor(32), handlers=sync_handlers(), options=OPTIONS,
                          fabric=server_fabric)
    port = server.add_insecure_port(_listen_address(transport))
    server.start()
    channels = [fgrpc.insecure_channel(_target(transport, port), options=OPTIONS, fabric=client_fabric)
                for _ in range(n)]

    def use(i):
        channel = channels[i]
        echo = channel.unary_unary("/peer.Peer/Echo")
        for size in sizes_for(i):
            data = payload(i, size)
            assert echo(data, timeout=120) == data
        got = [int.from_bytes(m, "little") for m in channel.unary_stream("/peer.Peer/Count")(b"20", timeout=120)]
        assert got == list(range(20))
        return i
    try:
        with futures.ThreadPoolExecutor(32) as pool:
            assert sorted(pool.map(use, range(n))) == list(range(n))
    finally:
        for ch in channels:
            ch.close()
        server.stop(None)
        for f in (server_fabric, client_fabric):
            if f is not None:
                f.close()


def _spawn(*args):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "grpc_peer.py"), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        raise RuntimeError(f"peer {args} did not start: {proc.stderr.read()[-2000:]}")
    return proc, line


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_a_killed_server_fails_every_open_call(transport, kind):
    proc, port = _spawn("serve", kind, _listen_address(transport))
    target = _target(transport, port)
    client_fabric = _fabric_for(transport)
    try:
        if kind == "sync":
            channel = fgrpc.insecure_channel(target, options=OPTIONS, fabric=client_fabric)
            calls = [channel.unary_unary("/peer.Peer/Hang").future(b"", timeout=120) for _ in range(50)]
            streams = [channel.unary_stream("/peer.Peer/Drip")(b"", timeout=120) for _ in range(4)]
            for s in streams:
                next(s)                                   # the streams are flowing
            assert channel.unary_unary("/peer.Peer/Echo")(b"x", timeout=30) == b"x"
            proc.send_signal(signal.SIGKILL)
            codes = [c.exception(timeout=60).code() for c in calls]
            for s in streams:
                with pytest.raises(grpc.RpcError) as info:
                    for _ in s:
                        pass
                codes.append(info.value.code())
            with pytest.raises(grpc.RpcError) as info:    # and a new call does not hang either
                channel.unary_unary("/peer.Peer/Echo")(b"x", timeout=60)
            codes.append(info.value.code())
            channel.close()
        else:
            async def main():
                channel = faio.insecure_channel(target, options=OPTIONS, fabric=client_fabric)
                calls = [asyncio.ensure_future(channel.unary_unary("/peer.Peer/Hang")(b"", timeout=120))
                         for _ in range(50)]
                streams = [channel.unary_stream("/peer.Peer/Drip")(b"", timeout=120) for _ in range(4)]
                for s in streams:
                    await s.read()
                assert await channel.unary_unary("/peer.Peer/Echo")(b"x", timeout=30) == b"x"
                proc.send_signal(signal.SIGKILL)
                results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)
                out = [r.code() for r in results]
                for s in streams:
                    with pytest.raises(grpc.RpcError) as info:
                        while await asyncio.wait_for(s.read(), 60) is not grpc.aio.EOF:
                            pass
                    out.append(info.value.code())
                with pytest.raises(grpc.RpcError) as info:
                    await channel.unary_unary("/peer.Peer/Echo")(b"x", timeout=60)
                out.append(info.value.code())
                await channel.close()
                return out
            codes = asyncio.run(main())
        assert set(codes) == {grpc.StatusCode.UNAVAILABLE}, codes
    finally:
        proc.kill()
        proc.wait()
        if client_fabric is not None:
            client_fabric.close()


@pytest.mark.parametrize("kind", ["sync", "aio"])
def test_a_killed_client_cancels_its_calls_and_the_server_serves_on(transport, kind):
    server_fabric = _fabric_for(transport)
    n = 20
    if kind == "sync":
        cancelled = []

        def hang(request, context):
            context.add_callback(lambda: cancelled.append(1))
            while context.is_active():
                time.sleep(0.01)
            return b""
        handlers = sync_handlers()
        handlers.insert(0, grpc.method_handlers_generic_handler(
            "peer.Peer", {"Hang": grpc.unary_unary_rpc_method_handler(hang)}))
        server = fgrpc.server(futures.ThreadPoolExecutor(n + 8), handlers=handlers, options=OPTIONS,
                              fabric=server_fabric)
        port = server.add_insecure_port(_listen_address(transport))
        server.start()
        try:
            proc, ready = _spawn("hang", kind, _target(transport, port), n)
            assert ready == "ready"
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            end = time.monotonic() + 60
            while len(cancelled) < n and time.monotonic() < end:
                time.sleep(0.02)
            assert len(cancelled) == n
            with fgrpc.insecure_channel(_target(transport, port), fabric=_fabric_for(transport)) as ch:
                assert ch.unary_unary("/peer.Peer/Echo")(b"on", timeout=30) == b"on"
        finally:
            server.stop(None)
        return

    async def main():
        cancelled = []

        async def hang(request, context):
            context.add_done_callback(lambda ctx: cancelled.append(ctx.cancelled()))
            await asyncio.sleep(600)
            return b""
        handlers = aio_handlers()
        handlers.insert(0, grpc.method_handlers_generic_handler(
            "peer.Peer", {"Hang": grpc.unary_unary_rpc_method_handler(hang)}))
        server = faio.server(handlers=handlers, options=OPTIONS, fabric=server_fabric)
        port = server.add_insecure_port(_listen_address(transport))
        await server.start()
        try:
            loop = asyncio.get_running_loop()
            proc, ready = await loop.run_in_executor(None, _spawn, "hang", kind, _target(transport, port), n)
            assert ready == "ready"
            proc.send_signal(signal.SIGKILL)
            await loop.run_in_executor(None, proc.wait)
            end = time.monotonic() + 60
            while len(cancelled) < n and time.monotonic() < end:
                await asyncio.sleep(0.02)
            assert cancelled == [True] * n
            ch = faio.insecure_channel(_target(transport, port), fabric=_fabric_for(transport))
            assert await ch.unary_unary("/peer.Peer/Echo")(b"on", timeout=30) == b"on"
            await ch.close()
        finally:
            await server.stop(None)
    asyncio.run(main())
