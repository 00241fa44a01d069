"""Across a wire between two hosts (tools/wire.sh: two QEMU guests joined by
a virtual Ethernet link, rxe0 on each NIC): every message crosses once,
intact and in order, on a clean link and on one that delays, drops,
reorders, duplicates or is cut for a while; many connections at once from
asyncio. The far end is tests/peers.py's wire_server, started on the other
host by tests/wire_agent.py; the link is shaped with netem on both hosts'
NICs (netem shapes what leaves a host, so both sides are impaired).

Outside that set-up (FABRIC_WIRE_AGENT unset) these tests skip and say so.
"""
from __future__ import annotations

import asyncio
import os
import random
import subprocess
import threading
import time

import numpy as np
import pytest

import fabric
from conftest import WIRE_AGENT, small_options
from wire_agent import run_remote

pytestmark = pytest.mark.skipif(not WIRE_AGENT, reason="needs a second host on a wire: "
                                "tools/wire.sh runs this suite between two Soft-RoCE guests")

OPTS = small_options()
EAGER, CHUNK = OPTS["eager_limit"], OPTS["chunk_size"]
DEV = os.environ.get("FABRIC_WIRE_DEV", "eth0")
CONNECTIONS = int(os.environ.get("FABRIC_TEST_CONNECTIONS", "100"))
# how long a stalled transfer may take before the test calls it a hang (not a timing claim)
HANG = 120


def payload(size: int, index: int) -> bytes:
    return np.random.default_rng(index * 7919 + size).integers(0, 256, size, dtype=np.uint8).tobytes()


def mixed_sizes(count: int, largest: int, seed: int) -> list[int]:
    """Sizes from every protocol: coalesced, eager, one-chunk and chunked
    rendezvous, and a few of `largest`."""
    rng = random.Random(seed)
    bands = [(0, 64), (65, EAGER), (EAGER + 1, CHUNK), (CHUNK + 1, 8 * CHUNK), (largest, largest)]
    weights = [30, 30, 20, 15, 5]
    return [rng.randint(*rng.choices(bands, weights)[0]) for _ in range(count)]


def tc(*args: str, remote: bool) -> None:
    argv = ["tc", *args]
    if remote:
        code, out, err = run_remote(argv, timeout=30)
    else:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        code, err = r.returncode, r.stderr
    if code != 0:
        raise AssertionError(f"{'remote ' if remote else ''}{' '.join(argv)}: exit {code}: {err.strip()}")


def shape(spec: str | None) -> None:
    """netem `spec` on what leaves both hosts (None: a clean link)."""
    for remote in (False, True):
        if spec is None:
            try:
                tc("qdisc", "del", "dev", DEV, "root", remote=remote)
            except AssertionError as e:
                if "No such file" not in str(e) and "Cannot delete qdisc with handle of zero" not in str(e):
                    raise
        else:
            tc("qdisc", "replace", "dev", DEV, "root", "netem", *spec.split(), remote=remote)


@pytest.fixture
def link():
    """shape(spec) for the test; the link is clean again afterwards."""
    yield shape
    shape(None)


@pytest.fixture
def far_end(backend_name, peer_factory):
    """The wire_server on the other host: its address. What it said is
    printed afterwards (pytest shows it with a failure)."""
    peer = peer_factory("wire_server", backend=backend_name)
    yield peer.first_line
    peer.proc.kill()
    out, err = peer.proc.communicate(30)
    print(f"far end said: {out.strip()!r}; stderr: {err.strip()[-3000:]!r}")


def echo_checked(ep, sizes: list[int], window: int = 16) -> None:
    """Send each size (isend, `window` ahead) and check every echo: none
    lost, none twice, in order, byte for byte."""
    got: list[int] = []
    failure: list[BaseException] = []

    def receive():
        try:
            for i, n in enumerate(sizes):
                if i % 2:
                    buf = bytearray(n)
                    m = ep.recv_into(buf, timeout=HANG)
                    data = bytes(buf[:m])
                else:
                    data = bytes(ep.recv(timeout=HANG))
                if data != payload(n, i):
                    same_size = [j for j, s in enumerate(sizes) if s == len(data)]
                    raise AssertionError(f"echo {i} ({n} B) came back as {len(data)} B that differ; "
                                         f"messages of that size: {same_size[:5]}")
                got.append(i)
        except BaseException as e:
            failure.append(e)

    t = threading.Thread(target=receive)
    t.start()
    pending = []
    for i, n in enumerate(sizes):
        pending.append(ep.isend(payload(n, i)))
        if len(pending) >= window:
            pending.pop(0).wait(timeout=HANG)
        if failure:
            break
    for r in pending:
        r.wait(timeout=HANG)
    t.join(HANG * 2)
    assert not t.is_alive(), f"echoes stalled after {len(got)} of {len(sizes)}"
    if failure:
        raise failure[0]
    assert got == list(range(len(sizes)))


@pytest.mark.timeout(600)
def test_mixed_sizes_cross_the_wire_once_intact_and_in_order(backend_name, far_end):
    fab = fabric.Fabric(backend_name, **OPTS)
    ep = fab.connect(far_end, timeout=60)
    echo_checked(ep, mixed_sizes(300, 4 << 20, seed=1))
    stats = ep.stats()
    ep.close()
    assert stats["frames_received"] >= 300
    fab.close()


# netem specs: what the link does to every packet leaving either host
IMPAIRMENTS = {
    "delay": "delay 1ms 0.2ms distribution normal",
    "loss-0.1": "loss 0.1%",
    "loss-1": "loss 1%",
    "delay-loss-1": "delay 1ms 0.2ms distribution normal loss 1%",
    "reorder": "delay 1ms reorder 25% 50%",
    "duplicate": "duplicate 1%",
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("impairment", list(IMPAIRMENTS))
def test_a_misbehaving_link_loses_duplicates_reorders_and_corrupts_nothing(backend_name, far_end, link,
                                                                         impairment):
    fab = fabric.Fabric(backend_name, **OPTS)
    ep = fab.connect(far_end, timeout=60)
    link(IMPAIRMENTS[impairment])
    started = time.monotonic()
    # rxe resends a lost packet only after its ACK timeout (268 ms): fewer,
    # smaller messages keep a lossy run within minutes
    echo_checked(ep, mixed_sizes(120, 1 << 20, seed=2))
    print(f"{impairment}: 120 echoes in {time.monotonic() - started:.1f} s")
    ep.close()
    fab.close()


@pytest.mark.timeout(600)
def test_a_link_cut_for_seconds_and_restored_delivers_everything_or_fails_clearly(backend_name, far_end, link):
    """While messages cross, the link drops everything for 3 s, then heals:
    every message arrives once, in order, intact (the fabric's retransmission
    covers the gap), or the connection fails with a fabric error; no hang."""
    fab = fabric.Fabric(backend_name, **OPTS)
    ep = fab.connect(far_end, timeout=60)
    sizes = mixed_sizes(200, 1 << 20, seed=3)

    def cut():
        time.sleep(1.0)
        link("loss 100%")
        time.sleep(3.0)
        link(None)

    cutter = threading.Thread(target=cut)
    cutter.start()
    try:
        echo_checked(ep, sizes)
        outcome = "all delivered"
    except fabric.FabricError as e:
        outcome = f"failed clearly: {type(e).__name__}: {e}"
    cutter.join()
    print(f"link cut: {outcome}")
    ep.close(linger=0)
    fab.close()


@pytest.mark.timeout(900)
def test_a_hundred_asyncio_connections_cross_the_wire_at_once(backend_name, far_end):
    sizes = [8, EAGER + 1, 3 * CHUNK + 5]

    async def one(fab, k):
        ep = await fab.aconnect(far_end, timeout=HANG)
        for j, n in enumerate(sizes):
            data = payload(n, k * 10 + j)
            send = asyncio.ensure_future(ep.asend(data))
            back = await ep.arecv(timeout=HANG)
            await send
            assert bytes(back) == data, f"connection {k}: echo {j} differs"
        ep.close()

    async def main():
        fab = fabric.Fabric(backend_name, **OPTS)
        results = await asyncio.gather(*(one(fab, k) for k in range(CONNECTIONS)), return_exceptions=True)
        failed = [(k, r) for k, r in enumerate(results) if isinstance(r, BaseException)]
        fab.close()
        assert not failed, f"{len(failed)} of {CONNECTIONS} failed, first: {failed[0]}"

    asyncio.run(asyncio.wait_for(main(), 800))
