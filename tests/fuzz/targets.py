"""Fuzz targets for fabric's decoders (atheris; libFuzzer drives them).

    python tests/fuzz/targets.py TARGET [libFuzzer flags] [CORPUS_DIR ...]

Targets:
  frame      the engine's frame decoder (fabric.protocol.frame.decode, the
             very C code the engine runs) on one fabric message
  tcp        the tcp fabric's byte parser: bytes arrive on a real socket
             at a tcp channel, which must deliver whole messages, answer
             or refuse read requests, or fail the connection with a reason
  handshake  a whole engine endpoint on a tcp channel, fed as the peer
             would after the connection preamble: the HELLO handshake, then
             frames (eager, rendezvous announcements, acknowledgements,
             credits, close)
  auth       the connection preamble and the HMAC authentication of an
             endpoint holding a key (core/auth.pxi), fed as the listener
             would from the first byte
  hpack      fabric.grpc's HPACK decoder (fabric/grpc/_hpack.pyx) on header
             blocks, one after another on one decoder (its table carries over)
  h2         fabric.grpc's HTTP/2 core (fabric/grpc/_h2.pyx) as a server
             (after a client preface) or a client (with a call open), fed the
             input whole and, on a second connection, cut in two: both must
             end the same (the same calls, or the same connection error)

Each input must end with the connection either working or failed with a
fabric error: never a crash, never a Python exception other than the
expected fabric ones, never memory beyond the configured bounds (checked
after every input). tests/test_fuzz.py runs each target briefly with a fixed
seed; tools/fuzz.py runs them for longer with a growing corpus.
"""
from __future__ import annotations

import os
import socket
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if not os.environ.get("PYTHONPATH"):     # tools/fuzz.py points PYTHONPATH at its instrumented copy
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import fabric  # noqa: E402
from fabric.backends import tcp as _tcp  # noqa: E402
from fabric.protocol import frame  # noqa: E402

MAX_RECV = 8192            # the tcp/handshake targets' largest fabric message
OPTIONS = dict(eager_limit=2048, chunk_size=4096, chunks_in_flight=2, coalesce_limit=MAX_RECV,
               credits=4, send_buffers=2, recv_budget=1 << 16, spin_us=0, spin_max_us=0,
               progress_thread=0, handshake_timeout=5, close_linger=0, max_message=1 << 20)


def wire(body: bytes, kind: int = 1, ident: int = 0) -> bytes:
    """The tcp fabric's framing around one fabric message (tcp.pyx)."""
    return struct.pack("<BBHIQ", 0xFA, kind, 0, len(body), ident) + body


# ------------------------------------------------------------------ frame

def fuzz_frame(data: bytes) -> None:
    try:
        frames = frame.decode(data)
    except fabric.ProtocolError:
        return
    # what decodes must re-encode to the same bytes (the decoder is exact)
    pos = 0
    for f in frames:
        size = frame.HEADER_SIZE + len(f["body"])
        assert data[pos:pos + size][:frame.HEADER_SIZE] == frame.encode_header(
            frame.TYPES[f["type"]], f["flags"], len(f["body"]), f["msg_id"], f["aux"], f["credits"])
        pos += size
    assert pos == len(data)


# -------------------------------------------------------------------- tcp

def fuzz_tcp(data: bytes) -> None:
    result = _tcp._fuzz_feed(data, MAX_RECV)
    assert result["failed"], "every input ends with the peer's EOF"
    assert result["recv_bytes"] <= len(data)
    assert result["queued_max"] <= _tcp.MAX_QUEUED_ANSWERS


# -------------------------------------------------------------- handshake

_fabric = None


def _get_fabric():
    global _fabric
    if _fabric is None:
        _fabric = fabric.Fabric("tcp", **OPTIONS)
    return _fabric


# What a listener without a key says first (core/auth.pxi); the fuzzer's bytes follow it.
LISTENER_PREAMBLE = b"FBAU" + bytes([1, 1, 0, 0]) + b"tcp".ljust(8, b"\0") + b"\x5a" * 32
AUTH_KEY = b"fuzzing key, 32 bytes long......"


def _connection(fab, payload: bytes):
    """(endpoint, socket): one end of a socketpair attached to fab as a new
    connection, and the other end, which has sent payload and shut down its
    writing side."""
    ours, theirs = socket.socketpair()
    ep = fab._worker._attach_connected(ours.detach())
    theirs.setblocking(False)
    try:
        theirs.sendall(payload)
    except BlockingIOError:
        pass
    theirs.shutdown(socket.SHUT_WR)
    return ep, theirs


def _drain(sock) -> None:
    """Drop what the engine has answered so far."""
    try:
        while sock.recv(1 << 16):
            pass
    except (BlockingIOError, ConnectionError):
        pass


def fuzz_handshake(data: bytes) -> None:
    """The first byte chooses how the rest is framed: raw at the socket
    (fuzzing both layers) or cut into tcp-framed fabric messages (reaching
    the engine's frame handlers)."""
    fab = _get_fabric()
    if data and data[0] & 1:
        payload = data[1:]
    else:
        # u16 length, then that many bytes, repeated: one fabric message each
        payload = b""
        rest = data[1:]
        while len(rest) >= 2:
            n = int.from_bytes(rest[:2], "little") % (MAX_RECV + 1)
            payload += wire(rest[2:2 + n])
            rest = rest[2 + n:]
    ep, theirs = _connection(fab, LISTENER_PREAMBLE + payload[:1 << 16])
    try:
        for _ in range(64):
            fab.progress()
            _drain(theirs)
            if ep._state() < 0:
                break
            try:
                m = ep.recv(timeout=0)
                assert len(m) <= OPTIONS["max_message"]
            except fabric.Timeout:
                pass
            except fabric.FabricError:
                break
        stats = ep.stats() if not ep.closed else None
        if stats is not None:
            # what a peer may make us hold: recv_budget plus what the
            # credits it was offered can carry, plus bookkeeping
            bound = OPTIONS["recv_budget"] + (OPTIONS["credits"] + 1) * MAX_RECV + (1 << 16)
            assert stats["buffered_bytes"] <= bound, stats
    finally:
        ep.close(linger=0)
        theirs.close()


_keyed = None


def fuzz_auth(data: bytes) -> None:
    """Byte 0 odd: the input follows a well-formed preamble of a listener
    with a key (so MAC checking is reached); even: the input is all the
    listener says. Each input must end refused or failed, never open (the
    fuzzer cannot know the key), with the engine's socket closed."""
    global _keyed
    if _keyed is None:
        _keyed = fabric.Fabric("tcp", auth_key=AUTH_KEY, **OPTIONS)
    payload = data[1:]
    if data and data[0] & 1:
        payload = b"FBAU" + bytes([1, 1, 1, 0]) + b"tcp".ljust(8, b"\0") + b"\x5a" * 32 + payload
    ep, theirs = _connection(_keyed, payload[:1 << 12])
    try:
        for _ in range(16):
            _keyed.progress()
            _drain(theirs)
            if ep._state() < 0:
                break
        assert ep._state() < 0, "an endpoint passed authentication without the key"
    finally:
        ep.close(linger=0)
        theirs.close()


# ------------------------------------------------------------ hpack, h2

def fuzz_hpack(data: bytes) -> None:
    from fabric.grpc import _hpack
    dec = _hpack.Decoder(max_header_list=4096)
    pos = 0
    while pos < len(data):                     # blocks of (1-byte length, bytes)
        n = data[pos]
        block = data[pos + 1:pos + 1 + n]
        pos += 1 + n
        try:
            headers, too_large = dec.decode(block)
        except _hpack.HpackError:
            return
        assert dec.table_size <= 4096
        listed = sum(len(k) + len(v) + 32 for k, v in headers)
        assert listed <= 4096 and (too_large or listed == sum(len(k) + len(v) + 32 for k, v in headers))


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
H2_REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/a/b"), (b":authority", b"x"),
              (b"content-type", b"application/grpc"), (b"te", b"trailers")]


def _h2_connection(client: bool):
    from fabric.grpc import _h2
    core = _h2.Connection(client, initial_window=1 << 16, connection_window=1 << 17, max_frame=1 << 15,
                          max_concurrent=16, max_header_list=2048, max_receive=1 << 14,
                          queued_high_water=1 << 15)
    core.initiate()
    if client:
        core.open_stream(H2_REQUEST)
    core.take_output()
    return core


def _h2_feed(client: bool, pieces) -> tuple:
    """What a connection ends with after the pieces: (error code or None,
    (id, messages, ended, reset, failure kind) of each stream touched)."""
    from fabric.grpc import _h2
    core = _h2_connection(client)
    seen = {}
    try:
        for piece in pieces:
            for s in core.receive(piece):
                seen[s.id] = s
                if s.is_new:
                    core.accepted(s)
                while s.messages:
                    core.consume(s, len(s.take_message()))
            target = core.direct_target()
            assert target is None or len(target) <= 1 << 14
        error = None
    except _h2.H2Error as e:
        error = e.code
        assert core.dead is not None
    out = core.take_output()
    assert out is None or all(len(x) < (1 << 24) for x in out)
    return error, sorted((sid, s.ended, s.reset_code, type(s.failure).__name__) for sid, s in seen.items())


def fuzz_h2(data: bytes) -> None:
    if not data:
        return
    client = bool(data[0] & 1)
    cut = data[1] if len(data) > 1 else 0
    body = data[2:]
    if not client:
        body = H2_PREFACE + body
    whole = _h2_feed(client, [body])
    cut = cut % (len(body) + 1)
    halves = _h2_feed(client, [body[:cut], body[cut:]])
    assert whole[0] == halves[0], (whole, halves)
    if whole[0] is None:
        assert whole[1] == halves[1], (whole, halves)


TARGETS = {"frame": fuzz_frame, "tcp": fuzz_tcp, "handshake": fuzz_handshake, "auth": fuzz_auth,
           "hpack": fuzz_hpack, "h2": fuzz_h2}


def seeds(target: str) -> list[bytes]:
    """Valid inputs to start from (the fuzzer mutates them)."""
    hello = frame.encode_hello(MAX_RECV, 4, 1 << 20)
    eager = frame.encode_eager(1, b"hello fabric")
    rndv = frame.encode_rndv(2, 0, 5000, 0, 0x1000, 4096, b"\x01" * 8)
    done = frame.encode_header(frame.TYPES["CHUNK_DONE"], 0, 0, 1, 0, 1)
    credit = frame.encode_header(frame.TYPES["CREDIT"], 0, 0, 0, 0, 3)
    close = frame.encode_header(frame.TYPES["CLOSE"], 0, 0, 0, 0, 0)
    if target == "frame":
        return [hello, eager, rndv, done, credit, close, eager + rndv + credit]
    if target == "tcp":
        req = struct.pack("<QQQ", 0x1000, 64, 0x1234)
        return [wire(eager), wire(hello) + wire(eager + credit), wire(req, kind=2, ident=1),
                wire(b"\x00" * 4, kind=4, ident=1), wire(b"x" * 64, kind=3, ident=1)]
    if target == "hpack":
        import hpack
        blocks = [hpack.Encoder().encode(H2_REQUEST), hpack.Encoder().encode(H2_REQUEST, huffman=True),
                  b"\x3f\xe1\x1f\x82", b"\x40\x03abc\x03def\xbe"]
        return [bytes([len(b)]) + b for b in blocks if len(b) < 256] + \
            [b"".join(bytes([len(b)]) + b for b in blocks if len(b) < 256)]
    if target == "h2":
        def fr(t, f, sid, payload=b""):
            return struct.pack(">BHBBI", len(payload) >> 16, len(payload) & 0xFFFF, t, f, sid) + payload
        settings = fr(4, 0, 0)
        import hpack
        block = hpack.Encoder().encode(H2_REQUEST)
        msg = b"\x00\x00\x00\x00\x03abc"
        server = settings + fr(1, 4, 1, block) + fr(0, 1, 1, msg)
        client = settings + fr(1, 4, 1, b"\x88") + fr(0, 0, 1, msg) + fr(1, 5, 1, b"\x40\x0bgrpc-status\x010")
        return [b"\x00\x10" + server, b"\x01\x05" + client, b"\x00\x00" + settings + fr(6, 0, 0, b"12345678"),
                b"\x01\x00" + settings + fr(7, 0, 0, b"\x00\x00\x00\x01\x00\x00\x00\x00bye"),
                b"\x00\x03" + settings + fr(1, 0, 1, block[:3]) + fr(9, 4, 1, block[3:]) + fr(8, 0, 0, b"\x00\x00\x10\x00")]
    if target == "auth":
        return [b"\x01" + bytes(32), b"\x01" + b"\x00" * 40, b"\x00" + LISTENER_PREAMBLE,
                b"\x00FBAU\x02", b"\x00" + LISTENER_PREAMBLE[:5] + b"\x00" + LISTENER_PREAMBLE[6:]]
    # handshake: byte 0 even = tcp-framed fabric messages, each a u16 length and its bytes
    def framed(*messages):
        return b"\x00" + b"".join(len(m).to_bytes(2, "little") + m for m in messages)
    return [b"\x01" + wire(hello) + wire(eager), framed(hello), framed(hello, eager),
            framed(hello, rndv), framed(hello, eager + credit + close)]


def main(argv):
    import atheris
    if len(argv) < 2 or argv[1] not in TARGETS:
        sys.exit(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [libFuzzer flags] [corpus dirs]")
    target = TARGETS[argv[1]]
    args = [argv[0]] + argv[2:]
    for d in [a for a in args[1:] if not a.startswith("-")]:
        os.makedirs(d, exist_ok=True)
        for i, s in enumerate(seeds(argv[1])):
            path = os.path.join(d, f"seed-{i}")
            if not os.path.exists(path):
                with open(path, "wb") as f:
                    f.write(s)
    atheris.Setup(args, target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
