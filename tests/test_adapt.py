"""Thresholds that adapt to the link (option adapt, fabric/protocol/core/adapt.pxi):
which thresholds a Fabric leaves free, the PING/PONG round trip, growth to
the bandwidth-delay product within the bounds, a user's values kept, and a
peer that abuses PING cut off. The link with real delay is in
tests/test_wire.py (netem between two guests)."""
from __future__ import annotations

import time

import pytest

import fabric
from fabric import options as fopts
from fabric.protocol import frame
from conftest import small_options
from memfabric import MemPair, memory

ALL = fopts.adapt_mask(fopts.ADAPTIVE)


def test_a_fabric_adapts_only_the_thresholds_nobody_set(monkeypatch):
    monkeypatch.setenv("FABRIC_PROFILE", "none")
    assert fabric.Fabric("tcp").adapting == ["eager_limit", "chunk_size", "chunks_in_flight"]
    assert fabric.Fabric("tcp", chunk_size="1M").adapting == ["eager_limit", "chunks_in_flight"]
    monkeypatch.setenv("FABRIC_EAGER_LIMIT", "16K")
    assert fabric.Fabric("tcp").adapting == ["chunk_size", "chunks_in_flight"]
    assert fabric.Fabric("tcp", adapt=0).adapting == []


def test_ping_and_pong_frames_round_trip_through_the_codec():
    for name in ("PING", "PONG"):
        (f,) = frame.decode(frame.encode_header(frame.TYPES[name], 0, 0, 0x1234567890))
        assert f["type"] == name and f["msg_id"] == 0x1234567890


def deliver_slowly(pair, seconds, limit=200):
    """Deliver every pending item in order, each after `seconds`: a link
    whose one-way delay is at least that."""
    for _ in range(limit):
        pair.progress()
        items = pair.deliverable()
        if not items:
            pair.progress()
            if not pair.deliverable():
                return
            continue
        time.sleep(seconds)
        pair.link.deliver(items[0][0])
    raise AssertionError("the link never got quiet")


def receive(pair, side, rounds=2000):
    for _ in range(rounds):
        got = pair.eps[side]._try_recv(None)
        if got is not None:
            return bytes(got)
        pair.settle(1)
    raise AssertionError("nothing arrived")


def pattern(size, seed):
    unit = bytes((seed * 31 + i) & 255 for i in range(251))
    return (unit * (size // len(unit) + 1))[:size]


@pytest.mark.skipif(memory is None, reason="fabric.backends._memory was not built")
@pytest.mark.timeout(60)
def test_a_long_link_grows_the_free_thresholds_within_their_bounds_and_messages_stay_intact():
    opts = small_options()
    pair = MemPair(adapt_mask=ALL, chunks_in_flight=1, adapt_max_window=6, adapt_max_chunk="256K")
    try:
        deliver_slowly(pair, 0.004)            # HELLOs, then 3 PINGs each way: >= 8 ms round trips
        link = pair.eps[0].link
        assert link["rtt_us"] >= 8000
        # a round trip this long: everything a slab holds goes eagerly
        assert link["eager_limit"] > opts["eager_limit"]
        assert pair.eps[0].protocol_for(link["eager_limit"]) == ("eager", 0)
        assert link["chunk_size"] == opts["chunk_size"] and link["chunks_in_flight"] == 1
        first = pattern(6 * opts["chunk_size"], 1)
        pair.eps[0].isend(first)
        assert receive(pair, 1) == first
        assert pair.settle()
        link = pair.eps[0].link
        assert link["bandwidth_MBps"] > 0 and link["changes"] >= 2, link
        # bandwidth x 8 ms is far more than one 16 KiB chunk: the window
        # reaches its bound first, then chunks grow (to a 64 KiB multiple)
        assert link["chunks_in_flight"] == 6
        assert opts["chunk_size"] < link["chunk_size"] <= 256 << 10
        assert link["chunk_size"] % 65536 == 0 or link["chunk_size"] == 256 << 10
        assert "bandwidth" in link["why"]
        sizes = [link["eager_limit"], link["eager_limit"] + 1, 3 * link["chunk_size"] + 5,
                 20 * link["chunk_size"] + 1, 1]
        for i, size in enumerate(sizes):
            msg = pattern(size, i + 2)
            pair.eps[0].isend(msg)
            assert receive(pair, 1) == msg, size
        back = pattern(9 * opts["chunk_size"], 99)
        pair.eps[1].isend(back)
        assert receive(pair, 0) == back
        assert pair.settle()
        assert pair.eps[0].stats()["registered_regions"] == 0
    finally:
        pair.close()


@pytest.mark.skipif(memory is None, reason="fabric.backends._memory was not built")
@pytest.mark.timeout(60)
def test_thresholds_left_out_of_adapt_keep_their_values_on_a_long_link():
    opts = small_options()
    pair = MemPair(adapt_mask=fopts.adapt_mask(["chunks_in_flight"]), chunks_in_flight=1, adapt_max_window=4)
    try:
        deliver_slowly(pair, 0.004)
        msg = pattern(8 * opts["chunk_size"], 3)
        pair.eps[0].isend(msg)
        assert receive(pair, 1) == msg
        assert pair.settle()
        link = pair.eps[0].link
        assert link["adapting"] == ["chunks_in_flight"]
        assert link["eager_limit"] == opts["eager_limit"] and link["chunk_size"] == opts["chunk_size"]
        assert link["chunks_in_flight"] == 4
    finally:
        pair.close()


@pytest.mark.timeout(120)
def test_every_connection_measures_its_round_trip_and_keeps_within_bounds(backend_name, monkeypatch):
    """Defaults on a real fabric, 1 and 100 connections: each measures its
    round trip at the handshake; what adapts stays between the configured
    value and its bound; 16 MiB messages arrive intact."""
    monkeypatch.setenv("FABRIC_PROFILE", "none")
    a, b = fabric.Fabric(backend_name), fabric.Fabric(backend_name)
    base = a.options
    lst = b.listen("127.0.0.1:0")
    pairs = []
    try:
        for _ in range(100):
            pairs.append((a.connect(lst.address, timeout=30), lst.accept(timeout=30)))
        big = pattern(16 << 20, 5)
        first, second = pairs[0]
        for _ in range(3):
            first.send(big)
            assert bytes(second.recv(timeout=60)) == big
        deadline = time.monotonic() + 30
        for x, y in pairs:
            for ep in (x, y):
                while ep.link["rtt_us"] is None and time.monotonic() < deadline:
                    time.sleep(0.01)
                link = ep.link
                assert link["rtt_us"] is not None and link["rtt_us"] > 0, link
                assert base["eager_limit"] <= link["eager_limit"] <= max(base["eager_limit"], base["coalesce_limit"])
                assert base["chunk_size"] <= link["chunk_size"] <= base["adapt_max_chunk"]
                assert base["chunks_in_flight"] <= link["chunks_in_flight"] <= base["adapt_max_window"]
    finally:
        for x, y in pairs:
            x.close(linger=0)
            y.close(linger=0)
        lst.close()


@pytest.mark.timeout(60)
def test_fixed_thresholds_are_what_every_connection_uses(backend_name):
    fixed = dict(eager_limit=4096, chunk_size=65536, chunks_in_flight=3)
    a, b = fabric.Fabric(backend_name, **fixed), fabric.Fabric(backend_name, **fixed)
    lst = b.listen("127.0.0.1:0")
    x = a.connect(lst.address, timeout=30)
    y = lst.accept(timeout=30)
    try:
        msg = pattern(50 * 65536 + 7, 8)
        x.send(msg)
        assert bytes(y.recv(timeout=30)) == msg
        link = x.link
        assert link["adapting"] == [] and link["changes"] == 0
        assert (link["eager_limit"], link["chunk_size"], link["chunks_in_flight"]) == (4096, 65536, 3)
    finally:
        x.close(linger=0)
        y.close(linger=0)
        lst.close()
