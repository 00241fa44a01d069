"""Backend selection and the reasons given for unavailable backends."""
import os

import pytest

import fabric
from fabric import backends
from conftest import small_options


def test_auto_picks_a_usable_backend(monkeypatch):
    monkeypatch.delenv("FABRIC_BACKEND", raising=False)
    fab = fabric.Fabric()
    assert fab.name in backends.KNOWN


def test_environment_variable_selects(monkeypatch):
    monkeypatch.setenv("FABRIC_BACKEND", "tcp")
    assert fabric.Fabric().name == "tcp"


def test_unknown_backend_lists_what_exists():
    with pytest.raises(fabric.BackendUnavailable) as info:
        fabric.Fabric("carrier-pigeon")
    text = str(info.value)
    assert "carrier-pigeon" in text and "tcp: available" in text


@pytest.mark.parametrize("name", ["ucx", "verbs", "softroce"])
def test_unavailable_backends_say_why(name):
    key = "verbs" if name == "softroce" else name
    ok, reason = backends.available()[key]
    if ok:
        pytest.skip(f"{name} is available here")
    with pytest.raises(fabric.BackendUnavailable) as info:
        fabric.Fabric(name)
    assert reason in str(info.value) and "tcp: available" in str(info.value)


def test_address_parsing():
    from fabric.address import parse
    assert parse("127.0.0.1:5") == ("127.0.0.1", 5)
    assert parse("[::1]:80") == ("::1", 80)
    assert parse("tcp://h:1", "tcp") == ("h", 1)
    assert parse("fabric+tcp://h:1", "tcp") == ("h", 1)
    assert parse("fabric://h:1", "ucx") == ("h", 1)
    assert parse("softroce://h:1", "verbs") == ("h", 1)
    for bad in ["nohost", "::1:80", "h:99999", "[::1]80", "h:port", "pigeon://h:1"]:
        with pytest.raises(fabric.AddressError):
            parse(bad)
    with pytest.raises(fabric.AddressError, match="names backend"):
        parse("ucx://h:1", "tcp")


def test_address_errors_are_fabric_errors_and_value_errors():
    fab = fabric.Fabric("tcp")
    try:
        for bad in ["nohost", "fabric+ucx://127.0.0.1:1"]:
            with pytest.raises(fabric.AddressError) as info:
                fab.connect(bad, timeout=1)
            assert isinstance(info.value, fabric.FabricError) and isinstance(info.value, ValueError)
        with pytest.raises(fabric.AddressError, match="Fabric\\('ucx'\\)"):
            fab.listen("ucx://127.0.0.1:0")
    finally:
        fab.close()


@pytest.mark.parametrize("name", ["tcp", "ucx"])
def test_module_level_functions_take_the_backend_from_the_scheme(name, monkeypatch):
    ok, reason = backends.available()[name]
    if not ok:
        pytest.skip(f"backend {name} unavailable here: {reason}")
    monkeypatch.setenv("FABRIC_BACKEND", "tcp" if name != "tcp" else "ucx")  # the scheme must win
    lst = fabric.listen(f"{name}://127.0.0.1:0")
    ep = fabric.connect(f"fabric+{name}://{lst.address}", timeout=10)
    peer = lst.accept(timeout=10)
    try:
        assert fabric.default_fabric(name).name == name
        ep.send(b"scheme")
        assert bytes(peer.recv(timeout=10)) == b"scheme"
    finally:
        ep.close(); peer.close(); lst.close()


def _ucx_in_subprocess(env_tls):
    import subprocess, sys, os
    code = ("import fabric\n"
            "try:\n    fabric.Fabric('ucx')\n"
            "except fabric.BackendUnavailable as e:\n    import sys; sys.stderr.write('REFUSED ' + str(e))\n")
    env = dict(os.environ, UCX_TLS=env_tls)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("tls,expected", [("", "UCX_TLS is set but empty"), ("nosuchtl", "none of the transports")])
def test_ucx_says_why_it_cannot_start_from_the_users_ucx_tls(tls, expected):
    ok, reason = backends.available()["ucx"]
    if not ok:
        pytest.skip(f"backend ucx unavailable here: {reason}")
    done = _ucx_in_subprocess(tls)
    assert "REFUSED" in done.stderr and expected in done.stderr, done.stderr
    assert done.stdout == ""          # UCX's own complaint goes to stderr too


def test_auto_order_is_fastest_first():
    from fabric.backends import auto_order
    assert auto_order() == ("verbs", "ucx", "tcp")


def _ucx_lanes(server_tls, client_tls):
    """Run an echo between two processes with the given UCX_TLS (None:
    unset) and UCX_PROTO_INFO=y; the set of UCX transports in the protocol
    tables each side printed (to stderr)."""
    import os, re, subprocess, sys
    from conftest import HERE, ROOT

    def env(tls):
        e = dict(os.environ, PYTHONPATH=ROOT, UCX_PROTO_INFO="y")
        e.pop("UCX_TLS", None)
        if tls is not None:
            e["UCX_TLS"] = tls
        return e

    peers = os.path.join(HERE, "peers.py")
    server = subprocess.Popen([sys.executable, peers, "echo_at", "ucx", "127.0.0.1:0", "3"], env=env(server_tls),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().strip()
        client = subprocess.run([sys.executable, peers, "echo_client", "ucx", address, "8,70000,2000000"],
                                env=env(client_tls), capture_output=True, text=True, timeout=60)
        _, server_err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert client.returncode == 0 and "ok" in client.stdout, client.stderr[-2000:]
    assert server.returncode == 0, server_err[-2000:]
    lanes = lambda text: set(re.findall(r"\|\s*([a-z_0-9]+)/[a-z_0-9]+\s*\|", text))
    return lanes(server_err), lanes(client.stderr)


def test_ucx_without_ucx_tls_uses_shared_memory_between_processes_of_one_host():
    ok, reason = backends.available()["ucx"]
    if not ok:
        pytest.skip(f"backend ucx unavailable here: {reason}")
    for side in _ucx_lanes(None, None):
        assert side and "tcp" not in side, side            # before: tcp lanes only (PEER mode)
        assert side & {"sysv", "posix", "cma"}, side


def test_ucx_explicit_tcp_on_one_side_keeps_both_on_peer_error_handling():
    ok, reason = backends.available()["ucx"]
    if not ok:
        pytest.skip(f"backend ucx unavailable here: {reason}")
    server, client = _ucx_lanes("tcp", None)
    assert "tcp" in server and "tcp" in client, (server, client)
    assert not client & {"sysv", "posix"}, client


@pytest.mark.parametrize("ucx_tls", [None, "tcp"])
def test_explain_auto_agrees_with_get(monkeypatch, ucx_tls):
    from fabric import backends
    if ucx_tls:
        monkeypatch.setenv("UCX_TLS", ucx_tls)
    else:
        monkeypatch.delenv("UCX_TLS", raising=False)
    picked, steps = backends.explain_auto()
    assert picked == backends.get("auto").name
    assert sorted(name for name, _, _ in steps) == sorted(backends.KNOWN)
    assert [name for name, _, _ in steps][:len(backends.auto_order())] == list(backends.auto_order())
    statuses = dict((name, status) for name, status, _ in steps)
    assert statuses[picked] == "picked"
    assert statuses["ucx"] != "skipped"          # auto tries ucx with or without UCX_TLS
    for name, status, why in steps:
        if status == "unusable":
            assert why == backends.available()[name][1]
            assert f"{name} unusable: {backends.short_reason(why)}" in backends.auto_reasons()
    assert backends.auto_summary().startswith(f"auto picks {picked}")


# ------------------------------------------------ the ucx and verbs bootstrap

def _usable(name):
    ok, reason = backends.available()[name]
    if not ok:
        pytest.skip(f"backend {name} unavailable here: {reason}")


def _le(*fields):
    import struct
    return b"".join(struct.pack("<" + f, v) for f, v in fields)


UCX_HEAD = lambda version=3, flags=0, alen=100: (b"FUCX" + _le(("H", version), ("H", flags), ("Q", 1), ("I", alen))
                                                 + bytes(32))
VERBS_MSG = lambda magic=b"FIBV", version=1, mtu=3: (magic + _le(("I", version), ("I", 1), ("I", 1)) + bytes(16)
                                                     + _le(("H", 0), ("B", mtu), ("B", 0), ("I", 1)))

BAD_BOOTSTRAPS = [
    ("ucx", b"XXXX" + UCX_HEAD()[4:], False, "peer is not a fabric ucx endpoint of this version (bad bootstrap)"),
    ("ucx", UCX_HEAD(version=2), False, "peer is not a fabric ucx endpoint of this version (bad bootstrap)"),
    ("ucx", UCX_HEAD(flags=8), False, "peer sent unknown bootstrap flags"),
    ("ucx", UCX_HEAD(alen=0), False, "peer sent an implausible UCX worker address"),
    ("ucx", UCX_HEAD(alen=65537), False, "peer sent an implausible UCX worker address"),
    ("ucx", UCX_HEAD()[:30], True, "peer closed the bootstrap connection"),
    ("ucx", UCX_HEAD() + bytes(50), True, "peer closed the bootstrap connection"),
    ("verbs", VERBS_MSG(magic=b"FUCX"), False, "peer is not a fabric verbs endpoint (bad bootstrap)"),
    ("verbs", VERBS_MSG(version=2), False, "peer is not a fabric verbs endpoint (bad bootstrap)"),
    ("verbs", VERBS_MSG(mtu=0), False, "peer is not a fabric verbs endpoint (bad bootstrap)"),
    ("verbs", VERBS_MSG(mtu=6), False, "peer is not a fabric verbs endpoint (bad bootstrap)"),
    ("verbs", VERBS_MSG()[:20], True, "peer closed the bootstrap connection"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name,reply,then_close,reason", BAD_BOOTSTRAPS)
def test_a_bad_bootstrap_fails_the_connect_with_its_reason(name, reply, then_close, reason):
    """What a peer that is not ours (or that dies mid-bootstrap) makes connect() say."""
    import socket, threading
    _usable(name)
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve():
        conn, _ = srv.accept()
        # the connection preamble of a listener without a key (core/auth.pxi), then the bootstrap
        conn.sendall(b"FBAU" + bytes([1, 1, 0, 0]) + name.encode().ljust(8, b"\0") + os.urandom(32) + reply)
        if then_close:
            conn.shutdown(socket.SHUT_WR)    # an end, not a reset: our message stays unread
        done.wait(10)
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    fab = fabric.Fabric(name, handshake_timeout=5.0)
    try:
        with pytest.raises(fabric.ConnectionLost) as info:
            fab.connect(f"127.0.0.1:{srv.getsockname()[1]}", timeout=10)
        assert reason in str(info.value)
    finally:
        done.set()
        t.join(10)
        srv.close()
        fab.close()


@pytest.mark.parametrize("name", ["ucx", "verbs"])
def test_a_silent_peer_times_the_handshake_out(name):
    import socket
    _usable(name)
    srv = socket.create_server(("127.0.0.1", 0))
    fab = fabric.Fabric(name, handshake_timeout=1.0)
    try:
        with pytest.raises(fabric.Timeout, match="no handshake from the peer"):
            fab.connect(f"127.0.0.1:{srv.getsockname()[1]}", timeout=10)
    finally:
        srv.close()
        fab.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["ucx", "verbs"])
@pytest.mark.parametrize("event", ["bytes", "end"])
def test_the_bootstrap_socket_watches_the_peer(name, event, monkeypatch):
    """After the exchange the bootstrap socket is the liveness monitor: its end
    means the peer went away, a byte on it is a protocol error."""
    import socket, threading
    from tcp_proxy import Proxy
    _usable(name)
    if name == "ucx":
        monkeypatch.setenv("UCX_TLS", "tcp")
    a, b = fabric.Fabric(name, **small_options()), fabric.Fabric(name, **small_options())
    lst = b.listen("127.0.0.1:0")
    relay = Proxy(int(lst.address.rsplit(":", 1)[1]))
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("server", lst.accept(timeout=10)))
    t.start()
    client = a.connect(f"127.0.0.1:{relay.port}", timeout=10)
    t.join(10)
    server = box["server"]
    try:
        client.send(b"before")
        assert bytes(server.recv(timeout=10)) == b"before"
        if event == "bytes":
            relay.socks[0].sendall(b"x")          # to the client, on its bootstrap socket
            error, reason = fabric.ProtocolError, "unexpected bytes on the bootstrap connection"
        else:
            relay.socks[0].shutdown(socket.SHUT_RDWR)   # the relay then ends the server's side too
            error, reason = fabric.ConnectionLost, "peer closed the connection"
        with pytest.raises(error) as info:
            client.recv(timeout=10)
        assert reason in str(info.value)
    finally:
        relay.close()
        client.close()
        server.close()
        lst.close()
        a.close()
        b.close()
