"""UCX-specific behaviour (the shared endpoint suite runs on ucx as well)."""
import os
import socket
import subprocess
import sys
import threading

import pytest

import fabric
from fabric import backends
from conftest import connect_pair, small_options

ok, reason = backends.available()["ucx"]
pytestmark = pytest.mark.skipif(not ok, reason=f"backend ucx unavailable here: {reason}")


@pytest.fixture(params=["tcp", "sm"])
def tls(request, monkeypatch):
    monkeypatch.setenv("UCX_TLS", request.param)
    return request.param


@pytest.mark.timeout(90)
def test_memory_maps_are_released_after_each_message(tls):
    fab, other = fabric.Fabric("ucx", **small_options()), fabric.Fabric("ucx", **small_options())
    client, server = connect_pair(fab, other)
    size = 5 * small_options()["chunk_size"] + 3
    for i in range(200):
        req = client.isend(bytes([i % 256]) * size)
        assert server.recv(timeout=10)[size - 1] == i % 256
        req.wait(timeout=10)
    assert client.stats()["sent_rendezvous"] == 200
    assert client.stats()["registered_regions"] == 0       # every ucp_mem_map was undone
    assert server.stats()["registered_regions"] == 0
    client.close()
    server.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("garbage", [os.urandom(64), b"FUCX" + bytes(16), b"FUCX\x01\x00\x00\x00" + bytes(8) + b"\xff\xff\xff\xff"],
                         ids=["random", "zero-header", "huge-length"])
def test_listener_survives_garbage(tls, garbage):
    fab = fabric.Fabric("ucx", **small_options(handshake_timeout=2.0))
    lst = fab.listen("127.0.0.1:0")
    host, port = lst.address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)))
    raw.sendall(garbage)
    with pytest.raises(fabric.Timeout):
        lst.accept(timeout=0.5)            # the garbage never becomes an endpoint
    raw.close()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("s", lst.accept(timeout=10)))
    t.start()
    client = fabric.Fabric("ucx", **small_options()).connect(lst.address, timeout=10)
    t.join(10)
    client.send(b"fine")
    assert box["s"].recv(timeout=10) == b"fine"
    client.close()
    box["s"].close()
    lst.close()


def test_version_check_reports_both_versions():
    from fabric import backends
    ucx = backends.load_module("ucx")
    built, loaded = ucx.runtime_version()
    assert built == loaded
    assert ucx.shared_memory_only("sm") and ucx.shared_memory_only("posix,cma")
    assert not ucx.shared_memory_only("tcp") and not ucx.shared_memory_only("sm,tcp")
    assert not ucx.shared_memory_only("")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("size", [8193, 3 * 16384, 5 * 16384 + 7, 1 << 20])
def test_native_rendezvous_path(tls, size):
    """native_min routes large messages through UCX's own rendezvous
    (UCP_AM_SEND_FLAG_RNDV); data, ordering and recv_into must be the same."""
    opts = small_options(native_min=8192)
    fab, other = fabric.Fabric("ucx", **opts), fabric.Fabric("ucx", **opts)
    client, server = connect_pair(fab, other)
    msgs = [os.urandom(size), b"small after", os.urandom(size)]
    reqs = [client.isend(m) for m in msgs]
    buf = bytearray(size)
    assert server.recv_into(buf, timeout=10) == size and bytes(buf) == msgs[0]
    assert server.recv(timeout=10) == msgs[1]
    assert server.recv(timeout=10) == msgs[2]
    for r in reqs:
        r.wait(timeout=10)
    assert client.protocol_for(size) == ("native", 1)
    assert client.stats()["chunks_native"] == 2
    assert client.stats()["registered_regions"] == 0
    client.close()
    server.close()


def system_ucx_libs():
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    libs = {}
    for line in out.splitlines():
        for name in ("libucs.so.0", "libuct.so.0", "libucp.so.0"):
            if line.strip().startswith(name + " ") and "=>" in line:
                libs[name] = line.split("=>")[1].strip()
    return [libs[n] for n in ("libucs.so.0", "libuct.so.0", "libucp.so.0")] if len(libs) == 3 else None


def test_a_different_libucp_is_refused_not_used():
    """The wheel's UCX and Debian's share the soname libucp.so.0: when the other
    one gets loaded first, the backend must refuse, naming both versions."""
    from fabric import backends
    ucx = backends.load_module("ucx")
    libs = system_ucx_libs()
    if libs is None:
        pytest.skip("no system UCX (Debian libucx0) to clash with; tools/setup.sh installs it as root")
    built, _ = ucx.runtime_version()
    code = ("import fabric, sys; ok, why = fabric.available_backends()['ucx']; print(why); "
            "sys.exit(0 if not ok else 3)")
    env = dict(os.environ, LD_PRELOAD=":".join(libs), PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    if r.returncode == 3:
        pytest.skip(f"the system UCX has the same version as the build ({r.stdout.strip()})")
    assert r.returncode == 0, r.stderr
    assert f"built against UCX {built[0]}.{built[1]}" in r.stdout and "but loaded UCX" in r.stdout



ABANDONED_SENDS = r"""
import sys, fabric
fab = fabric.Fabric("ucx")
ep = fab.connect(sys.argv[1], timeout=30)
reqs = [ep.isend(bytearray(1 << 18)) for _ in range(8)]
try:
    for r in reqs:
        r.wait(timeout=30)
except fabric.FabricError:
    pass                            # the peer gave up on them: expected
fab.close(linger=0)                 # and this process leaves at once
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_leaving_under_sends_the_peer_gave_up_on_does_not_corrupt_memory(host):
    """A process sends 8 x 256 KiB by UCX's own rendezvous; the receiver takes
    one and closes; the sender closes its Fabric at once and exits. The
    domain lets UCX complete the cancelled requests before it destroys the
    worker: destroying it under them corrupted the heap in a third of such
    exits (SIGSEGV or SIGABRT in ucp_cleanup, UCX 1.22 over tcp)."""
    env = dict(os.environ, UCX_TLS="tcp", PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with fabric.Fabric("ucx") as fab:
        lst = fab.listen(f"[{host}]:0" if ":" in host else f"{host}:0")
        for _ in range(10):
            proc = subprocess.Popen([sys.executable, "-c", ABANDONED_SENDS, lst.address], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            ep = lst.accept(timeout=60)
            assert len(ep.recv(timeout=60)) == 1 << 18
            ep.close(linger=0)
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err[-3000:]
            assert "was not returned to mpool" not in err, err[-3000:]
            assert out == ""
