"""TCP between two hosts: two network namespaces joined by a veth pair
(198.18.0.0/15 benchmarking addresses; nothing leaves the machine)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import HERE, ROOT, small_options

SIZES = [0, 8, small_options()["eager_limit"] + 1, 5 * small_options()["chunk_size"] + 3, 4 << 20]


def sh(*args):
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


@pytest.fixture
def namespaces():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = str(os.getpid())
    a, b = f"fabA{tag}", f"fabB{tag}"
    va, vb = f"fva{tag}"[:15], f"fvb{tag}"[:15]
    r = sh("ip", "netns", "add", a)
    if r.returncode != 0:
        pytest.skip(f"this machine does not allow network namespaces: {r.stderr.strip()}")
    try:
        steps = [("ip", "netns", "add", b),
                 ("ip", "link", "add", va, "type", "veth", "peer", "name", vb),
                 ("ip", "link", "set", va, "netns", a),
                 ("ip", "link", "set", vb, "netns", b),
                 ("ip", "-n", a, "addr", "add", "198.18.0.1/30", "dev", va),
                 ("ip", "-n", b, "addr", "add", "198.18.0.2/30", "dev", vb),
                 ("ip", "-n", a, "link", "set", va, "up"),
                 ("ip", "-n", b, "link", "set", vb, "up"),
                 ("ip", "-n", a, "link", "set", "lo", "up"),
                 ("ip", "-n", b, "link", "set", "lo", "up")]
        for step in steps:
            r = sh(*step)
            if r.returncode != 0:
                pytest.skip(f"cannot build the veth test network ({' '.join(step)}): {r.stderr.strip()}")
        yield a, b
    finally:
        sh("ip", "netns", "del", a)
        sh("ip", "netns", "del", b)


@pytest.mark.timeout(120)
def test_tcp_between_two_network_namespaces(namespaces):
    a, b = namespaces
    env = dict(os.environ, PYTHONPATH=ROOT)
    peers = os.path.join(HERE, "peers.py")
    server = subprocess.Popen(["ip", "netns", "exec", a, sys.executable, peers, "echo_at", "tcp",
                               "198.18.0.1:0", str(len(SIZES))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        address = server.stdout.readline().strip()
        assert address.startswith("198.18.0.1:"), server.stderr.read()
        client = subprocess.run(["ip", "netns", "exec", b, sys.executable, peers, "echo_client", "tcp",
                                 address, ",".join(map(str, SIZES))],
                                capture_output=True, text=True, env=env, timeout=90)
        assert client.returncode == 0, client.stderr
        assert "connected 198.18.0.2:" in client.stdout and client.stdout.strip().endswith("ok")
        assert server.wait(timeout=30) == 0
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


LOCALITY = """
import socket, sys
from fabric.backends.sockets import _peer_on_this_host
role, address = sys.argv[1], sys.argv[2]
if role == "listen":
    lst = socket.create_server((address, 0))
    print(lst.getsockname()[1], flush=True)
    conn, _ = lst.accept()
    print(_peer_on_this_host(conn.fileno()), flush=True)
    conn.recv(1)
else:
    host, port = address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    print(_peer_on_this_host(s.fileno()), flush=True)
    s.send(b"x")
"""


@pytest.mark.timeout(60)
def test_the_same_host_check_of_ucx_cannot_be_claimed_from_another_host(namespaces):
    """ucx announces keys for its shared-memory pulls only to a peer on this
    host, which it checks on the connection (loopback, or our own address),
    not on what the peer says: across two network namespaces (two hosts, to
    the network) both ends see a remote peer; over loopback both see a local
    one."""
    a, b = namespaces
    env = dict(os.environ, PYTHONPATH=ROOT)
    for listen_ns, connect_ns, host, expected in ((a, b, "198.18.0.1", "False"), (a, a, "127.0.0.1", "True"),
                                                  (a, a, "198.18.0.1", "True")):
        server = subprocess.Popen(["ip", "netns", "exec", listen_ns, sys.executable, "-c", LOCALITY, "listen", host],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            port = server.stdout.readline().strip()
            assert port.isdigit(), server.stderr.read()
            client = subprocess.run(["ip", "netns", "exec", connect_ns, sys.executable, "-c", LOCALITY, "connect",
                                     f"{host}:{port}"], capture_output=True, text=True, timeout=30, env=env)
            assert client.returncode == 0, client.stderr
            out, err = server.communicate(timeout=30)
            assert (client.stdout.strip(), out.strip()) == (expected, expected), (host, client.stdout, out, err)
        finally:
            if server.poll() is None:
                server.kill()
