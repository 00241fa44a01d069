"""gRPC wire rules of fabric.grpc: message framing (hypothesis: any split of
the byte stream), grpc-timeout, metadata and status text encodings, targets."""
import os

import pytest
from hypothesis import given, settings, strategies as st

grpc = pytest.importorskip("grpc")
pytest.importorskip("h2")

from fabric.grpc import _transport, _wire  # noqa: E402


def framed(messages):
    return b"".join(_wire.prefix(len(m)) + m for m in messages)


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(st.binary(max_size=300), max_size=8), cuts=st.lists(st.integers(0, 3000), max_size=12))
def test_messages_survive_any_split(messages, cuts):
    data = framed(messages)
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    asm = _wire.MessageAssembler(1 << 20)
    out = []
    for a, b in zip(points, points[1:]):
        out += [bytes(m) for m in asm.feed(data[a:b])]
    assert out == messages
    assert not asm.partial


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(st.tuples(st.binary(max_size=3000), st.booleans()), max_size=6),
       encoding=st.sampled_from(["gzip", "deflate"]), cuts=st.lists(st.integers(0, 30000), max_size=12),
       limit=st.integers(0, 4000))
def test_compressed_messages_survive_any_split_and_the_limit_is_on_inflated_sizes(messages, encoding,
                                                                                   cuts, limit):
    data = b"".join(_wire.prefix(len(p), True) + p if packed else _wire.prefix(len(m)) + m
                    for m, packed in messages for p in [_wire.compress(m, encoding)] if m or not packed)
    sent = [m for m, packed in messages if m or not packed]
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    asm = _wire.MessageAssembler(limit)
    asm.encoding = encoding
    out = []
    try:
        for a, b in zip(points, points[1:]):
            out += [bytes(m) for m in asm.feed(data[a:b])]
    except _wire.WireError as e:
        assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert any(len(m) > limit for m in sent), "refused a message within the limit"
        assert out == sent[:len(out)]
        return
    assert out == sent and all(len(m) <= limit for m in sent)


@pytest.mark.parametrize("limit,size,ok", [(10, 10, True), (10, 11, False), (0, 0, True), (0, 1, False),
                                           (-1, 1 << 20, True)])
def test_receive_limit_is_enforced_before_buffering(limit, size, ok):
    asm = _wire.MessageAssembler(limit)
    header = _wire.prefix(size)
    if ok:
        assert [bytes(m) for m in asm.feed(header + bytes(size))] == [bytes(size)]
    else:
        with pytest.raises(_wire.WireError) as exc:
            asm.feed(header)                     # refused from the prefix alone
        assert exc.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_compressed_messages_need_an_encoding_and_bad_flags_are_refused():
    # the compressed flag without a grpc-encoding: a protocol error
    with pytest.raises(_wire.WireError) as exc:
        _wire.MessageAssembler(100).feed(b"\x01\x00\x00\x00\x01x")
    assert exc.value.code == grpc.StatusCode.INTERNAL
    # an encoding we do not know
    asm = _wire.MessageAssembler(100)
    asm.encoding = "snappy"
    with pytest.raises(_wire.WireError) as exc:
        asm.feed(b"\x01\x00\x00\x00\x01x")
    assert exc.value.code == grpc.StatusCode.UNIMPLEMENTED
    # gzip, deflate: inflated, in pieces too
    for name in ("gzip", "deflate"):
        packed = _wire.compress(b"hello" * 10, name)
        asm = _wire.MessageAssembler(100)
        asm.encoding = name
        framed_msg = _wire.prefix(len(packed), True) + packed
        out = []
        for i in range(len(framed_msg)):
            out += asm.feed(framed_msg[i:i + 1])
        assert [bytes(m) for m in out] == [b"hello" * 10]
    with pytest.raises(_wire.WireError) as exc:
        _wire.MessageAssembler(100).feed(b"\x07\x00\x00\x00\x01x")
    assert exc.value.code == grpc.StatusCode.INTERNAL


def test_whole_messages_are_not_copied():
    data = framed([b"abc" * 1000])
    out = _wire.MessageAssembler(1 << 20).feed(memoryview(data))
    assert isinstance(out[0], memoryview) and out[0].obj is data


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0, max_value=1e9, allow_nan=False))
def test_timeout_encoding_never_shortens_and_fits_8_digits(seconds):
    value = _wire.encode_timeout(seconds)
    assert 2 <= len(value) <= 9 and value[:-1].isdigit()
    decoded = _wire.decode_timeout(value)
    assert decoded >= seconds - 1e-12 or seconds > 99999999 * 3600
    if seconds > 1e-6:
        assert decoded <= seconds * 1.0001 + 1e-9 or decoded - seconds < 3600


@pytest.mark.parametrize("bad", [b"", b"1", b"S", b"123456789S", b"12x", b"1.5S", b"-1S"])
def test_malformed_timeouts(bad):
    with pytest.raises(_wire.WireError):
        _wire.decode_timeout(bad)


def test_metadata_round_trip_and_binary_values():
    md = [("key", "value"), ("x-bin", b"\x00\xff\x10"), ("empty-bin", b""), ("k2", b"bytes-ok")]
    headers = _wire.metadata_to_headers(md)
    assert (b"x-bin", b"AP8Q") in headers             # base64 without padding
    back = _wire.headers_to_metadata(headers + [(b":status", b"200"), (b"content-type", b"application/grpc")])
    assert back == (("key", "value"), ("x-bin", b"\x00\xff\x10"), ("empty-bin", b""), ("k2", "bytes-ok"))


@pytest.mark.parametrize("md", [[("grpc-status", "0")], [(":path", "/x")], [("Upper", "x")], [("sp ace", "x")],
                                [("k", "new\nline")], [("content-type", "text/plain")]])
def test_bad_metadata_is_refused(md):
    with pytest.raises(ValueError):
        _wire.metadata_to_headers(md)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_status_message_encoding_round_trips(text):
    encoded = _wire.encode_message_text(text)
    assert all(0x20 <= c <= 0x7E for c in encoded)
    assert _wire.decode_message_text(encoded) == text


def test_status_from_trailers():
    assert _wire.status_of({b"grpc-status": b"5", b"grpc-message": b"not%20here"}) == \
        (grpc.StatusCode.NOT_FOUND, "not here")
    assert _wire.status_of({})[0] == grpc.StatusCode.UNKNOWN
    assert _wire.status_of({b"grpc-status": b"x"})[0] == grpc.StatusCode.UNKNOWN
    assert _wire.status_from_http(404) == grpc.StatusCode.UNIMPLEMENTED
    assert _wire.status_from_http(503) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("target,expected", [
    ("127.0.0.1:50051", (None, "127.0.0.1", 50051)),
    ("dns:localhost:1", (None, "localhost", 1)),
    ("ipv6:[::1]:2", (None, "::1", 2)),
    ("fabric+ucx://h:3", ("ucx", "h", 3)),
    ("fabric+tcp://[::1]:4/", ("tcp", "::1", 4)),
    ("fabric://h:5", ("", "h", 5)),
])
def test_targets(target, expected):
    assert _transport.parse_target(target) == expected


def test_cheap_frame_reprs_print_what_hyperframe_printed():
    """fabric.grpc's connections get DATA frames whose repr reads 10 bytes
    instead of hex-encoding the whole payload (h2 builds it for every
    received frame); the strings must not change, and hyperframe's own
    classes (every other h2 user in the process) are left alone."""
    import binascii
    import h2.config
    import h2.connection
    from hyperframe import frame as hf
    from fabric.grpc import _h2_fast

    def original(f):
        body = f.serialize_body()
        if not body:
            return "None"
        r = binascii.hexlify(body).decode("ascii")
        return "<hex:" + (r[:20] + "..." if len(r) > 20 else r) + ">"

    pristine = hf.DataFrame._body_repr
    assert pristine.__module__ == "hyperframe.frame" and hf._raw_data_repr.__module__ == "hyperframe.frame"
    for n in (0, 1, 9, 10, 11, 100, 70000):
        for pad in (None, 0, 3, 200):
            f = hf.DataFrame(1, data=os.urandom(n))
            if pad is not None:
                f.flags.add("PADDED")
                f.pad_length = pad
            assert _h2_fast.cheap_data_repr(f) == original(f) == f._body_repr()
    # the frames of a fabric connection's buffer: same repr, cheap class
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    _h2_fast.install_cheap_frame_buffer(conn)
    frame = hf.DataFrame(1, data=b"x" * 5000)
    conn.incoming_buffer.max_frame_size = 16384
    conn.incoming_buffer.add_data(frame.serialize())
    received = next(iter(conn.incoming_buffer))
    assert type(received) is not hf.DataFrame and isinstance(received, hf.DataFrame)
    assert repr(received) == repr(frame) and received.data == frame.data


# -- remembered HPACK work (fabric.grpc._h2_fast.MemoHpack)

HEADER_SETS = [
    [(b":method", b"POST"), (b":path", b"/svc/Echo"), (b"content-type", b"application/grpc")],
    [(b":status", b"200"), (b"content-type", b"application/grpc")],
    [(b"grpc-status", b"0")],
    [(b"grpc-status", b"5"), (b"grpc-message", b"not found")],
    [(b"x-big", b"v" * 3000)],                   # evicts entries from a small table
    [(b":path", b"/svc/Other"), (b"grpc-timeout", b"100m")],
]


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from([None, None, None, 0, 256, 4096]),
                                st.integers(0, len(HEADER_SETS) - 1)),
                      min_size=1, max_size=40))
def test_memoized_hpack_produces_what_hpack_produces(steps):
    """Whatever the sequence of header blocks and table size changes, the
    memoizing encoder emits hpack's exact bytes and the memoizing decoder
    returns hpack's exact headers (dynamic-table state included). (A block
    follows every size change: hpack itself signals only the last of two
    changes made between blocks, which desynchronizes a decoder when the
    first one shrank the table.)"""
    import hpack
    from fabric.grpc._h2_fast import MemoHpack as _MemoHpack
    plain_enc, memo_enc = hpack.Encoder(), _MemoHpack(hpack.Encoder(), "encode")
    plain_dec, memo_dec = hpack.Decoder(), _MemoHpack(hpack.Decoder(), "decode")
    for resize, index in steps:
        if resize is not None:
            plain_enc.header_table_size = memo_enc.header_table_size = resize
            plain_dec.max_allowed_table_size = memo_dec.max_allowed_table_size = 4096
        headers = list(HEADER_SETS[index])
        block = plain_enc.encode(list(headers))
        assert memo_enc.encode(list(headers)) == block
        expected = plain_dec.decode(block, raw=True)
        assert memo_dec.decode(block, raw=True) == expected == headers
        assert list(memo_dec.header_table.dynamic_entries) == list(plain_dec.header_table.dynamic_entries)


def test_memoized_hpack_reuses_repeated_blocks_and_passes_sensitive_ones_through():
    import hpack
    from fabric.grpc._h2_fast import MemoHpack as _MemoHpack
    enc = _MemoHpack(hpack.Encoder(), "encode")
    first = enc.encode(list(HEADER_SETS[0]))          # adds to the table
    second = enc.encode(list(HEADER_SETS[0]))         # indexed: leaves the table alone
    assert first != second and enc.encode(list(HEADER_SETS[0])) is second
    secret = [hpack.NeverIndexedHeaderTuple(b"authorization", b"token")]
    assert enc.encode(secret) == hpack.Encoder().encode(secret)   # never memoized, never indexed


@pytest.mark.timeout(30)
def test_socket_stream_reads_with_a_timeout_and_into_buffers():
    """A plain TCP byte stream: a timed read that finds nothing raises
    fabric's Timeout and loses nothing; read_into fills a caller's buffer."""
    import socket

    from fabric import errors
    listener = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(listener.getsockname())
    b, _ = listener.accept()
    listener.close()
    stream = _transport.SocketStream(a)
    with pytest.raises(errors.Timeout):
        stream.read_message(timeout=0.05)
    b.sendall(b"hello")
    assert stream.read_message(timeout=5) == b"hello"
    b.sendall(b"world")
    buf = bytearray(16)
    assert stream.read_into(memoryview(buf)) == 5 and bytes(buf[:5]) == b"world"
    b.close()
    assert stream.read_message(timeout=5) is None and stream.read_into(bytearray(4)) == 0
    stream.close()


def test_cheap_frame_buffer_stays_out_without_the_h2_internals_it_needs():
    import h2.config
    import h2.connection
    from h2.frame_buffer import FrameBuffer
    from fabric.grpc import _h2_fast
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    del conn._frame_dispatch_table            # as if another h2 had no such table
    _h2_fast.install_cheap_frame_buffer(conn)
    assert type(conn.incoming_buffer) is FrameBuffer
