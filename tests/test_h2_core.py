"""fabric.grpc's HTTP/2 core (fabric/grpc/_hpack.pyx, _h2.pyx) against
independent implementations: the hpack and h2 packages as the peers and
the reference (hypothesis walks header sequences, table size changes and
every split of the byte stream), and frames built here by hand for every
protocol error RFC 9113 names (each closes the connection with GOAWAY and
the code it says, or resets just that stream)."""
import struct
import zlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

grpc = pytest.importorskip("grpc")
hpack = pytest.importorskip("hpack")
h2 = pytest.importorskip("h2")

import h2.config  # noqa: E402
import h2.connection  # noqa: E402
import h2.events  # noqa: E402
from hpack.huffman import HuffmanEncoder  # noqa: E402
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH  # noqa: E402

from fabric.grpc import _h2, _hpack, _wire  # noqa: E402

E = _h2.ErrorCodes
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/pkg.Svc/Call"), (b":authority", b"x"),
           (b"te", b"trailers"), (b"content-type", b"application/grpc")]
RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc")]


# ------------------------------------------------------------------ frames by hand
def frame(ftype, flags, sid, payload=b""):
    n = len(payload)
    return struct.pack(">BHBBI", n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def settings_frame(pairs=(), ack=False):
    return frame(4, 1 if ack else 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in pairs))


def grpc_message(body, flag=0):
    return struct.pack(">BI", flag, len(body)) + body


def server_core(**kw):
    """Our server core after a client preface (magic + empty SETTINGS)."""
    core = _h2.Connection(False, **kw)
    core.initiate()
    core.receive(PREFACE + settings_frame())
    core.take_output()
    return core


def client_core(**kw):
    core = _h2.Connection(True, **kw)
    core.initiate()
    core.receive(settings_frame())
    core.take_output()
    return core


def output(core):
    out = core.take_output() or []
    return b"".join(bytes(x) for x in out)


def frames_of(data):
    """(type, flags, stream, payload) of each frame in data."""
    out, pos = [], 0
    while pos < len(data):
        hi, lo, t, f, sid = struct.unpack_from(">BHBBI", data, pos)
        n = (hi << 16) | lo
        out.append((t, f, sid & 0x7FFFFFFF, data[pos + 9:pos + 9 + n]))
        pos += 9 + n
    return out


def goaway_code(data):
    for t, _, _, payload in frames_of(data):
        if t == 7:
            return struct.unpack(">II", payload[:8])[1]
    return None


def rst_codes(data):
    return {sid: struct.unpack(">I", p)[0] for t, _, sid, p in frames_of(data) if t == 3}


# ------------------------------------------------------------------ HPACK
NAMES = st.sampled_from([b":path", b":authority", b"content-type", b"grpc-timeout", b"x-id", b"x-trace-bin",
                         b"authorization", b"user-agent", b"grpc-status", b"grpc-message", b"accept-encoding"])
VALUES = st.one_of(st.sampled_from([b"", b"0", b"application/grpc", b"gzip, deflate", b"/a/b"]),
                   st.binary(max_size=40).map(lambda b: bytes(c % 94 + 33 for c in b)),
                   st.binary(min_size=200, max_size=600).map(lambda b: bytes(c % 94 + 33 for c in b)))
HEADER_LISTS = st.lists(st.tuples(NAMES, VALUES), max_size=12)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=60))
def test_huffman_matches_hpack_both_ways(data):
    coded = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(data)
    assert _hpack.huffman_encode_bytes(data) == coded
    assert _hpack.huffman_decode_bytes(coded) == data


@pytest.mark.parametrize("bad", [b"\xff\xff\xff\xff",      # EOS inside the string
                                 b"\x00",                 # padding of 0 bits (not EOS bits)
                                 b"\x1f\xff"])            # "a", then 11 bits of padding
def test_huffman_refuses_eos_and_bad_padding(bad):
    with pytest.raises(_hpack.HpackError):
        _hpack.huffman_decode_bytes(bad)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(st.tuples(HEADER_LISTS, st.booleans(), st.sampled_from([None, None, 0, 100, 4096])),
                       min_size=1, max_size=12))
def test_decoder_reads_what_hpack_encodes_and_keeps_the_same_table(blocks):
    ref, ours = hpack.Encoder(), _hpack.Decoder(max_header_list=1 << 30)
    ref_dec = hpack.Decoder()
    for headers, huffman, resize in blocks:
        if resize is not None:
            ref.header_table_size = resize
        block = ref.encode(headers, huffman=huffman)
        got, too_large = ours.decode(block)
        assert not too_large
        assert got == headers == [tuple(h) for h in ref_dec.decode(block, raw=True)]
        assert ours.table == [tuple(e) for e in ref_dec.header_table.dynamic_entries]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.lists(st.tuples(HEADER_LISTS, st.sampled_from([None, None, 0, 64, 256, 4096, 65536])),
                       min_size=1, max_size=12))
def test_encoder_writes_what_hpack_and_our_decoder_read(blocks):
    ours, ref_dec, our_dec = _hpack.Encoder(), hpack.Decoder(), _hpack.Decoder(max_header_list=1 << 30)
    for headers, peer_limit in blocks:
        if peer_limit is not None:
            ours.set_peer_limit(peer_limit)
        block = ours.encode(headers)
        assert [tuple(h) for h in ref_dec.decode(block, raw=True)] == headers
        assert our_dec.decode(block)[0] == headers
        assert ours.table == our_dec.table          # both ends agree on the table


def test_encoder_indexes_what_repeats_and_not_what_changes():
    enc = _hpack.Encoder()
    first = enc.encode(REQUEST + [(b"grpc-timeout", b"99m")])
    second = enc.encode(REQUEST + [(b"grpc-timeout", b"98m")])
    assert len(second) < len(first) // 2
    assert all(b & 0x80 for b in second[:len(REQUEST)])   # the repeated fields are one byte each now
    assert (b"grpc-timeout", b"98m") not in enc.table and (b":path", b"/pkg.Svc/Call") in enc.table
    assert all(name != b"authorization" for name, _ in enc.table)
    block = enc.encode([(b"authorization", b"Bearer t")])
    assert block[0] & 0xF0 == 0x10                        # never indexed (RFC 7541 6.2.3)


@pytest.mark.parametrize("block", [
    b"\x80",                          # index 0
    b"\xbf\x20",                      # index 94: not in the table
    b"\x3f\xe2\x1f",                  # size update to 4097, above SETTINGS_HEADER_TABLE_SIZE (4096)
    b"\x82\x20",                      # size update after a field
    b"\x40\x85ab",                    # string longer than the block
    b"\xff\xff\xff\xff\xff\xff\x7f",  # integer overflow
    b"\x40",                          # block ends before the name
])
def test_decoder_refuses_broken_blocks(block):
    with pytest.raises(_hpack.HpackError):
        _hpack.Decoder().decode(block)


@settings(max_examples=500, deadline=None)
@given(block=st.binary(max_size=200))
def test_decoder_takes_any_bytes_without_crashing(block):
    try:
        _hpack.Decoder().decode(block)
    except _hpack.HpackError:
        pass


def test_oversized_header_list_is_cut_but_the_table_still_follows():
    ref = hpack.Encoder()
    dec = _hpack.Decoder(max_header_list=100)
    block = ref.encode([(b"x-a", b"1" * 60), (b"x-b", b"2" * 60)])
    got, too_large = dec.decode(block)
    assert too_large and got == [(b"x-a", b"1" * 60)]
    assert (b"x-b", b"2" * 60) in dec.table               # indexed by the peer: kept for the next block
    assert dec.decode(ref.encode([(b"x-b", b"2" * 60)])) == ([(b"x-b", b"2" * 60)], False)


# ------------------------------------------------------------------ against h2
def h2_peer(client_side, **settings):
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=client_side, header_encoding=None))
    conn.initiate_connection()
    if settings:
        conn.update_settings(settings)
    return conn


def exchange(ours, theirs, rounds=20, priority=b""):
    """Bytes back and forth until both are quiet; h2's events and our touched
    streams (priority: a PRIORITY frame to slip in, which h2 cannot send as a server)."""
    events, touched = [], []
    for _ in range(rounds):
        moved = False
        out = ours.take_output()
        if out:
            moved = True
            for seg in out:
                events += theirs.receive_data(bytes(seg))
        data = theirs.data_to_send()
        if data:
            moved = True
            touched += [s for s in ours.receive(data + priority) if s not in touched]
            priority = b""
        if not moved:
            break
    return events, touched


def test_our_client_against_h2_server_with_small_windows_continuation_and_padding():
    ours = _h2.Connection(True, initial_window=1 << 20, connection_window=1 << 22, max_frame=1 << 20)
    ours.initiate()
    theirs = h2_peer(False)
    exchange(ours, theirs)
    big_headers = REQUEST + [(b"x-big", b"v" * 20000)]          # above h2's 16 KiB frames: CONTINUATION
    s = ours.open_stream(big_headers)
    body = bytes(range(256)) * 800                               # 204800 bytes: beyond h2's 65535 window
    done = ours.send_message(s, body, end_stream=True)
    assert not done
    got = bytearray()
    for _ in range(50):
        events, _ = exchange(ours, theirs, priority=frame(2, 0, 1, struct.pack(">IB", 0, 31)))
        for ev in events:
            if isinstance(ev, h2.events.RequestReceived):
                assert ev.headers == big_headers
            if isinstance(ev, h2.events.DataReceived):
                got += ev.data
                theirs.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            if isinstance(ev, h2.events.StreamEnded):
                theirs.send_headers(1, RESPONSE)
                reply = grpc_message(b"pong")
                theirs.send_data(1, reply[:3], pad_length=7)         # padded, cut inside the prefix
                theirs.send_data(1, reply[3:], pad_length=0)
                theirs.ping(b"12345678")
                theirs.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
        if not done:
            done = ours.pump(s)
        if s.ended:
            break
    assert bytes(got) == grpc_message(body)
    assert s.ended and list(s.messages) == [b"pong"] and s.headers == RESPONSE
    assert s.trailers == [(b"grpc-status", b"0")] and not s.open
    assert ours.pings_received == 1 and ours.take_events() & _h2.EV_PING


def test_h2_client_against_our_server_and_ping_acks():
    ours = _h2.Connection(False, initial_window=1 << 20, connection_window=1 << 22)
    ours.initiate()
    theirs = h2_peer(True)
    exchange(ours, theirs)
    theirs.send_headers(1, REQUEST)
    theirs.send_data(1, grpc_message(b"a") + grpc_message(b""), end_stream=True)
    theirs.send_headers(3, REQUEST, end_stream=False)
    theirs.reset_stream(3, error_code=8)
    _, touched = exchange(ours, theirs)
    first = touched[0]
    assert first.id == 1 and first.is_new and first.ended and list(first.messages) == [b"a", b""]
    assert touched[1].id == 3 and touched[1].reset_code == 8
    ours.accepted(first)
    ours.send_headers(first, RESPONSE)
    ours.send_message(first, b"reply")
    ours.send_headers(first, [(b"grpc-status", b"0")], end_stream=True)
    ours.ping(b"abcdefgh")
    events, _ = exchange(ours, theirs)
    kinds = [type(e).__name__ for e in events]
    assert kinds[:4] == ["ResponseReceived", "DataReceived", "TrailersReceived", "StreamEnded"]
    data = next(e for e in events if isinstance(e, h2.events.DataReceived)).data
    assert data == grpc_message(b"reply")
    assert ours.take_events() & _h2.EV_PING_ACK and ours.ping_acks == [b"abcdefgh"]
    assert not ours.streams


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(st.binary(max_size=3000), min_size=1, max_size=6),
       cuts=st.lists(st.integers(0, 1 << 16), max_size=20), padded=st.booleans())
def test_any_split_of_the_byte_stream_gives_the_same_calls(messages, cuts, padded):
    """What h2 sends (headers, messages cut across DATA frames, trailers,
    padding), fed to our core in arbitrary pieces."""
    ours = _h2.Connection(True)
    ours.initiate()
    s = ours.open_stream(REQUEST, end_stream=True)
    theirs = h2_peer(False)
    theirs.receive_data(b"".join(bytes(x) for x in ours.take_output()))
    theirs.send_headers(1, RESPONSE)
    payload = b"".join(grpc_message(m) for m in messages)
    step = max(1, len(payload) // 3)
    for i in range(0, len(payload), step):
        theirs.send_data(1, payload[i:i + step], pad_length=5 if padded else None)
    theirs.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    wire = theirs.data_to_send()
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    for a, b in zip(points, points[1:]):
        ours.receive(wire[a:b])
    assert list(s.messages) == messages and s.ended and s.failure is None
    assert s.trailers == [(b"grpc-status", b"0")]


# ------------------------------------------------------------------ gRPC messages in the core
def server_stream_with(data, max_receive=1 << 20, encoding=None, cuts=()):
    core = server_core(max_receive=max_receive, initial_window=1 << 24, connection_window=1 << 24,
                       max_frame=(1 << 24) - 1)
    headers = REQUEST + ([(b"grpc-encoding", encoding.encode())] if encoding else [])
    block = hpack.Encoder().encode(headers)
    wire = frame(1, 4, 1, block) + frame(0, 1, 1, data)
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    touched = []
    for a, b in zip(points, points[1:]):
        touched += core.receive(wire[a:b])
    return core, touched[0]


@settings(max_examples=150, deadline=None)
@given(messages=st.lists(st.tuples(st.binary(max_size=3000), st.booleans()), max_size=6),
       encoding=st.sampled_from(["gzip", "deflate"]), cuts=st.lists(st.integers(0, 30000), max_size=12),
       limit=st.integers(0, 4000))
def test_compressed_messages_survive_any_split_and_the_limit_is_on_inflated_sizes(messages, encoding,
                                                                                   cuts, limit):
    data = b"".join(grpc_message(_wire.compress(m, encoding), 1) if packed else grpc_message(m)
                    for m, packed in messages)
    _, s = server_stream_with(data, limit, encoding, cuts)
    sent = [m for m, _ in messages]
    if any(len(m) > limit for m in sent):
        assert isinstance(s.failure, _wire.WireError) and s.failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert list(s.messages) == sent[:len(s.messages)]
    else:
        assert s.failure is None and list(s.messages) == sent


@pytest.mark.parametrize("limit,size,ok", [(10, 10, True), (10, 11, False), (0, 0, True), (0, 1, False),
                                           (-1, 1 << 20, True)])
def test_receive_limit_is_enforced_from_the_prefix(limit, size, ok):
    _, s = server_stream_with(grpc_message(bytes(size)) if ok else struct.pack(">BI", 0, size), limit)
    if ok:
        assert list(s.messages) == [bytes(size)]
    else:
        assert s.failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not s.messages


@pytest.mark.parametrize("data,encoding,code", [
    (b"\x01\x00\x00\x00\x01x", None, grpc.StatusCode.INTERNAL),          # compressed, no grpc-encoding
    (b"\x01\x00\x00\x00\x01x", "snappy", grpc.StatusCode.UNIMPLEMENTED),  # an encoding we do not know
    (b"\x07\x00\x00\x00\x01x", None, grpc.StatusCode.INTERNAL),          # a flag that is no flag
    (b"\x00\x00\x00\x00\x05ab", None, grpc.StatusCode.INTERNAL),         # the stream ends inside a message
    (b"\x01\x00\x00\x00\x03abc", "gzip", grpc.StatusCode.INTERNAL),      # not gzip
])
def test_broken_messages_fail_the_call(data, encoding, code):
    _, s = server_stream_with(data, 100, encoding)
    assert s.failure.code == code


def test_a_large_message_is_read_in_place():
    """direct_target(): the rest of a DATA frame straight into the message's buffer."""
    core = server_core(initial_window=1 << 24, connection_window=1 << 24, max_frame=(1 << 24) - 1)
    body = bytes(range(256)) * 1024                      # 256 KiB
    msg = grpc_message(body)
    core.receive(frame(1, 4, 1, hpack.Encoder().encode(REQUEST)) +
                 struct.pack(">BHBBI", len(msg) >> 16, len(msg) & 0xFFFF, 0, 1, 1) + msg[:100])
    target = core.direct_target()
    assert target is not None and len(target) == len(body) - 95
    target[:] = body[95:]
    s = core.direct_advance(len(target))[0]
    assert s.ended and list(s.messages) == [body] and core.direct_target() is None
    assert core.counters["direct_bytes_received"] == len(body) - 95


def test_large_payloads_leave_as_views_of_the_senders_buffer():
    core = client_core()
    core.receive(settings_frame([(4, 1 << 24), (5, (1 << 24) - 1)]) + frame(8, 0, 0, struct.pack(">I", 1 << 24)))
    core.take_output()
    payload = bytearray(b"z" * (256 << 10))
    s = core.open_stream(REQUEST)
    assert core.send_message(s, payload, end_stream=True)
    out = core.take_output()
    views = [x for x in out if type(x) is memoryview]
    assert len(views) == 1 and views[0].obj is payload and views[0].nbytes == len(payload)
    assert b"".join(bytes(x) for x in out).endswith(bytes(payload))


# ------------------------------------------------------------------ protocol errors
CONNECTION_ERRORS = [
    ("DATA on stream 0", frame(0, 0, 0, b"x"), E.PROTOCOL_ERROR),
    ("a frame above our max frame size", frame(0, 0, 1, b"x" * 20000), E.FRAME_SIZE_ERROR),
    ("SETTINGS of 5 bytes", frame(4, 0, 0, b"12345"), E.FRAME_SIZE_ERROR),
    ("SETTINGS on a stream", frame(4, 0, 1), E.PROTOCOL_ERROR),
    ("SETTINGS ACK with a payload", frame(4, 1, 0, b"\0" * 6), E.FRAME_SIZE_ERROR),
    ("ENABLE_PUSH 2", settings_frame([(2, 2)]), E.PROTOCOL_ERROR),
    ("MAX_FRAME_SIZE below 16384", settings_frame([(5, 100)]), E.PROTOCOL_ERROR),
    ("INITIAL_WINDOW_SIZE above 2**31-1", settings_frame([(4, 1 << 31)]), E.FLOW_CONTROL_ERROR),
    ("PING of 7 bytes", frame(6, 0, 0, b"1234567"), E.FRAME_SIZE_ERROR),
    ("PING on a stream", frame(6, 0, 1, b"12345678"), E.PROTOCOL_ERROR),
    ("WINDOW_UPDATE of 0 on the connection", frame(8, 0, 0, b"\0\0\0\0"), E.PROTOCOL_ERROR),
    ("connection window overflow", frame(8, 0, 0, struct.pack(">I", (1 << 31) - 1)), E.FLOW_CONTROL_ERROR),
    ("WINDOW_UPDATE of 3 bytes", frame(8, 0, 0, b"\0\0\1"), E.FRAME_SIZE_ERROR),
    ("RST_STREAM on stream 0", frame(3, 0, 0, b"\0\0\0\0"), E.PROTOCOL_ERROR),
    ("RST_STREAM on an idle stream", frame(3, 0, 5, b"\0\0\0\x08"), E.PROTOCOL_ERROR),
    ("PRIORITY of 4 bytes", frame(2, 0, 1, b"\0\0\0\0"), E.FRAME_SIZE_ERROR),
    ("CONTINUATION with no header block", frame(9, 4, 1, b"\x82"), E.PROTOCOL_ERROR),
    ("PUSH_PROMISE", frame(5, 4, 1, b"\0\0\0\2\x82"), E.PROTOCOL_ERROR),
    ("GOAWAY of 4 bytes", frame(7, 0, 0, b"\0\0\0\0"), E.FRAME_SIZE_ERROR),
    ("DATA on an idle stream", frame(0, 0, 7, b"x"), E.PROTOCOL_ERROR),
    ("HEADERS on an even stream", frame(1, 4, 2, b"\x83\x86\x84"), E.PROTOCOL_ERROR),
    ("a broken header block", frame(1, 4, 1, b"\x80"), E.COMPRESSION_ERROR),
    ("a frame inside a header block", frame(1, 0, 1, b"\x83") + frame(6, 0, 0, b"12345678"), E.PROTOCOL_ERROR),
    ("HEADERS padding longer than the frame", frame(1, 0x0C, 1, b"\x09\x83"), E.PROTOCOL_ERROR),
    ("DATA beyond the connection window", frame(1, 4, 1, hpack.Encoder().encode(REQUEST)) +
     frame(0, 0, 1, grpc_message(b"x" * 100000)[:16000]) + frame(0, 0, 1, b"x" * 16000) * 4, E.FLOW_CONTROL_ERROR),
]


@pytest.mark.parametrize("what,data,code", CONNECTION_ERRORS, ids=[c[0] for c in CONNECTION_ERRORS])
def test_connection_errors_send_goaway_with_their_code(what, data, code):
    # (a stream window above the connection's, and nothing taken by the application)
    core = server_core(initial_window=1 << 20, queued_high_water=-1)
    with pytest.raises(_h2.H2Error) as exc:
        core.receive(data)
    assert exc.value.code == code
    assert goaway_code(output(core)) == code
    assert core.dead is not None
    with pytest.raises(_h2.H2Error):                  # dead: nothing more is taken
        core.receive(settings_frame())


@pytest.mark.parametrize("data,why", [
    (b"GET / HTTP/1.1\r\n\r\n", "not an HTTP/2 client connection preface"),
    (PREFACE + frame(6, 0, 0, b"12345678"), "first frame is not SETTINGS"),
])
def test_a_server_wants_the_preface_and_settings_first(data, why):
    core = _h2.Connection(False)
    core.initiate()
    with pytest.raises(_h2.H2Error) as exc:
        core.receive(data)
    assert why in str(exc.value) and exc.value.code == E.PROTOCOL_ERROR


def block(headers):
    return hpack.Encoder().encode(headers)


STREAM_ERRORS = [
    ("an uppercase header name", [REQUEST + [(b"X-Up", b"1")]], E.PROTOCOL_ERROR),
    ("a connection header", [REQUEST + [(b"connection", b"close")]], E.PROTOCOL_ERROR),
    ("te other than trailers", [REQUEST[:4] + [(b"te", b"gzip")]], E.PROTOCOL_ERROR),
    ("no :path", [[h for h in REQUEST if h[0] != b":path"]], E.PROTOCOL_ERROR),
    ("a pseudo-header after a regular one", [REQUEST[1:] + REQUEST[:1]], E.PROTOCOL_ERROR),
    ("an unknown pseudo-header", [REQUEST + [(b":protocol", b"x")]], E.PROTOCOL_ERROR),
    ("a value with a newline", [REQUEST + [(b"x-a", b"1\n2")]], E.PROTOCOL_ERROR),
]


@pytest.mark.parametrize("what,blocks,code", STREAM_ERRORS, ids=[c[0] for c in STREAM_ERRORS])
def test_malformed_requests_reset_only_their_stream(what, blocks, code):
    core = server_core()
    touched = core.receive(frame(1, 5, 1, block(blocks[0])))
    assert rst_codes(output(core)) == {1: code}
    assert touched[0].reset_code == code and core.dead is None
    # the connection goes on
    touched = core.receive(frame(1, 5, 3, block(REQUEST)))
    assert touched[0].id == 3 and touched[0].reset_code is None


def test_stream_level_errors_reset_the_stream():
    core = server_core()
    core.receive(frame(1, 4, 1, block(REQUEST)) + frame(8, 0, 1, b"\0\0\0\0"))
    assert rst_codes(output(core)) == {1: E.PROTOCOL_ERROR}                 # WINDOW_UPDATE of 0
    core.receive(frame(1, 4, 3, block(REQUEST)) + frame(8, 0, 3, struct.pack(">I", (1 << 31) - 1)))
    assert rst_codes(output(core)) == {3: E.FLOW_CONTROL_ERROR}             # stream window overflow
    core.receive(frame(1, 5, 5, block(REQUEST)) + frame(0, 0, 5, b"x"))
    assert rst_codes(output(core)) == {5: E.STREAM_CLOSED}                  # DATA after END_STREAM
    assert core.dead is None


def test_flow_control_beyond_a_streams_window_resets_it():
    core = server_core(initial_window=100)
    core.receive(frame(1, 4, 1, block(REQUEST)) + frame(0, 0, 1, b"x" * 101))
    assert rst_codes(output(core)) == {1: E.FLOW_CONTROL_ERROR} and core.dead is None


def test_limits_streams_above_the_concurrency_limit_and_after_goaway_are_refused():
    core = server_core(max_concurrent=2)
    touched = core.receive(frame(1, 4, 1, block(REQUEST)) + frame(1, 4, 3, block(REQUEST)) +
                           frame(1, 4, 5, block(REQUEST)))
    assert [s.id for s in touched] == [1, 3]
    assert rst_codes(output(core)) == {5: E.REFUSED_STREAM}
    core.goaway(3)
    output(core)
    assert core.receive(frame(1, 4, 7, block(REQUEST))) == []
    assert rst_codes(output(core)) == {7: E.REFUSED_STREAM}


def test_a_header_block_far_above_the_limit_closes_the_connection():
    core = server_core(max_header_list=1024)
    with pytest.raises(_h2.H2Error) as exc:
        core.receive(frame(1, 0, 1, b"\0" * 8000) + frame(9, 0, 1, b"\0" * 8000))
    assert exc.value.code == E.ENHANCE_YOUR_CALM


def test_headers_above_the_list_limit_fail_the_call_with_resource_exhausted():
    core = server_core(max_header_list=200)
    touched = core.receive(frame(1, 5, 1, block(REQUEST + [(b"x-big", b"v" * 300)])))
    assert touched[0].failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED and core.dead is None


def test_goaway_received_stops_new_streams_and_names_the_last_one():
    core = client_core()
    s1 = core.open_stream(REQUEST)
    s3 = core.open_stream(REQUEST)
    core.receive(frame(7, 0, 0, struct.pack(">II", 1, 0) + b"bye"))
    assert core.take_events() & _h2.EV_GOAWAY and core.goaway_received == (1, 0, b"bye")
    assert not core.can_open
    with pytest.raises(_h2.H2Error):
        core.open_stream(REQUEST)
    assert s1.open and s3.open                    # the driver decides what GOAWAY means for them


def test_settings_change_windows_and_table_size_and_are_acknowledged():
    core = client_core()
    s = core.open_stream(REQUEST)
    before = core.stream_send_window(s)
    core.receive(settings_frame([(4, 65535 + 1000), (1, 0)]))
    assert core.stream_send_window(s) == min(before + 1000, core.send_window)
    out = frames_of(output(core))
    assert (4, 1, 0, b"") in out                   # our ACK
    s2 = core.open_stream(REQUEST)
    blk = [p for t, _, sid, p in frames_of(output(core)) if t == 1 and sid == s2.id][0]
    assert blk[0] == 0x20                          # the table size update to 0 comes first
    assert hpack.Decoder().decode(blk, raw=True) is not None


def test_informational_headers_are_skipped():
    core = client_core()
    s = core.open_stream(REQUEST, end_stream=True)
    enc = hpack.Encoder()
    core.receive(frame(1, 4, 1, enc.encode([(b":status", b"100")])) + frame(1, 4, 1, enc.encode(RESPONSE)) +
                 frame(0, 0, 1, grpc_message(b"ok")) + frame(1, 5, 1, enc.encode([(b"grpc-status", b"0")])))
    assert s.headers == RESPONSE and list(s.messages) == [b"ok"] and s.ended


def test_frames_of_unknown_types_and_long_goaway_debug_data_are_taken():
    core = client_core()
    core.receive(frame(0x42, 0xFF, 0, b"whatever" * 100))
    core.receive(frame(7, 0, 0, struct.pack(">II", 0, 0) + b"d" * 5000))
    assert core.goaway_received[2] == b"d" * 1024 and core.dead is None


def test_window_updates_are_sent_as_data_is_consumed():
    core = server_core(initial_window=1 << 20, connection_window=1 << 22)
    body = b"b" * 300000
    touched = core.receive(frame(1, 4, 1, block(REQUEST)) +
                           b"".join(frame(0, 0, 1, chunk) for chunk in
                                    [grpc_message(body)[i:i + 16384] for i in range(0, len(body) + 5, 16384)]))
    s = touched[0]
    assert list(s.messages) == [body]
    updates = {sid: struct.unpack(">I", p)[0] for t, _, sid, p in frames_of(output(core)) if t == 8}
    # the stream's window back once a quarter of it was used; the connection's at 1 MiB
    assert updates == {1: 262144}
    more = grpc_message(b"c" * 900000)
    core.receive(b"".join(frame(0, 0, 1, more[i:i + 16384]) for i in range(0, len(more), 16384)))
    updates = {sid: struct.unpack(">I", p)[0] for t, _, sid, p in frames_of(output(core)) if t == 8}
    assert updates[0] >= 1 << 20 and s.queued_bytes == len(body) + 900000


def test_zlib_inflate_bomb_is_refused_at_the_limit():
    bomb = zlib.compress(bytes(50 << 20))          # 50 MiB of zeros in ~50 KiB
    _, s = server_stream_with(grpc_message(bomb, 1), max_receive=1 << 20, encoding="deflate")
    assert s.failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
