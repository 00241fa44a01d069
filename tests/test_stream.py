"""The byte stream (fabric.stream) on every backend: the transport contract
gRPC relies on."""
import asyncio
import os
import threading
import time

import pytest
from hypothesis import given, settings, HealthCheck, strategies as st

import fabric
from fabric.stream import Stream
from conftest import connect_pair, small_options

CHUNK = small_options()["chunk_size"]


@pytest.fixture
def streams(fab):
    client, server = connect_pair(fab, fabric.Fabric(fab.name, **small_options()))
    a, b = Stream(client), Stream(server)
    yield a, b
    a.close()
    b.close()


def write_in_background(s, data):
    """Large writes complete when the peer has taken the bytes (rendezvous),
    like a socket write larger than its buffers: write from another thread."""
    t = threading.Thread(target=s.write, args=(data,))
    t.start()
    return t


def read_exactly(s, n, timeout=10):
    out = bytearray()
    while len(out) < n:
        chunk = s.read(n - len(out), timeout=timeout)
        assert chunk, "unexpected end of stream"
        out += chunk
    return bytes(out)


@pytest.mark.timeout(60)
def test_bytes_arrive_in_order_and_reads_return_at_least_one_byte(streams):
    a, b = streams
    a.write(b"hello ")
    a.write([b"wor", memoryview(b"ld"), bytearray(b"!")])
    got = b.read(3)
    assert got == b"hel"
    assert read_exactly(b, 9) == b"lo world!"


@pytest.mark.timeout(60)
def test_large_write_lands_in_the_callers_buffer(streams):
    a, b = streams
    data = os.urandom(3 * CHUNK + 17)          # rendezvous, several chunks
    t = write_in_background(a, data)
    buf = bytearray(len(data))
    assert b.read_into(buf) == len(data)
    t.join(10)
    assert buf == data


@pytest.mark.timeout(60)
def test_small_buffer_loses_nothing(streams):
    a, b = streams
    data = os.urandom(CHUNK + 5)
    t = write_in_background(a, data)
    got = bytearray()
    buf = bytearray(1000)
    while len(got) < len(data):
        n = b.read_into(buf)
        assert n >= 1
        got += buf[:n]
    t.join(10)
    assert got == data


@pytest.mark.timeout(60)
def test_half_close_gives_end_of_stream_after_all_data_and_keeps_the_other_direction(streams):
    a, b = streams
    a.write(b"last words")
    a.shutdown_write()
    assert read_exactly(b, 10) == b"last words"
    assert b.read() == b""                     # end of stream: never together with data
    assert b.read() == b""
    assert b.read_into(bytearray(8)) == 0
    with pytest.raises(fabric.ConnectionClosed):
        a.write(b"more")
    b.write(b"reply")                          # the other direction still works
    assert read_exactly(a, 5) == b"reply"


@pytest.mark.timeout(60)
def test_empty_writes_are_not_end_of_stream(streams):
    a, b = streams
    a.write(b"")
    a.write([b"", b""])
    a.write(b"x")
    assert b.read() == b"x"


@pytest.mark.timeout(60)
def test_one_outstanding_read_and_write(streams):
    a, b = streams
    started = threading.Event()
    result = {}

    def reader():
        started.set()
        result["data"] = b.read(timeout=10)

    t = threading.Thread(target=reader)
    t.start()
    started.wait()
    time.sleep(0.1)
    with pytest.raises(fabric.BusyError):
        b.read(timeout=1)
    with pytest.raises(fabric.BusyError):
        b.read_into(bytearray(4), timeout=1)
    a.write(b"ok")
    t.join(10)
    assert result["data"] == b"ok"


@pytest.mark.timeout(60)
def test_close_fails_a_pending_read_promptly(streams):
    a, b = streams
    errors = []

    def reader():
        try:
            b.read(timeout=20)
        except fabric.FabricError as e:
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.2)
    started = time.monotonic()
    b.close()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - started < 5
    assert isinstance(errors[0], (fabric.ConnectionClosed, fabric.ConnectionLost))


@pytest.mark.timeout(60)
def test_peer_close_fails_reads_after_buffered_data(streams):
    a, b = streams
    a.write(b"abc")
    a.close()
    assert read_exactly(b, 3) == b"abc"
    with pytest.raises(fabric.ConnectionLost):
        b.read(timeout=10)


@pytest.mark.timeout(60)
def test_addresses(streams):
    a, b = streams
    assert a.peer_address == b.local_address
    assert a.local_address == b.peer_address


@pytest.mark.timeout(60)
def test_read_timeout_loses_nothing(streams):
    a, b = streams
    with pytest.raises(fabric.Timeout):
        b.read(timeout=0.05)
    a.write(b"late")
    assert b.read() == b"late"


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(writes=st.lists(st.integers(0, 3 * CHUNK), min_size=1, max_size=8),
       reads=st.lists(st.integers(1, 2 * CHUNK), min_size=1, max_size=8))
def test_any_write_and_read_sizes_preserve_the_byte_sequence(streams, writes, reads):
    a, b = streams
    data = [os.urandom(n) for n in writes]
    total = sum(writes)
    t = threading.Thread(target=lambda: [a.write(d) for d in data])
    t.start()
    got = bytearray()
    i = 0
    while len(got) < total:
        want = reads[i % len(reads)]
        i += 1
        if i % 2:
            got += b.read(want, timeout=10)
        else:
            buf = bytearray(want)
            n = b.read_into(buf, timeout=10)
            got += buf[:n]
    t.join(10)
    assert bytes(got) == b"".join(data)


@pytest.mark.timeout(60)
def test_asyncio_forms(backend_name):
    async def main():
        fa = fabric.Fabric(backend_name, **small_options())
        fb = fabric.Fabric(backend_name, **small_options())
        lst = fb.listen_stream("127.0.0.1:0")
        accept = asyncio.ensure_future(lst.aaccept(timeout=10))
        a = await fa.aconnect_stream(lst.address, timeout=10)
        b = await accept
        big = os.urandom(2 * CHUNK + 3)

        async def writer():
            await a.awrite([b"head", big])
            await a.ashutdown_write()

        async def reader():
            buf = bytearray(len(big) + 4)
            got = 0
            while got < len(buf):
                n = await b.aread_into(memoryview(buf)[got:], timeout=10)
                assert n > 0
                got += n
            return bytes(buf)

        _, data = await asyncio.gather(writer(), reader())
        assert data == b"head" + big
        assert await b.aread(timeout=10) == b""
        await b.awrite(b"bye")
        assert await a.aread(timeout=10) == b"bye"
        await a.aclose()
        await b.aclose()
        lst.close()
    asyncio.run(main())


@pytest.mark.timeout(60)
def test_write_nowait_keeps_call_order(streams):
    a, b = streams
    parts = [os.urandom(CHUNK * 2 + 1), b"small", os.urandom(CHUNK + 3), b"tail"]
    reqs = [a.write_nowait(parts[0])]
    a.write(parts[1])
    reqs.append(a.write_nowait(parts[2]))
    a.write(parts[3])
    total = sum(len(p) for p in parts)
    got = read_exactly(b, total)
    for r in reqs:
        r.wait(timeout=10)
    assert got == b"".join(parts)
