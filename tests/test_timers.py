"""The engine's one timer (fabric/protocol/core/timers.pxi): what must happen
at a time, not on an event (a handshake deadline; the ucx shared-memory
probe, tests/test_ucx.py), happens whoever is the poller: an application
thread blocked in a wait, the progress thread while the application is away,
or an asyncio loop waiting in the selector."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

import fabric

HANDSHAKE = 1.0
# generous: this checks that the deadline is honoured at all (without a
# wake-up, a silent connection would stay until the next event)
LATE = HANDSHAKE + 3.0


def silent_client(address):
    """A TCP connection that never says anything; returns (socket, a dict
    that receives 'closed_after' once the server drops it)."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    seen = {}
    started = time.monotonic()

    def watch():
        try:
            sock.recv(1)
        except OSError:
            pass
        seen["closed_after"] = time.monotonic() - started
    threading.Thread(target=watch, daemon=True).start()
    return sock, seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("poller", ["blocked accept", "progress thread", "asyncio loop"])
def test_a_silent_connection_is_dropped_at_its_handshake_deadline_whoever_polls(poller):
    fab = fabric.Fabric("tcp", handshake_timeout=HANDSHAKE, progress_thread=int(poller == "progress thread"))
    lst = fab.listen("127.0.0.1:0")
    sock, seen = silent_client(lst.address)
    try:
        if poller == "blocked accept":
            with pytest.raises(fabric.Timeout):
                lst.accept(timeout=LATE)
        elif poller == "progress thread":
            time.sleep(LATE)                   # the application is away
        else:
            async def main():
                with pytest.raises(fabric.Timeout):
                    await lst.aaccept(timeout=LATE)
            asyncio.run(main())
        deadline = time.monotonic() + 5
        while "closed_after" not in seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "closed_after" in seen, "the silent connection was never dropped"
        assert HANDSHAKE * 0.9 <= seen["closed_after"] <= LATE, seen
        # and the listener still serves a real client (accepted in a thread:
        # without a progress thread the server answers the handshake only
        # while someone polls it)
        accepted = {}
        acceptor = threading.Thread(target=lambda: accepted.setdefault("ep", lst.accept(timeout=10)))
        acceptor.start()
        client = fabric.Fabric("tcp").connect(lst.address, timeout=10)
        acceptor.join(15)
        server = accepted["ep"]
        client.send(b"after")
        assert server.recv(timeout=10) == b"after"
        client.close(linger=0)
        server.close(linger=0)
    finally:
        sock.close()
        lst.close()
        fab.close()
