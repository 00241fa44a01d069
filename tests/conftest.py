"""Shared fixtures. Every endpoint test takes `backend_name`, so each backend
added later runs the same suite; an unavailable backend is skipped with the
reason the registry gives."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

import fabric
from fabric import backends
from wire_agent import RemoteProcess, agent_address

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# A variant is a backend plus the transport environment it runs with (None:
# the variable unset): ucx as a user gets it (UCX_TLS unset: shared memory
# negotiated between processes of this host), over UCX's tcp transport and
# over shared memory only.
VARIANTS = {"tcp": ("tcp", {}), "ucx": ("ucx", {"UCX_TLS": None}), "ucx-tcp": ("ucx", {"UCX_TLS": "tcp"}),
            "ucx-sm": ("ucx", {"UCX_TLS": "sm"}), "verbs": ("verbs", {})}
ENDPOINT_BACKENDS = [b for b in os.environ.get("FABRIC_TEST_BACKENDS", ",".join(VARIANTS)).split(",") if b]


# The "ucx" variant (UCX_TLS unset) reaches the paths of ucx-sm once its
# bootstrap has chosen shared memory; it runs where that choice matters
# (connection set-up, failures, lifetimes, asyncio) unless asked for by name,
# which keeps the CI run short.
AUTO_UCX_MODULES = {"test_endpoint", "test_faults", "test_lifecycle", "test_asyncio", "test_examples", "test_dask"}


@pytest.fixture(params=ENDPOINT_BACKENDS)
def backend_name(request, monkeypatch):
    if (request.param == "ucx" and "FABRIC_TEST_BACKENDS" not in os.environ
            and request.module.__name__.rsplit(".", 1)[-1] not in AUTO_UCX_MODULES):
        pytest.skip("ucx with UCX_TLS unset runs the set-up, failure, lifetime and asyncio suites; "
                    "here ucx-sm covers the same shared-memory paths (FABRIC_TEST_BACKENDS=ucx runs it)")
    name, env = VARIANTS[request.param]
    ok, reason = backends.available().get(name, (False, "unknown backend"))
    if not ok:
        pytest.skip(f"backend {name} unavailable here: {reason}")
    for k, v in env.items():          # read when each Fabric (and peer process) starts
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)
    return name


def small_options(**extra):
    """Small thresholds so boundaries, chunking and credits are exercised
    with small messages."""
    opts = dict(eager_limit=4096, chunk_size=16384, chunks_in_flight=3, coalesce_limit=8192,
                credits=8, send_buffers=4, recv_budget=1 << 20, spin_us=20, close_linger=2.0)
    opts.update(extra)
    return opts


@pytest.fixture
def fab(backend_name):
    return fabric.Fabric(backend_name, **small_options())


def wait_for(cond, timeout=10.0):
    """True once cond() holds, False if it did not within timeout seconds."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def unused_port():
    """A port for another process to listen on, free on 127.0.0.1 and ::1.

    Drawn below the kernel's ephemeral range: a port bound to 0 and handed on
    can be taken, before its new owner binds it, as the local port of any
    outgoing connection the parallel tests make (a CI run lost a torch store
    to EADDRINUSE on ::1 that way)."""
    import errno
    import random
    import socket
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    low = max(low, 2048)
    for _ in range(200):
        port = random.randrange(max(1024, low - 12000), low)
        try:
            for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
                try:
                    with socket.socket(family) as s:
                        s.bind((host, port))
                except OSError as e:
                    if family == socket.AF_INET6 and e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                        continue        # no IPv6 here: IPv4 decides
                    raise               # in use
        except OSError:
            continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def connect_pair(fab_a, fab_b=None, address="127.0.0.1:0", timeout=10):
    """(client, server) endpoints; the handshake runs on both sides at once."""
    fab_b = fab_b or fab_a
    lst = fab_b.listen(address)
    result = {}

    def accept():
        try:
            result["server"] = lst.accept(timeout=timeout)
        except BaseException as e:  # pragma: no cover - reported below
            result["error"] = e

    t = threading.Thread(target=accept)
    t.start()
    client = fab_a.connect(lst.address, timeout=timeout)
    t.join(timeout)
    lst.close()
    if "error" in result:
        raise result["error"]
    return client, result["server"]


@pytest.fixture
def pair(fab):
    client, server = connect_pair(fab, fabric.Fabric(fab.name, **small_options()))
    yield client, server
    client.close(linger=0)
    server.close(linger=0)


# Across the wire (tools/softroce.py --guests 2, tests/wire_agent.py) peers
# run on the other host, and what a test offers them listens on this host's
# address on the link instead of loopback.
WIRE_AGENT = agent_address()
PEER_FACING_HOST = os.environ.get("FABRIC_GUEST_ADDR", "127.0.0.1") if WIRE_AGENT else "127.0.0.1"
PEER_FACING = f"{PEER_FACING_HOST}:0"


class Peer:
    """A peer in another OS process (tests/peers.py); its first stdout line
    is its address or 'ready'. Across the wire the process runs on the other
    host (proc is then a wire_agent.RemoteProcess)."""

    def __init__(self, role, *args, backend="tcp", env=None):
        cmd = [sys.executable, os.path.join(HERE, "peers.py"), role, backend, *map(str, args)]
        if WIRE_AGENT:
            self.proc = RemoteProcess(cmd, env)
        else:
            full_env = dict(os.environ)
            full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
            full_env.update(env or {})
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True, env=full_env)
        line = self.read_line(timeout=120)
        if not line:
            err = self.proc.stderr.read()
            raise RuntimeError(f"peer {role} failed to start: {err}")
        self.first_line = line

    def read_line(self, timeout=60):
        """The peer's next stdout line ("" if it ended or said nothing in time)."""
        # byte by byte from the descriptor: a buffered readline could take the
        # lines after it too, and communicate() (in wait) reads the descriptor
        # itself, so those lines were lost to the test
        if WIRE_AGENT:
            return self.proc.read_line(timeout).strip()
        import select
        raw = bytearray()
        end = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while not raw.endswith(b"\n"):
            if not select.select([fd], [], [], max(0.0, end - time.monotonic()))[0]:
                break
            b = os.read(fd, 1)
            if not b:
                break
            raw += b
        return raw.decode(errors="replace").strip()

    def wait(self, timeout=60):
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"peer did not finish: {err}")
        return self.proc.returncode, out, err

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()
        if WIRE_AGENT:
            self.proc.close()


@pytest.fixture
def peer_factory():
    peers = []

    def make(*args, **kw):
        p = Peer(*args, **kw)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.__exit__(None, None, None)


def pytest_collection_modifyitems(config, items):
    """Across the wire only what crosses it runs: the tests whose peer is
    another process (run on the other host) and the wire suite itself; a
    test with both ends in this process would only loop back here."""
    if not WIRE_AGENT:
        return
    keep, drop = [], []
    for item in items:
        crosses = "peer_factory" in getattr(item, "fixturenames", ()) or item.module.__name__.endswith("test_wire")
        (keep if crosses else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def sigint_default():
    """Popen preexec_fn for a child the test interrupts with SIGINT: a suite
    started as a background job of a non-interactive shell (CI, nohup)
    inherits SIGINT ignored, and so would the child, where Python then
    installs no KeyboardInterrupt handler."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
