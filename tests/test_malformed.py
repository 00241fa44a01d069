"""Hostile and broken peers, at the TCP fabric's wire level: bad input closes
that connection with a fabric error; the listener and other connections keep
working; memory is readable only while it is offered, and only in range."""
import os
import socket
import struct
import threading
import time

import pytest

import fabric
from fabric.protocol import frame
from conftest import small_options

MSG, READ_REQ, READ_RESP, READ_ERR = 1, 2, 3, 4


def wire(kind, body=b"", ident=0, length=None):
    return struct.pack("<BBHIQ", 0xFA, kind, 0, len(body) if length is None else length, ident) + body


class RawPeer:
    """Speaks the TCP fabric framing by hand."""

    def __init__(self, address):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buf = b""
        # the connection preamble, without a key (fabric/protocol/core/auth.pxi)
        self.sock.sendall(b"FBAU" + bytes([1, 0, 0, 0]) + b"tcp".ljust(8, b"\0") + os.urandom(32))
        assert self.read_exact(48)[:4] == b"FBAU"

    def read_exact(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("closed")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_wire(self):
        magic, kind, _, length, ident = struct.unpack("<BBHIQ", self.read_exact(16))
        assert magic == 0xFA
        return kind, ident, self.read_exact(length)

    def handshake(self):
        kind, _, body = self.read_wire()
        assert kind == MSG and frame.decode(body)[0]["type"] == "HELLO"
        self.sock.sendall(wire(MSG, frame.encode_hello(70000, 8, 1 << 30)))

    def closed_by_peer(self, timeout=10):
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True

    def close(self):
        self.sock.close()


def raw_peer_and_its_endpoint(lst, accepted):
    """A RawPeer through its HELLO, and the endpoint the listener made for it."""
    raw = RawPeer(lst.address)
    raw.handshake()
    deadline = time.monotonic() + 10
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    return raw, accepted[0]


@pytest.fixture
def served():
    """A listener whose accept loop runs in a thread, collecting endpoints."""
    fab = fabric.Fabric("tcp", **small_options(handshake_timeout=2.0))
    lst = fab.listen("127.0.0.1:0")
    accepted = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            try:
                accepted.append(lst.accept(timeout=0.2))
            except fabric.Timeout:
                pass
            except fabric.ConnectionClosed:
                return

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield fab, lst, accepted
    stop.set()
    t.join(5)
    for ep in accepted:
        ep.close(linger=0)
    lst.close()


def assert_listener_works(fab, lst, accepted):
    n = len(accepted)
    client = fabric.Fabric("tcp", **small_options()).connect(lst.address, timeout=10)
    deadline = time.monotonic() + 10
    while len(accepted) == n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(accepted) > n, "listener stopped accepting"
    client.send(b"ping")
    assert accepted[-1].recv(timeout=10) == b"ping"
    client.close(linger=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("garbage", [
    os.urandom(4096),
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    wire(MSG, length=1 << 30),                        # oversized fabric message
    wire(MSG, b"\x00" * 64),                          # not a frame
    wire(7, b""),                                     # unknown TCP fabric kind
    wire(MSG, frame.encode_eager(1, b"early")),       # data before HELLO
])
def test_garbage_never_reaches_accept_and_listener_survives(served, garbage):
    fab, lst, accepted = served
    raw = RawPeer(lst.address)
    raw.sock.sendall(garbage)
    assert raw.closed_by_peer()
    raw.close()
    assert accepted == []
    assert_listener_works(fab, lst, accepted)


@pytest.mark.timeout(60)
def test_silent_client_is_dropped_after_handshake_timeout(served):
    fab, lst, accepted = served
    raw = RawPeer(lst.address)
    started = time.monotonic()
    assert raw.closed_by_peer(timeout=15)
    assert time.monotonic() - started < 10
    raw.close()
    assert_listener_works(fab, lst, accepted)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [
    wire(MSG, frame.encode_eager(5, b"out of sequence")),
    wire(MSG, frame.encode_rndv(1, 3, 100, 0, 0, 10, b"k" * 8)),    # chunk of unknown message
    wire(MSG, frame.encode_header(frame.TYPES["CHUNK_DONE"], 0, 0, 9)),  # ack of nothing
    wire(MSG, frame.encode_hello(70000, 8, 1)),                         # second HELLO
    wire(MSG, frame.encode_rndv(1, 0, 1 << 50, 0, 0, 10, b"k" * 8)),    # above max_message
    wire(READ_RESP, b"x" * 10, ident=77),                               # answer to no request
    wire(MSG, b"\xfb\x01\x02\x00" + b"\xff" * 20),                     # frame longer than message
    wire(MSG, frame.encode_header(frame.TYPES["PONG"], 0, 0, 12345)),    # answer to no PING
    wire(MSG, frame.encode_header(frame.TYPES["PING"], 0, 0, 1) * 65),   # more PINGs than answered
])
def test_protocol_violation_closes_only_that_connection(served, bad):
    fab, lst, accepted = served
    raw, ep = raw_peer_and_its_endpoint(lst, accepted)
    raw.sock.sendall(bad)
    with pytest.raises((fabric.ProtocolError, fabric.ConnectionLost)):
        ep.recv(timeout=10)
    assert ep.closed
    raw.close()
    assert_listener_works(fab, lst, accepted)


@pytest.mark.timeout(60)
def test_an_eager_message_above_max_message_closes_that_connection():
    fab = fabric.Fabric("tcp", **small_options(max_message=1000))
    lst = fab.listen("127.0.0.1:0")
    try:
        raw = RawPeer(lst.address)
        raw.handshake()
        ep = lst.accept(timeout=10)
        raw.sock.sendall(wire(MSG, frame.encode_eager(1, b"x" * 2000)))   # below eager_limit, above max_message
        with pytest.raises(fabric.ProtocolError, match="larger than max_message"):
            ep.recv(timeout=10)
        raw.close()
        other = fab.connect(lst.address, timeout=10)      # the listener still works
        peer = lst.accept(timeout=10)
        other.send(b"y" * 1000)
        assert peer.recv(timeout=10) == b"y" * 1000
    finally:
        fab.close()


@pytest.mark.timeout(60)
def test_forged_or_stale_keys_and_out_of_range_reads_are_refused(served):
    fab, lst, accepted = served
    raw, ep = raw_peer_and_its_endpoint(lst, accepted)
    secret = os.urandom(100_000)
    req = ep.isend(secret)            # above eager_limit: announced by RNDV frames
    frames = []
    while not frames or frames[-1]["type"] != "RNDV":
        kind, _, body = raw.read_wire()
        assert kind == MSG
        frames += [f for f in frame.decode(body) if f["type"] == "RNDV"]
    chunk = frames[0]
    key = chunk["rkey"]
    raddr, length = chunk["raddr"], chunk["length"]

    def read(addr, n, k, ident):
        raw.sock.sendall(wire(READ_REQ, struct.pack("<QQ", addr, n) + k, ident=ident))
        while True:
            kind, got_ident, body = raw.read_wire()
            if kind in (READ_RESP, READ_ERR) and got_ident == ident:
                return kind, body

    assert read(raddr, length, key, 1) == (READ_RESP, secret[:length])      # offered: readable
    assert read(raddr, length + 1, key, 2)[0] == READ_ERR                   # past the region
    assert read(raddr - 8, 16, key, 3)[0] == READ_ERR                       # before the region
    forged = bytes([key[0] ^ 1]) + key[1:]
    assert read(raddr, 16, forged, 4)[0] == READ_ERR                        # not its key
    assert read(raddr + length, 16, key, 5)[0] == READ_ERR                  # next chunk, this key
    # release the chunk: its key must stop working at once
    raw.sock.sendall(wire(MSG, frame.encode_header(frame.TYPES["CHUNK_DONE"], 0, 0, chunk["msg_id"], 0, 0)))
    time.sleep(0.2)
    assert read(raddr, 16, key, 6)[0] == READ_ERR
    raw.close()
    with pytest.raises(fabric.ConnectionLost):
        req.wait(timeout=10)
    assert_listener_works(fab, lst, accepted)


@pytest.mark.timeout(60)
def test_answers_queued_when_a_chunk_is_released_never_send_reused_memory(served):
    """A peer asks for a chunk many times without reading the answers (our
    socket fills, answers queue up), then releases it: the message completes
    and the application reuses its buffer. The answers still queued must
    carry the chunk as it was offered, never what the memory holds later."""
    fab, lst, accepted = served
    raw, ep = raw_peer_and_its_endpoint(lst, accepted)
    buf = bytearray(os.urandom(12000))             # above eager_limit, one chunk
    offered = bytes(buf)
    req = ep.isend(buf)
    chunk = None
    while chunk is None:
        kind, _, body = raw.read_wire()
        assert kind == MSG
        chunk = next((f for f in frame.decode(body) if f["type"] == "RNDV"), None)
    asks = 2000                                    # 24 MB of answers: more than both sockets hold
    request = b"".join(wire(READ_REQ, struct.pack("<QQ", chunk["raddr"], chunk["length"]) + chunk["rkey"],
                            ident=i + 1) for i in range(asks))
    raw.sock.sendall(request)
    time.sleep(0.5)                                # the sender queues what its socket cannot take
    raw.sock.sendall(wire(MSG, frame.encode_header(frame.TYPES["CHUNK_DONE"], 0, 0, chunk["msg_id"], 0, 0)))
    req.wait(timeout=10)
    buf[:] = b"X" * len(buf)                       # the application reuses its buffer
    answers = 0
    raw.sock.settimeout(10)
    while answers < asks:
        kind, ident, body = raw.read_wire()
        if kind == READ_RESP:
            assert body == offered[:chunk["length"]], f"answer {ident} carried memory reused after release"
            answers += 1
    raw.close()
    assert_listener_works(fab, lst, accepted)


@pytest.mark.timeout(60)
def test_a_peer_ignoring_flow_control_is_cut_off(served):
    """Every fabric message costs the sender a credit the receiver offered:
    a peer sending past its credits (here 100 messages against 8, none
    returned) would make the receiver buffer without bound; it is cut off."""
    fab, lst, accepted = served
    raw, ep = raw_peer_and_its_endpoint(lst, accepted)
    raw.sock.sendall(b"".join(wire(MSG, frame.encode_eager(i + 1, b"m" * 1000)) for i in range(100)))
    got = 0
    with pytest.raises(fabric.ProtocolError, match="credits"):
        for _ in range(100):
            ep.recv(timeout=10)
            got += 1
    assert got <= small_options()["credits"]
    raw.close()
    assert_listener_works(fab, lst, accepted)


@pytest.mark.timeout(60)
def test_a_rendezvous_send_completes_at_its_last_byte_written_not_at_the_acknowledgement(served):
    """tcp serves the peer's reads itself (FAB_CAP_READS_SERVED): a send is
    complete once every byte of it was written, as sendall would be, without
    the peer's CHUNK_DONE; not one byte earlier; and from then on nothing of
    that memory can be read again (the application may reuse it)."""
    fab, lst, accepted = served
    raw, ep = raw_peer_and_its_endpoint(lst, accepted)
    payload = os.urandom(40_000)                   # three chunks of 16 KiB at most
    req = ep.isend(payload)
    chunks = {}
    while len(chunks) < 3:
        kind, _, body = raw.read_wire()
        assert kind == MSG
        chunks.update((f["aux"], f) for f in frame.decode(body) if f["type"] == "RNDV")
    ident = 0

    def read(chunk, offset, n):
        nonlocal ident
        ident += 1
        raw.sock.sendall(wire(READ_REQ, struct.pack("<QQ", chunk["raddr"] + offset, n) + chunk["rkey"],
                              ident=ident))
        while True:
            kind, got, body = raw.read_wire()
            if kind in (READ_RESP, READ_ERR) and got == ident:
                return kind, body

    got = b""
    for index in range(3):
        c = chunks[index]
        half = c["length"] // 2
        got += read(c, 0, half)[1]
        if index == 2:
            with pytest.raises(fabric.Timeout):  # one half of the last chunk is still unwritten
                req.wait(timeout=0.5)
        got += read(c, half, c["length"] - half)[1]
    assert got == payload
    req.wait(timeout=10)                          # no CHUNK_DONE was sent
    assert ep.stats()["rendezvous_done_early"] == 1
    for index in range(3):                        # every chunk's key is dead now
        assert read(chunks[index], 0, 16)[0] == READ_ERR
    for index in range(3):                        # the acknowledgements, late, are still in order
        raw.sock.sendall(wire(MSG, frame.encode_header(frame.TYPES["CHUNK_DONE"], 0, 0,
                                                       chunks[index]["msg_id"], index, 0)))
    ep.send(b"after")
    seen = b""
    while b"after" not in seen:
        kind, _, body = raw.read_wire()
        seen += body
    raw.close()
    assert_listener_works(fab, lst, accepted)


@pytest.mark.timeout(60)
def test_a_slot_registered_again_never_reuses_a_key(served):
    """Chunk after chunk through the same registration slot: each gets a key
    of its own, and the previous key reads nothing (a key once repeated for
    every other registration of a slot)."""
    fab, lst, accepted = served
    raw, ep = raw_peer_and_its_endpoint(lst, accepted)
    keys = []
    for i in range(6):
        req = ep.isend(bytes([i]) * 10_000)
        chunk = None
        consumed = 0            # frames of ours the engine spent credits on, returned below
        while chunk is None:
            kind, _, body = raw.read_wire()
            frames = frame.decode(body)
            consumed += len(frames)
            chunk = next((f for f in frames if f["type"] == "RNDV"), None)
        if keys:
            raw.sock.sendall(wire(READ_REQ, struct.pack("<QQ", chunk["raddr"], 16) + keys[-1], ident=100 + i))
            kind, ident, body = raw.read_wire()
            assert (kind, ident) == (READ_ERR, 100 + i), "the previous chunk's key read the new chunk"
        raw.sock.sendall(wire(READ_REQ, struct.pack("<QQ", chunk["raddr"], chunk["length"]) + chunk["rkey"],
                              ident=i + 1))
        kind, ident, body = raw.read_wire()
        assert (kind, ident, body) == (READ_RESP, i + 1, bytes([i]) * 10_000)
        req.wait(timeout=10)
        # the credits too: a peer that never returns them stalls the sender at its reserve
        raw.sock.sendall(wire(MSG, frame.encode_header(frame.TYPES["CHUNK_DONE"], 0, 0, chunk["msg_id"], 0,
                                                       consumed)))
        keys.append(chunk["rkey"])
    assert len(set(keys)) == len(keys)
    raw.close()
    assert_listener_works(fab, lst, accepted)


WRITE = 5


def posting_peer_and_a_waiting_receive(lst, accepted, size):
    """A RawPeer that says it writes into posts, the endpoint made for it,
    that endpoint's recv_into waiting on the middle of a guarded buffer,
    and the POST it sent."""
    raw = RawPeer(lst.address)
    kind, _, body = raw.read_wire()
    assert kind == MSG and frame.decode(body)[0]["features"] & 1      # the victim can be written to
    raw.sock.sendall(wire(MSG, frame.encode_hello(70000, 8, 1 << 30, 0, 0, 1)))
    deadline = time.monotonic() + 10
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    ep = accepted[-1]
    whole = bytearray(b"\xcc" * (4096 + size + 4096))
    view = memoryview(whole)[4096:4096 + size]
    result = {}

    def receive():
        try:
            result["n"] = ep.recv_into(view, timeout=10)
        except fabric.FabricError as e:
            result["error"] = e

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    post = None
    while post is None:
        kind, _, body = raw.read_wire()
        if kind == MSG:
            post = next((f for f in frame.decode(body) if f["type"] == "POST" and not f["flags"]), None)
    assert post["cap"] == size
    return raw, ep, whole, view, t, result, post


def write(raw, post, offset, payload, key=None):
    key = int.from_bytes(post["rkey"][:8], "little") if key is None else key
    raw.sock.sendall(wire(WRITE, struct.pack("<Q", post["raddr"] + offset) + payload, ident=key))


@pytest.mark.timeout(60)
def test_a_write_into_the_posted_buffer_and_its_put_complete_the_receive(served):
    fab, lst, accepted = served
    raw, ep, whole, view, t, result, post = posting_peer_and_a_waiting_receive(lst, accepted, 64 << 10)
    data = os.urandom(50_000)
    write(raw, post, 0, data[:30_000])
    write(raw, post, 30_000, data[30_000:])
    raw.sock.sendall(wire(MSG, frame.encode_put(post["msg_id"], len(data))))
    t.join(10)
    assert result == {"n": len(data)}
    assert view[:len(data)] == data and whole[:4096] == whole[-4096:] == b"\xcc" * 4096
    assert ep.stats()["registered_regions"] == 0
    raw.close()
    assert_listener_works(fab, lst, accepted)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["forged_key", "past_the_end", "before_the_start", "into_a_read_region",
                                 "after_the_put", "put_larger_than_posted", "put_without_post"])
def test_writes_land_only_inside_what_was_posted(served, how):
    """Every write outside the posted buffer (another key, across its ends,
    into a region offered for reading, after the message completed) and
    every PUT that does not match the post closes that connection with a
    fabric error; no byte lands outside the buffer."""
    fab, lst, accepted = served
    size = 16 << 10
    raw, ep, whole, view, t, result, post = posting_peer_and_a_waiting_receive(lst, accepted, size)
    key = int.from_bytes(post["rkey"][:8], "little")
    if how == "forged_key":
        write(raw, post, 0, b"x" * 64, key=key ^ (1 << 40))
    elif how == "past_the_end":
        write(raw, post, size - 8, b"x" * 16)
    elif how == "before_the_start":
        write(raw, post, -8, b"x" * 16)
    elif how == "into_a_read_region":
        ep.isend(os.urandom(100_000))           # announced by RNDV: a region the peer may read
        chunk = None
        while chunk is None:
            kind, _, body = raw.read_wire()
            if kind == MSG:
                chunk = next((f for f in frame.decode(body) if f["type"] == "RNDV"), None)
        raw.sock.sendall(wire(WRITE, struct.pack("<Q", chunk["raddr"]) + b"x" * 16,
                              ident=int.from_bytes(chunk["rkey"][:8], "little")))
    elif how == "after_the_put":
        write(raw, post, 0, b"a" * 5000)
        raw.sock.sendall(wire(MSG, frame.encode_put(post["msg_id"], 5000)))
        t.join(10)
        assert result == {"n": 5000}
        write(raw, post, 0, b"b" * 5000)        # the buffer is the application's again
    elif how == "put_larger_than_posted":
        raw.sock.sendall(wire(MSG, frame.encode_put(post["msg_id"], size + 1)))
    elif how == "put_without_post":
        raw.sock.sendall(wire(MSG, frame.encode_put(post["msg_id"] + 1, 100)))
    with pytest.raises((fabric.ProtocolError, fabric.ConnectionLost)):
        t.join(10)
        if "error" in result:
            raise result["error"]
        ep.recv(timeout=10)
    assert whole[:4096] == whole[-4096:] == b"\xcc" * 4096, "a write landed outside the posted buffer"
    if how == "after_the_put":
        assert view[:5000] == b"a" * 5000
    elif how != "into_a_read_region":
        assert view == b"\xcc" * size
    assert raw.closed_by_peer()
    raw.close()
    assert_listener_works(fab, lst, accepted)
