"""gRPC wire rules of fabric.grpc: grpc-timeout, metadata and status text
encodings, targets, the plain TCP byte stream. (Message framing is cut by
the HTTP/2 core: tests/test_h2_core.py.)"""

import pytest
from hypothesis import given, settings, strategies as st

grpc = pytest.importorskip("grpc")

from fabric.grpc import _transport, _wire  # noqa: E402


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
