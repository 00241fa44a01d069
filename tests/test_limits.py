"""Limits a peer cannot push past (issue 15): each is a knob with a safe
default; a peer exceeding one loses only its own connection, with a clear
error, while the listener and other connections carry on. Runs on every
backend (see conftest). The hostile peer is a real Fabric told by
FABRIC_FAULT_INJECT=flood to ignore what its peer declared."""
from __future__ import annotations

import asyncio
import threading
import os
import time

import pytest

import fabric
from conftest import connect_pair, small_options, wait_for

CHUNK = small_options()["chunk_size"]


def flooding_fabric(backend_name, monkeypatch, **extra):
    monkeypatch.setenv("FABRIC_FAULT_INJECT", "flood")
    try:
        return fabric.Fabric(backend_name, **small_options(**extra))
    finally:
        monkeypatch.delenv("FABRIC_FAULT_INJECT")


def assert_still_serves(fab):
    """Another connection to fab works both ways."""
    other = fabric.Fabric(fab.name, **small_options())
    try:
        client, server = connect_pair(other, fab)
        sending = client.isend(b"x" * 3 * CHUNK)     # a rendezvous: done once pulled
        assert len(server.recv(timeout=20)) == 3 * CHUNK
        sending.wait(timeout=20)
        server.send(b"y")
        assert bytes(client.recv(timeout=20)) == b"y"
    finally:
        other.close(linger=0)


@pytest.mark.timeout(120)
def test_a_sender_keeps_to_the_max_rendezvous_its_peer_declares(backend_name):
    """The receiver accepts 2 rendezvous messages in flight; a sender queueing
    40 at once keeps to that, and every message arrives, in order."""
    a = fabric.Fabric(backend_name, **small_options())
    b = fabric.Fabric(backend_name, **small_options(max_rendezvous=2, chunks_in_flight=1))
    try:
        client, server = connect_pair(a, b)
        messages = [bytes([i]) * (2 * CHUNK + i) for i in range(40)]
        sends = [client.isend(m) for m in messages]
        for m in messages:
            assert bytes(server.recv(timeout=30)) == m
        for s in sends:
            s.wait(timeout=30)
        assert not server.closed
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flood", ["messages", "chunks"])
def test_a_peer_announcing_past_the_limits_loses_its_connection(backend_name, monkeypatch, flood):
    """A peer that ignores the declared limits (more rendezvous messages in
    flight than max_rendezvous, or more unanswered chunks of one message
    than chunks_in_flight) is cut off with a ProtocolError naming the knob;
    its last send fails; the victim's listener keeps serving."""
    hostile = flooding_fabric(backend_name, monkeypatch, chunks_in_flight=16)
    # recv_budget=0: the victim pulls nothing ahead, so announcements pile up
    victim = fabric.Fabric(backend_name, **small_options(max_rendezvous=3, chunks_in_flight=2, recv_budget=0))
    try:
        client, server = connect_pair(hostile, victim)
        if flood == "messages":
            sends = [client.isend(bytes(2 * CHUNK)) for _ in range(10)]
            knob = "max_rendezvous"
        else:
            # a chunk never spans two buffers: twelve buffers are twelve chunks
            # on every fabric (ucx's own rendezvous takes whole buffers)
            sends = [client.isend([bytes(CHUNK)] * 12)]
            knob = "chunks_in_flight"
        with pytest.raises(fabric.ProtocolError, match=knob):
            for _ in range(10):
                server.recv(timeout=20)
        # the last send cannot have completed (over ucx a message its own
        # eager protocol carried may have, from the sender's view)
        with pytest.raises(fabric.FabricError):
            sends[-1].wait(timeout=20)
        for s in sends[:-1]:
            try:
                s.wait(timeout=20)
            except fabric.FabricError:
                pass
        assert_still_serves(victim)
    finally:
        hostile.close(linger=0)
        victim.close(linger=0)


@pytest.mark.timeout(120)
def test_a_listener_turns_away_connections_past_max_connections(backend_name):
    """max_connections=3: the fourth connect fails at once naming the limit
    (blocking and asyncio), nothing of it reaches accept(); a place frees
    when a connection closes, from either end."""
    a = fabric.Fabric(backend_name, **small_options())
    b = fabric.Fabric(backend_name, **small_options(max_connections=3))
    lst = b.listen()
    try:
        clients = [a.connect(lst.address, timeout=10) for _ in range(3)]
        for i, c in enumerate(clients):
            c.send(b"%d" % i)
        # accept() hands connections out as their handshakes finish
        servers = [None] * 3
        for _ in range(3):
            s = lst.accept(timeout=10)
            servers[int(bytes(s.recv(timeout=10)))] = s
        assert lst.connections == 3
        started = time.monotonic()
        with pytest.raises(fabric.ConnectionLost, match="connection limit"):
            a.connect(lst.address, timeout=10)
        assert time.monotonic() - started < 5          # no retrying until the timeout

        async def aconnect():
            with pytest.raises(fabric.ConnectionLost, match="connection limit"):
                await a.aconnect(lst.address, timeout=10)
        asyncio.run(aconnect())
        assert wait_for(lambda: lst.refused == 2) and "max_connections" in lst.last_refusal
        with pytest.raises(fabric.Timeout):
            lst.accept(timeout=0.1)
        clients[0].close()                   # the client's end closes ...
        assert wait_for(lambda: lst.connections == 2), lst.connections
        servers[1].close(linger=0)           # ... and the server's
        assert lst.connections == 1
        more = [a.connect(lst.address, timeout=10) for _ in range(2)]
        accepted = [lst.accept(timeout=10) for _ in range(2)]
        for c in more:
            c.send(b"in")
        assert [bytes(e.recv(timeout=10)) for e in accepted] == [b"in", b"in"]
        clients[2].send(b"still")          # the connections that stayed carry on
        assert bytes(servers[2].recv(timeout=10)) == b"still"
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(300)
def test_a_storm_of_connects_past_max_connections_from_asyncio(backend_name):
    """Twice max_connections connect at once from one event loop: exactly
    max_connections get in and carry data, the rest fail with the limit's
    error, and the listener's count matches."""
    n = min(int(os.environ.get("FABRIC_TEST_CONNECTIONS", "200")), 200)

    async def main():
        a = fabric.Fabric(backend_name, **small_options(credits=4, send_buffers=2))
        b = fabric.Fabric(backend_name, **small_options(credits=4, send_buffers=2, max_connections=n,
                                                        max_pending_handshakes=4 * n))
        lst = b.listen()
        try:
            results = await asyncio.gather(*[a.aconnect(lst.address, timeout=120) for _ in range(2 * n)],
                                           return_exceptions=True)
            clients = [r for r in results if isinstance(r, fabric.Endpoint)]
            refused = [r for r in results if not isinstance(r, fabric.Endpoint)]
            assert len(clients) == n, (len(clients), refused[:3])
            assert all(isinstance(e, fabric.ConnectionLost) and "connection limit" in str(e) for e in refused)
            servers = [await lst.aaccept(timeout=60) for _ in range(n)]
            assert lst.connections == n
            for i, c in enumerate(clients):
                await c.asend(b"%d" % i)
            assert sorted([int(bytes(await s.arecv(timeout=60))) for s in servers]) == list(range(n))
        finally:
            a.close(linger=0)
            b.close(linger=0)
    asyncio.run(main())


@pytest.mark.timeout(180)
def test_the_fabric_wide_receive_budget_holds_many_senders_back(backend_name):
    """Eight connections each send 400 KB that nobody receives yet: the
    receiving Fabric buffers about total_recv_budget (plus what each peer's
    credits carry), not the 3.2 MB that the per-endpoint budgets would let
    in; a ninth connection whose application keeps receiving is not starved
    by that backlog; then everything arrives, in order."""
    opts = dict(recv_budget=1 << 20, total_recv_budget=256 << 10)
    a = fabric.Fabric(backend_name, **small_options())
    b = fabric.Fabric(backend_name, **small_options(**opts))
    lst = b.listen()
    try:
        pairs = []
        for i in range(9):
            client = a.connect(lst.address, timeout=10)
            client.send(b"%d" % i)
            pairs.append(client)
        servers = [None] * 9
        for _ in range(9):
            s = lst.accept(timeout=10)
            servers[int(bytes(s.recv(timeout=10)))] = s
        sends = [c.isend(b"%d:%d:" % (i, k) + bytes(2000)) for i, c in enumerate(pairs[:8]) for k in range(200)]
        last, stable = -1, 0
        while stable < 5:                         # until the buffered bytes stop growing
            time.sleep(0.05)
            now = b.buffered_bytes
            stable = stable + 1 if now == last else 0
            last = now
        slab = small_options()["coalesce_limit"] + 4096
        bound = opts["total_recv_budget"] + 8 * small_options()["credits"] * slab
        assert 0 < b.buffered_bytes <= bound < 8 * 200 * 2000, (b.buffered_bytes, bound)

        # the ninth connection carries on meanwhile, its application waiting in
        # recv_into() before each message arrives (such messages are never
        # buffered at all, so nothing releases their credits later)
        quick, got = pairs[8], []

        def receive():
            buf = bytearray(64)
            for _ in range(300):
                n = servers[8].recv_into(buf, timeout=20)
                got.append(bytes(buf[:n]))
        reader = threading.Thread(target=receive)
        reader.start()
        for k in range(300):
            quick.send(b"q%d" % k)
            time.sleep(0.0005)
        reader.join(60)
        assert got == [b"q%d" % k for k in range(300)]

        for i, s in enumerate(servers[:8]):
            for k in range(200):
                assert bytes(s.recv(timeout=30))[:12].startswith(b"%d:%d:" % (i, k))
        for r in sends:
            r.wait(timeout=30)
        assert b.buffered_bytes == 0
    finally:
        a.close(linger=0)
        b.close(linger=0)


@pytest.mark.timeout(120)
def test_strangers_cannot_fill_max_connections(backend_name):
    """Only authenticated connections take a place: strangers that send a
    valid preamble and never their MAC do not keep a keyed client out of a
    listener with max_connections=2."""
    from hostile import CONNECTOR, preamble, raw_connect
    key = b"an example key of 32 bytes, ok.."
    b = fabric.Fabric(backend_name, auth_key=key, **small_options(max_connections=2))
    a = fabric.Fabric(backend_name, auth_key=key, **small_options())
    lst = b.listen()
    strangers = []
    try:
        for _ in range(5):
            s = raw_connect(lst.address)
            s.sendall(preamble(CONNECTOR, True, b.name))
            strangers.append(s)
        time.sleep(0.2)
        assert lst.connections == 0
        clients = [a.connect(lst.address, timeout=10) for _ in range(2)]
        servers = [lst.accept(timeout=10) for _ in range(2)]
        assert lst.connections == 2
        with pytest.raises(fabric.ConnectionLost, match="connection limit"):
            a.connect(lst.address, timeout=10)
        for i, c in enumerate(clients):
            c.send(b"%d" % i)
        assert sorted(bytes(s.recv(timeout=10)) for s in servers) == [b"0", b"1"]
    finally:
        for s in strangers:
            s.close()
        a.close(linger=0)
        b.close(linger=0)
