"""TLS on fabric.grpc's plain-TCP path against stock grpcio, sync and aio:
what a handler learns of its peer (auth_context, peer_identities) compared
with grpcio's own server, refusals (untrusted server, wrong name, missing
client certificate) reported as UNAVAILABLE, grpc.ssl_target_name_override,
ALPN h2, usage errors, and a listener that keeps serving while one client's
handshake is garbage or never finishes. The interop cases over mutual TLS
are the "-tls" combinations of test_grpc.py and test_grpc_aio.py."""
import asyncio
import socket
import ssl
import threading
from concurrent import futures

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")

import grpc.aio  # noqa: E402

import fabric.grpc as fgrpc  # noqa: E402
import fabric.grpc.aio as faio  # noqa: E402
from grpc_interop import certificates  # noqa: E402

pytestmark = pytest.mark.timeout(60)

KINDS = ["grpcio", "fabric"]


def who_am_i(request, context):
    ctx = context.auth_context()
    return repr((context.peer_identity_key(), context.peer_identities(),
                 sorted((k, v) for k, v in ctx.items() if k in ("transport_security_type", "x509_common_name",
                                                                "x509_subject_alternative_name", "peer_dns")),
                 context.peer().split(":")[0])).encode()


async def who_am_i_async(request, context):
    return who_am_i(request, context)


def handlers(fn):
    return [grpc.method_handlers_generic_handler("t.Who", {"Am": grpc.unary_unary_rpc_method_handler(fn)})]


def server_credentials(module, require_client_auth=True):
    c = certificates()
    return module.ssl_server_credentials([(c["server_key"], c["server_cert"])], root_certificates=c["ca"],
                                         require_client_auth=require_client_auth)


def client_credentials(module, roots="ca", with_certificate=True):
    c = certificates()
    if with_certificate:
        return module.ssl_channel_credentials(c[roots], c["client_key"], c["client_cert"])
    return module.ssl_channel_credentials(c[roots])


class SyncServer:
    def __init__(self, kind, require_client_auth=True):
        module = grpc if kind == "grpcio" else fgrpc
        self.server = module.server(futures.ThreadPoolExecutor(4), handlers=handlers(who_am_i))
        self.port = self.server.add_secure_port("127.0.0.1:0", server_credentials(module, require_client_auth))
        self.server.start()

    def close(self):
        self.server.stop(None)


def sync_call(kind, port, credentials, options=None, host="localhost"):
    module = grpc if kind == "grpcio" else fgrpc
    with module.secure_channel(f"{host}:{port}", credentials, options=options) as channel:
        return channel.unary_unary("/t.Who/Am")(b"", timeout=10)


def test_a_handler_sees_its_peer_as_on_a_stock_server():
    """auth_context / peer_identities / peer() as grpcio's server reports them."""
    seen = {}
    for kind in KINDS:
        s = SyncServer(kind)
        try:
            seen[kind] = sync_call("fabric", s.port, client_credentials(fgrpc))
        finally:
            s.close()
    assert seen["fabric"] == seen["grpcio"]
    assert b"x509_subject_alternative_name" in seen["fabric"] and b"localhost" in seen["fabric"]


def test_an_aio_handler_sees_its_peer_as_on_a_stock_server():
    async def main():
        seen = {}
        for kind in KINDS:
            server = (grpc.aio if kind == "grpcio" else faio).server(handlers=handlers(who_am_i_async))
            port = server.add_secure_port("127.0.0.1:0", server_credentials(grpc if kind == "grpcio" else fgrpc))
            await server.start()
            try:
                async with faio.secure_channel(f"localhost:{port}", client_credentials(grpc)) as channel:
                    seen[kind] = await channel.unary_unary("/t.Who/Am")(b"", timeout=10)
            finally:
                await server.stop(None)
        assert seen["fabric"] == seen["grpcio"]
    asyncio.run(main())


@pytest.mark.parametrize("client", KINDS)
def test_server_only_tls_has_no_peer_identity(client):
    s = SyncServer("fabric", require_client_auth=False)
    try:
        module = grpc if client == "grpcio" else fgrpc
        answer = sync_call(client, s.port, client_credentials(module, with_certificate=False))
    finally:
        s.close()
    assert answer.startswith(b"(None, None, [('transport_security_type', [b'ssl'])]")


@pytest.mark.parametrize("client,server", [("fabric", "fabric"), ("fabric", "grpcio"), ("grpcio", "fabric")])
@pytest.mark.parametrize("case", ["untrusted-server", "no-client-certificate", "wrong-name"])
def test_a_refused_handshake_is_unavailable(server, client, case):
    s = SyncServer(server)
    module = grpc if client == "grpcio" else fgrpc
    try:
        options = None
        if case == "untrusted-server":
            creds = client_credentials(module, roots="other_ca")
        elif case == "no-client-certificate":
            creds = client_credentials(module, with_certificate=False)
        else:
            creds = client_credentials(module)
            options = [("grpc.ssl_target_name_override", "not-in-the-certificate.example")]
        with pytest.raises(grpc.RpcError) as info:
            sync_call(client, s.port, creds, options)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert sync_call(client, s.port, client_credentials(module))        # the server still serves
    finally:
        s.close()


@pytest.mark.parametrize("server", KINDS)
def test_the_target_name_override_names_the_server(server):
    s = SyncServer(server)
    try:
        # 127.0.0.1 is in the certificate too; 127.0.0.1 with the override must check the override
        options = [("grpc.ssl_target_name_override", "foo.test.example")]
        assert sync_call("fabric", s.port, client_credentials(fgrpc), options, host="127.0.0.1")
    finally:
        s.close()


def test_the_server_negotiates_alpn_h2():
    s = SyncServer("fabric", require_client_auth=False)
    try:
        c = certificates()
        ctx = ssl.create_default_context(cadata=c["ca"].decode())
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                assert tls.selected_alpn_protocol() == "h2"
                assert tls.version() in ("TLSv1.2", "TLSv1.3")
    finally:
        s.close()


def test_usage_errors_are_clear():
    c = certificates()
    with pytest.raises(ValueError, match="plain TCP"):
        fgrpc.secure_channel("fabric+tcp://127.0.0.1:1", client_credentials(fgrpc))
    with pytest.raises(ValueError, match="plain TCP"):
        faio.secure_channel("fabric+tcp://127.0.0.1:1", client_credentials(fgrpc))
    server = fgrpc.server(futures.ThreadPoolExecutor(1))
    with pytest.raises(TypeError, match="ssl_server_credentials"):
        server.add_secure_port("127.0.0.1:0", server_credentials(grpc))
    with pytest.raises(ValueError, match="plain TCP"):
        server.add_secure_port("fabric+tcp://127.0.0.1:0", server_credentials(fgrpc))
    with pytest.raises(TypeError):
        fgrpc.secure_channel("127.0.0.1:1", grpc.local_channel_credentials())
    with pytest.raises(ValueError):
        fgrpc.ssl_server_credentials([])
    with pytest.raises(ValueError, match="root certificates"):
        fgrpc.ssl_server_credentials([(c["server_key"], c["server_cert"])], require_client_auth=True)
    with pytest.raises(ValueError, match="PEM"):
        fgrpc.ssl_server_credentials([(b"not a key", b"not a certificate")]).context()
    with pytest.raises(ValueError, match="both"):
        fgrpc.ssl_channel_credentials(c["ca"], private_key=c["client_key"])


def _bad_clients(port):
    """One client that connects and says nothing, one that sends garbage."""
    silent = socket.create_connection(("127.0.0.1", port), timeout=10)
    garbage = socket.create_connection(("127.0.0.1", port), timeout=10)
    garbage.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(range(256)) * 8)
    return silent, garbage


def test_a_listener_serves_past_silent_and_garbage_handshakes():
    s = SyncServer("fabric")
    try:
        silent, garbage = _bad_clients(s.port)
        try:
            results = []

            def call():
                results.append(sync_call("fabric", s.port, client_credentials(fgrpc)))
            threads = [threading.Thread(target=call) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert len(results) == 4
        finally:
            silent.close()
            garbage.close()
    finally:
        s.close()


def test_an_aio_listener_serves_past_silent_and_garbage_handshakes():
    async def main():
        server = faio.server(handlers=handlers(who_am_i_async))
        port = server.add_secure_port("127.0.0.1:0", server_credentials(fgrpc))
        await server.start()
        silent, garbage = _bad_clients(port)
        try:
            async with grpc.aio.secure_channel(f"localhost:{port}", client_credentials(grpc)) as stock, \
                    faio.secure_channel(f"localhost:{port}", client_credentials(fgrpc)) as ours:
                answers = await asyncio.gather(*[ch.unary_unary("/t.Who/Am")(b"", timeout=10)
                                                 for ch in (stock, ours) for _ in range(4)])
            assert len(answers) == 8 and all(answers)
        finally:
            silent.close()
            garbage.close()
            await server.stop(None)
    asyncio.run(main())


def test_many_tls_connections_at_once():
    """64 channels, each its own TLS connection, calling concurrently."""
    s = SyncServer("fabric")
    try:
        creds = client_credentials(fgrpc)
        channels = [fgrpc.secure_channel(f"localhost:{s.port}", creds) for _ in range(64)]
        try:
            with futures.ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(lambda ch: ch.unary_unary("/t.Who/Am")(b"x" * 70000, timeout=30),
                                        channels))
            assert len(answers) == 64 and all(b"localhost" in a for a in answers)
        finally:
            for ch in channels:
                ch.close()
    finally:
        s.close()


class _Plugin(grpc.AuthMetadataPlugin):
    def __init__(self, fail=False):
        self.fail = fail
        self.seen = []

    def __call__(self, context, callback):
        self.seen.append((context.service_url, context.method_name))
        if self.fail:
            callback(None, RuntimeError("no token today"))
        else:
            threading.Thread(target=callback, args=((("x-plugin", "p"),), None)).start()   # from another thread


def echo_metadata(request, context):
    return repr(sorted((k, v) for k, v in context.invocation_metadata()
                       if k in ("authorization", "x-plugin"))).encode()


@pytest.mark.parametrize("client", KINDS)
@pytest.mark.parametrize("server", KINDS)
def test_call_credentials_send_their_metadata(client, server):
    """Access tokens and metadata plugins, on the channel (composite channel
    credentials) and per call, as grpcio sends them; a failing plugin fails
    the call UNAVAILABLE; an insecure channel refuses them UNAUTHENTICATED."""
    module = grpc if server == "grpcio" else fgrpc
    s = module.server(futures.ThreadPoolExecutor(4), handlers=[grpc.method_handlers_generic_handler(
        "t.Who", {"Am": grpc.unary_unary_rpc_method_handler(echo_metadata)})])
    port = s.add_secure_port("127.0.0.1:0", server_credentials(module, require_client_auth=False))
    plain = s.add_insecure_port("127.0.0.1:0")
    s.start()
    cm = grpc if client == "grpcio" else fgrpc
    plugin = _Plugin()
    try:
        creds = grpc.composite_channel_credentials(client_credentials(grpc, with_certificate=False),
                                                   grpc.access_token_call_credentials("tok"))
        with cm.secure_channel(f"localhost:{port}", creds) as channel:
            call = channel.unary_unary("/t.Who/Am")
            assert call(b"", timeout=10) == repr([("authorization", "Bearer tok")]).encode()
            per_call = grpc.metadata_call_credentials(plugin)
            assert call(b"", timeout=10, credentials=per_call) == \
                repr([("authorization", "Bearer tok"), ("x-plugin", "p")]).encode()
            with pytest.raises(grpc.RpcError) as info:
                call(b"", timeout=10, credentials=grpc.metadata_call_credentials(_Plugin(fail=True)))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no token today" in info.value.details()
        assert plugin.seen == [(f"https://localhost:{port}/t.Who", "Am")]
        with cm.insecure_channel(f"127.0.0.1:{plain}") as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/t.Who/Am")(b"", timeout=10, credentials=grpc.access_token_call_credentials("t"))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        s.stop(None)


def test_aio_call_credentials_send_their_metadata():
    async def main():
        async def echo(request, context):
            return echo_metadata(request, context)
        server = faio.server(handlers=[grpc.method_handlers_generic_handler(
            "t.Who", {"Am": grpc.unary_unary_rpc_method_handler(echo)})])
        port = server.add_secure_port("127.0.0.1:0", server_credentials(fgrpc, require_client_auth=False))
        await server.start()
        try:
            creds = grpc.composite_channel_credentials(client_credentials(grpc, with_certificate=False),
                                                       grpc.access_token_call_credentials("tok"))
            async with faio.secure_channel(f"localhost:{port}", creds) as channel:
                call = channel.unary_unary("/t.Who/Am")
                assert await call(b"", timeout=10) == repr([("authorization", "Bearer tok")]).encode()
                got = await call(b"", timeout=10, credentials=grpc.metadata_call_credentials(_Plugin()))
                assert got == repr([("authorization", "Bearer tok"), ("x-plugin", "p")]).encode()
                with pytest.raises(grpc.RpcError) as info:
                    await call(b"", timeout=10, credentials=grpc.metadata_call_credentials(_Plugin(fail=True)))
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(None)
    asyncio.run(main())
