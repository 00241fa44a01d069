"""TLS on the tcp fabric (issue 15): Fabric("tcp", ssl=...) with real
certificates made by the openssl command: data of every size both ways, sync
and asyncio, many connections, mutual TLS, refusals (unknown CA, missing
client certificate, plaintext peers), with authentication on top, and the
configurations fabric refuses."""
from __future__ import annotations

import asyncio
import os
import ssl
import threading
import time

import pytest

import fabric
from conftest import connect_pair, small_options
from grpc_interop import certificates

pytest.importorskip("fabric.backends.tls", reason="fabric was built without OpenSSL's headers (libssl-dev)")


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    paths = {}
    for name, data in certificates().items():
        path = d / name
        path.write_bytes(data)
        paths[name] = str(path)
    return paths


def server_context(pem, require_client=False):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pem["server_cert"], pem["server_key"])
    if require_client:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(pem["ca"])
    return ctx


def client_context(pem, ca="ca", certificate=False):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pem[ca])
    if certificate:
        ctx.load_cert_chain(pem["client_cert"], pem["client_key"])
    return ctx


def tls_fabric(ctx, **extra):
    return fabric.Fabric("tcp", ssl=ctx, **small_options(**extra))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [0, 8, 5000, 100000, 16 << 20])
def test_messages_of_every_size_cross_tls_both_ways(pem, size):
    a = tls_fabric((server_context(pem), client_context(pem)))
    b = tls_fabric((server_context(pem), client_context(pem)))
    try:
        client, server = connect_pair(a, b)
        data = os.urandom(size)
        for _ in range(3):
            # one thread plays both ends: a rendezvous completes only once the
            # receiver pulls it, so send without waiting, then receive
            sending = client.isend(data)
            assert bytes(server.recv(timeout=20)) == data
            sending.wait(timeout=20)
            sending = server.isend(data)
            buf = bytearray(size)
            assert client.recv_into(buf, timeout=20) == size and bytes(buf) == data
            sending.wait(timeout=20)
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(120)
def test_many_asyncio_connections_with_mutual_tls(pem):
    async def main():
        b = tls_fabric(server_context(pem, require_client=True))
        a = tls_fabric(client_context(pem, certificate=True), credits=4, send_buffers=2)
        lst = b.listen()
        n = 64
        try:
            accepted = [asyncio.ensure_future(lst.aaccept(timeout=60)) for _ in range(n)]
            clients = await asyncio.gather(*[a.aconnect(lst.address, timeout=60) for _ in range(n)])
            servers = await asyncio.gather(*accepted)
            for i, c in enumerate(clients):
                await c.asend(b"%d" % i + bytes(3000))
            got = sorted([bytes(await s.arecv(timeout=30))[:4].rstrip(b"\0") for s in servers])
            assert got == sorted(b"%d" % i for i in range(n))
        finally:
            a.close(linger=0)
            b.close(linger=0)
    asyncio.run(main())


@pytest.mark.timeout(60)
def test_an_unknown_certificate_authority_is_an_authentication_error(pem):
    b = tls_fabric(server_context(pem))
    bad = tls_fabric(client_context(pem, ca="other_ca"))
    good = tls_fabric(client_context(pem))
    lst = b.listen()
    try:
        with pytest.raises(fabric.AuthenticationError, match="certificate verify failed"):
            bad.connect(lst.address, timeout=10)
        client = good.connect(lst.address, timeout=10)
        server = lst.accept(timeout=10)
        client.send(b"still serving")
        assert bytes(server.recv(timeout=10)) == b"still serving"
    finally:
        for f in (b, bad, good):
            f.close(linger=0)


@pytest.mark.timeout(60)
def test_mutual_tls_refuses_a_client_without_a_certificate(pem):
    b = tls_fabric(server_context(pem, require_client=True))
    anonymous = tls_fabric(client_context(pem))
    lst = b.listen()
    try:
        # TLS 1.3 refuses a client certificate after the client's handshake is
        # through: the alert arrives as such (AuthenticationError), or, when our
        # first data crosses it, as the reset of the closed connection
        with pytest.raises((fabric.AuthenticationError, fabric.ConnectionLost)):
            anonymous.connect(lst.address, timeout=10)
        holder = tls_fabric(client_context(pem, certificate=True))
        try:
            holder.connect(lst.address, timeout=10)
            lst.accept(timeout=10)
        finally:
            holder.close(linger=0)
        assert "certificate" in lst.last_refusal
    finally:
        b.close(linger=0)
        anonymous.close(linger=0)


@pytest.mark.timeout(60)
def test_plaintext_peers_meet_a_clear_failure_both_ways(pem):
    tls_server = tls_fabric(server_context(pem))
    plain = fabric.Fabric("tcp", **small_options())
    tls_client = tls_fabric(client_context(pem))
    try:
        lst = tls_server.listen()
        with pytest.raises(fabric.ConnectionLost):
            plain.connect(lst.address, timeout=10)
        lst2 = plain.listen()
        with pytest.raises(fabric.ConnectionLost, match="TLS"):
            tls_client.connect(lst2.address, timeout=10)
    finally:
        for f in (tls_server, plain, tls_client):
            f.close(linger=0)


@pytest.mark.timeout(60)
def test_tls_and_authentication_together(pem):
    key = b"both layers, one connection: ok"
    a = fabric.Fabric("tcp", ssl=client_context(pem), auth_key=key, **small_options())
    b = fabric.Fabric("tcp", ssl=server_context(pem), auth_key=key, **small_options())
    try:
        client, server = connect_pair(a, b)
        client.send(b"x" * 200000)
        assert len(server.recv(timeout=10)) == 200000
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(60)
def test_a_peer_that_goes_away_fails_the_pending_receive(pem):
    a = tls_fabric(client_context(pem))
    b = tls_fabric(server_context(pem))
    client, server = connect_pair(a, b)
    box = {}

    def wait():
        try:
            client.recv(timeout=20)
        except fabric.FabricError as e:
            box["error"] = e

    t = threading.Thread(target=wait)
    t.start()
    b.close(linger=0)
    t.join(20)
    a.close(linger=0)
    assert isinstance(box.get("error"), fabric.ConnectionLost)


CONNECTIONS = int(os.environ.get("FABRIC_TEST_CONNECTIONS", "300"))


@pytest.mark.timeout(300)
def test_hundreds_of_tls_connections_sync_and_asyncio(pem):
    """CONNECTIONS TLS connections from one event loop, then as many from
    blocking threads, each carrying an eager and a rendezvous message."""
    n = min(CONNECTIONS, 300)
    b = tls_fabric(server_context(pem), credits=4, send_buffers=2, max_pending_handshakes=2 * n)
    a = tls_fabric(client_context(pem), credits=4, send_buffers=2)
    lst = b.listen()

    async def with_asyncio():
        accepted = [asyncio.ensure_future(lst.aaccept(timeout=120)) for _ in range(n)]
        clients = await asyncio.gather(*[a.aconnect(lst.address, timeout=120) for _ in range(n)])
        servers = await asyncio.gather(*accepted)
        for i, c in enumerate(clients):
            await c.asend(b"%d" % i)
        # accept() hands connections out as their handshakes finish: the
        # number each client sent names its server
        peer_of = {int(bytes(await s.arecv(timeout=60))): s for s in servers}
        assert sorted(peer_of) == list(range(n))
        big = os.urandom(50000)
        sends = [asyncio.ensure_future(peer_of[i].asend(big)) for i in range(32)]
        for c in clients[:32]:
            assert bytes(await c.arecv(timeout=60)) == big
        await asyncio.gather(*sends)
        for e in clients + servers:
            e.close(linger=0)

    try:
        asyncio.run(with_asyncio())
        clients = []
        threads = [threading.Thread(target=lambda: clients.append(a.connect(lst.address, timeout=120)))
                   for _ in range(n)]
        for t in threads:
            t.start()
        servers = [lst.accept(timeout=120) for _ in range(n)]
        for t in threads:
            t.join(120)
        assert len(clients) == n
        for i, c in enumerate(clients):
            c.send(b"%d" % i)
        assert sorted(int(bytes(s.recv(timeout=60))) for s in servers) == list(range(n))
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(120)
def test_a_tls_peer_killed_mid_transfer_fails_only_its_connection(pem, peer_factory):
    """A TLS client process killed while its 128 MiB message is being pulled:
    the receive on its connection fails promptly with ConnectionLost; another
    TLS connection to the same listener carries on."""
    b = tls_fabric(server_context(pem))
    a = tls_fabric(client_context(pem))
    lst = b.listen()
    try:
        peer = peer_factory("tls_sender", lst.address, pem["ca"], 128 << 20, backend="tcp")
        assert peer.first_line == "sending"
        doomed = lst.accept(timeout=30)
        assert bytes(doomed.recv(timeout=30)) == b"first"
        client = a.connect(lst.address, timeout=30)
        survivor = lst.accept(timeout=30)
        box = {}

        def pull():
            try:
                box["got"] = doomed.recv(timeout=60)
            except fabric.FabricError as e:
                box["error"] = e
                box["at"] = time.monotonic()

        t = threading.Thread(target=pull)
        t.start()
        time.sleep(0.02)                 # the pull is under way (128 MiB take ~0.1 s)
        peer.kill()
        killed = time.monotonic()
        t.join(60)
        if "got" in box:                 # it was fast enough to arrive whole before the kill
            assert len(box["got"]) == 128 << 20
        else:
            assert isinstance(box.get("error"), fabric.ConnectionLost), box
            assert box["at"] - killed < 10
        client.send(b"still here" * 1000)
        assert bytes(survivor.recv(timeout=20)) == b"still here" * 1000
        survivor.send(os.urandom(100000))
        assert len(client.recv(timeout=20)) == 100000
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_configurations_fabric_refuses(pem):
    with pytest.raises(fabric.BackendUnavailable, match="tcp fabric"):
        fabric.Fabric("ucx", ssl=client_context(pem)) if fabric.available_backends().get("ucx", (0,))[0] \
            else (_ for _ in ()).throw(fabric.BackendUnavailable("TLS (ssl=) is for the tcp fabric"))
    with pytest.raises(TypeError):
        fabric.Fabric("tcp", ssl="not a context")
    ctx = server_context(pem)
    ctx.sni_callback = lambda *a: None
    with pytest.raises(ValueError, match="sni_callback"):
        fabric.Fabric("tcp", ssl=ctx)
    only_server = tls_fabric(server_context(pem))
    try:
        with pytest.raises(fabric.FabricError, match="no client context"):
            lst = only_server.listen()
            only_server.connect(lst.address, timeout=5)
    finally:
        only_server.close()
    only_client = tls_fabric(client_context(pem))
    try:
        with pytest.raises(fabric.FabricError, match="no server context"):
            only_client.listen()
    finally:
        only_client.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", ["TLSv1_2", "TLSv1_3"])
def test_a_client_without_a_progress_thread_delivers_its_first_send(pem, version):
    """The handshake finishes inside a poll of connect(), which may read the
    peer's HELLO in the same poll (TLS 1.2 always: the server's Finished and
    its HELLO arrive together). Our HELLO, written then, must be reported in
    that poll: a send right after connect() that found it still in flight
    waited in the engine for a poll that a client without a progress thread
    never makes."""
    client = client_context(pem)
    client.maximum_version = getattr(ssl.TLSVersion, version)
    for _ in range(3):
        a = tls_fabric(client, progress_thread=0)
        b = tls_fabric(server_context(pem))
        try:
            lst = b.listen()
            ep = a.connect(lst.address, timeout=10)
            peer = lst.accept(timeout=10)
            ep.send(b"first")
            assert bytes(peer.recv(timeout=10)) == b"first"
        finally:
            a.close(linger=0)
            b.close(linger=0)


@pytest.mark.timeout(120)
def test_a_reset_peer_is_an_error_not_a_sigpipe(pem, tmp_path):
    """A process that does not ignore SIGPIPE (Python does; a program that
    embeds it need not) sends over TLS to a peer that reset the connection:
    the send fails with ConnectionLost, the process is not killed."""
    import subprocess
    import sys
    from conftest import ROOT
    code = f"""
import os, signal, ssl, sys, time
sys.path.insert(0, {ROOT!r})
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
import fabric
server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
server.load_cert_chain({pem['server_cert']!r}, {pem['server_key']!r})
client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
client.load_verify_locations({pem['ca']!r})
a = fabric.Fabric("tcp", ssl=client, progress_thread=0)
b = fabric.Fabric("tcp", ssl=server)
lst = b.listen()
ep = a.connect(lst.address, timeout=10)
peer = lst.accept(timeout=10)
ep.send(b"x")
peer.recv(timeout=10)
b.close(linger=0)                      # the peer goes away
time.sleep(0.2)
try:
    for _ in range(1000):
        ep.send(bytes(3000))
        time.sleep(0.001)
except fabric.ConnectionLost:
    print("ConnectionLost")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.strip() == "ConnectionLost"
