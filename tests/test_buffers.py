"""fabric._buffers: bytes a receive fills in place, and the recycling of
large ones nobody references any more."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import fabric
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric._buffers import RECYCLE_MIN, new_bytes, recycler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = RECYCLE_MIN


@pytest.fixture(autouse=True)
def empty_cache():
    recycler().clear()
    yield
    recycler().clear()


def fill(view, byte):
    view[:] = bytes([byte]) * len(view)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [0, 1, 100, BIG - 1, BIG, 3 * BIG + 5])
def test_new_bytes_is_a_writable_view_of_a_bytes_object(size):
    b, view = new_bytes(size)
    assert type(b) is bytes and len(b) == size and view.nbytes == size and not view.readonly
    fill(view, 7)
    del view
    assert b == bytes([7]) * size


@pytest.mark.timeout(30)
def test_negative_size_is_refused():
    with pytest.raises(ValueError):
        new_bytes(-1)


@pytest.mark.timeout(30)
def test_a_dropped_large_buffer_comes_back_with_a_fresh_hash():
    b, view = new_bytes(BIG)
    fill(view, 1)
    del view
    first_id, first_hash = id(b), hash(b)
    del b
    b2, view2 = new_bytes(BIG)
    assert id(b2) == first_id and recycler().reused == 1
    fill(view2, 2)
    del view2
    assert hash(b2) == hash(bytes([2]) * BIG) != first_hash
    assert {b2: 1}[bytes([2]) * BIG] == 1          # usable as a key with its new content


@pytest.mark.timeout(30)
def test_a_buffer_still_referenced_is_never_reused():
    b, view = new_bytes(BIG)
    fill(view, 3)
    del view
    held_view = memoryview(b)               # a view keeps it alive as well
    held = [b]
    del b
    other, v2 = new_bytes(BIG)
    fill(v2, 4)
    assert other is not held[0] and held[0] == bytes([3]) * BIG and held_view[0] == 3
    # a filling view alone also counts: the buffer is not handed out twice
    again, v3 = new_bytes(BIG)
    assert again is not other


@pytest.mark.timeout(30)
def test_small_buffers_are_not_cached():
    b, view = new_bytes(BIG - 1)
    del view, b
    assert recycler().idle_bytes() == 0 and recycler().allocated == 0


@pytest.mark.timeout(60)
def test_idle_memory_is_bounded():
    held = []
    for i in range(40):
        b, view = new_bytes(BIG * (1 + i % 20))
        held.append(b)
    del held, b, view
    assert 0 < recycler().idle_bytes() <= 128 << 20


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([BIG, BIG + 1, 2 * BIG]), st.booleans()), min_size=1, max_size=30))
def test_property_held_buffers_keep_their_content(ops):
    """Whatever sequence of takes and drops, a buffer the caller still holds
    is never handed out again (its content never changes)."""
    held = []
    for i, (size, keep) in enumerate(ops):
        b, view = new_bytes(size)
        assert all(b is not h for h, _ in held)
        fill(view, i % 251)
        del view
        if keep:
            held.append((b, i % 251))
        del b
        for h, byte in held:
            assert h[0] == byte and h[-1] == byte


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=ROOT, **env))


@pytest.mark.timeout(90)
def test_cache_size_comes_from_the_environment():
    code = ("from fabric._buffers import new_bytes, recycler\n"
            "b, v = new_bytes(1 << 20); del v, b\n"
            "b, v = new_bytes(1 << 20)\n"
            "print(recycler().reused)")
    assert run_python(code, FABRIC_RECV_CACHE="0").stdout.strip() == "0"
    assert run_python(code).stdout.strip() == "1"
    bad = run_python(code, FABRIC_RECV_CACHE="lots")
    assert bad.returncode != 0 and "FABRIC_RECV_CACHE must be a number of bytes" in bad.stderr


# ---- the engine's pool of received-message memory (recv() of large messages)

def _pair(name="tcp"):
    fab = fabric.Fabric(name)
    lst = fab.listen()
    ep = fab.connect(lst.address, timeout=10)
    return fab, ep, lst.accept(timeout=10)


@pytest.mark.timeout(60)
def test_recv_reuses_the_memory_of_large_messages_nobody_holds():
    from fabric.protocol import engine
    fab, ep, peer = _pair()
    try:
        before = engine.recv_pool_stats()["reused"]
        kept = []
        for i in range(6):
            data = bytes([i]) * (4 << 20)
            req = ep.isend(data)
            msg = peer.recv(timeout=10)
            req.wait(timeout=10)
            assert msg == data
            if i % 2 == 0:
                kept.append((i, msg))       # held by the application: never handed out again
            del msg
        assert engine.recv_pool_stats()["reused"] > before
        for i, msg in kept:                 # untouched by the messages that came later
            assert bytes(msg) == bytes([i]) * (4 << 20)
        stats = engine.recv_pool_stats()
        assert stats["bytes"] <= stats["limit"]
    finally:
        fab.close()


@pytest.mark.timeout(60)
def test_recv_pool_respects_fabric_recv_cache_zero():
    import subprocess, sys, os
    code = ("import fabric\nfrom fabric.protocol import engine\n"
            "f = fabric.Fabric('tcp'); l = f.listen(); e = f.connect(l.address); p = l.accept(timeout=10)\n"
            "for i in range(4):\n"
            "    r = e.isend(bytes(2 << 20)); m = p.recv(timeout=10); r.wait(10); del m\n"
            "s = engine.recv_pool_stats(); print(s['reused'], s['bytes'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                         env=dict(os.environ, FABRIC_RECV_CACHE="0"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "0"], out.stdout
