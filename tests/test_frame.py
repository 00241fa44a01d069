"""The frame codec: round trips, and hostile bytes (hypothesis)."""
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric.errors import ProtocolError
from fabric.protocol import frame

U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)


def test_header_layout_is_documented_one():
    h = frame.encode_header(frame.TYPES["EAGER"], 0, 5, 7, 0, 3)
    assert len(h) == frame.HEADER_SIZE == 24
    magic, version, ftype, flags, length, msg_id, aux, credits, reserved = struct.unpack("<BBBBIQIHH", h)
    assert (magic, version, ftype, flags, length, msg_id, aux, credits, reserved) == (
        0xFB, 1, frame.TYPES["EAGER"], 0, 5, 7, 0, 3, 0)


@given(msg_id=st.integers(1, 2**64 - 1), payload=st.binary(max_size=300), credits=st.integers(0, 65535))
def test_eager_round_trip(msg_id, payload, credits):
    (f,) = frame.decode(frame.encode_eager(msg_id, payload, credits))
    assert (f["type"], f["msg_id"], f["body"], f["credits"]) == ("EAGER", msg_id, payload, credits)


@given(msg_id=st.integers(1, 2**64 - 1), index=U32, raddr=U64, rkey=st.binary(max_size=256),
       total=st.integers(1, 2**63), data=st.data())
def test_rndv_round_trip(msg_id, index, raddr, rkey, total, data):
    offset = data.draw(st.integers(0, total - 1))
    length = data.draw(st.integers(1, min(total - offset, 2**32 - 1)))
    (f,) = frame.decode(frame.encode_rndv(msg_id, index, total, offset, raddr, length, rkey))
    assert (f["type"], f["msg_id"], f["aux"], f["total"], f["offset"], f["raddr"], f["length"], f["rkey"]) == (
        "RNDV", msg_id, index, total, offset, raddr, length, rkey)


@given(max_recv=U32, credits=U32, max_message=U64, max_rendezvous=U32, max_chunks=U32)
def test_hello_round_trip(max_recv, credits, max_message, max_rendezvous, max_chunks):
    (f,) = frame.decode(frame.encode_hello(max_recv, credits, max_message, max_rendezvous, max_chunks))
    assert (f["max_recv"], f["credits_offered"], f["max_message"], f["max_rendezvous"], f["max_chunks"]) == (
        max_recv, credits, max_message, max_rendezvous, max_chunks)


@given(msg_id=st.integers(1, 2**64 - 1), raddr=U64, cap=st.integers(1, 2**64 - 1), rkey=st.binary(max_size=256))
def test_post_round_trip(msg_id, raddr, cap, rkey):
    (f,) = frame.decode(frame.encode_post(msg_id, raddr, cap, rkey))
    assert (f["type"], f["flags"], f["msg_id"], f["raddr"], f["cap"], f["rkey"]) == (
        "POST", 0, msg_id, raddr, cap, rkey)


@given(msg_id=st.integers(1, 2**64 - 1), total=st.integers(1, 2**64 - 1))
def test_put_round_trip(msg_id, total):
    (f,) = frame.decode(frame.encode_put(msg_id, total))
    assert (f["type"], f["flags"], f["msg_id"], f["total"]) == ("PUT", 0, msg_id, total)


def test_withdraw_and_declined_carry_no_body():
    blob = frame.encode_header(frame.TYPES["POST"], 1, 0, 5) + frame.encode_header(frame.TYPES["PUT"], 1, 0, 5)
    assert [(f["type"], f["flags"], f["msg_id"]) for f in frame.decode(blob)] == [("POST", 1, 5), ("PUT", 1, 5)]


def test_the_hellos_last_eight_bytes_must_be_zero():
    blob = bytearray(frame.encode_hello(70000, 8, 1 << 20, 64, 2))
    blob[-1] = 1
    with pytest.raises(ProtocolError, match="HELLO"):
        frame.decode(bytes(blob))


def test_several_frames_in_one_fabric_message():
    blob = frame.encode_eager(1, b"a") + frame.encode_eager(2, b"") + \
        frame.encode_header(frame.TYPES["CREDIT"], 0, 0, 0, 0, 9)
    assert [f["type"] for f in frame.decode(blob)] == ["EAGER", "EAGER", "CREDIT"]


@pytest.mark.parametrize("blob, why", [
    (b"\x00" * 24, "magic"),
    (frame.encode_eager(1, b"abc")[:-1], "longer"),
    (frame.encode_eager(1, b"x")[:10], "truncated"),
    (frame.encode_header(99, 0, 0, 0), "unknown"),
    (frame.encode_header(frame.TYPES["EAGER"], 1, 0, 1), "EAGER"),
    (frame.encode_header(frame.TYPES["EAGER"], 0, 0, 0), "EAGER"),          # msg_id 0
    (frame.encode_header(frame.TYPES["CREDIT"], 0, 0, 5), "control"),
    (frame.encode_header(frame.TYPES["CHUNK_DONE"], 2, 0, 1), "CHUNK_DONE"),
    (frame.encode_header(frame.TYPES["HELLO"], 0, 0, 0), "HELLO"),
    (frame.encode_rndv(1, 0, 10, 5, 0, 6, b"k"), "RNDV"),                   # past the end
    (bytes([0xFB, 2]) + bytes(22), "version"),
    (frame.encode_post(1, 0x1000, 0, b"k" * 8), "POST"),                 # an empty post
    (frame.encode_post(0, 0x1000, 64, b"k" * 8), "POST"),                # msg_id 0
    (frame.encode_post(1, 0x1000, 64, b"k" * 9)[:-1], "longer"),         # rkey shorter than said
    (frame.encode_post(1, 0x1000, 64, b"k" * 9)[:40] + b"\x08" + frame.encode_post(1, 0x1000, 64, b"k" * 9)[41:],
     "POST"),                                                            # rkey_len not the body's
    (frame.encode_header(frame.TYPES["POST"], 2, 0, 1), "POST"),         # unknown flag
    (frame.encode_header(frame.TYPES["POST"], 1, 8, 1) + bytes(8), "POST"),   # a withdrawal with a body
    (frame.encode_put(1, 1)[:-8] + bytes(8), "PUT"),                     # total 0
    (frame.encode_header(frame.TYPES["PUT"], 0, 0, 1), "PUT"),           # no total
    (frame.encode_header(frame.TYPES["PUT"], 3, 0, 1), "PUT"),
    (frame.encode_header(frame.TYPES["PING"], 1, 0, 7), "PING"),         # a flag
    (frame.encode_header(frame.TYPES["PONG"], 0, 0, 7, 1), "PING"),      # aux
    (frame.encode_header(frame.TYPES["PING"], 0, 4, 7) + bytes(4), "PING"),   # a body
])
def test_invalid_frames_raise_protocol_error(blob, why):
    with pytest.raises(ProtocolError, match=why):
        frame.decode(blob)


def test_reserved_bits_and_huge_lengths_are_refused():
    h = bytearray(frame.encode_header(frame.TYPES["CREDIT"], 0, 0, 0))
    h[22] = 1
    with pytest.raises(ProtocolError):
        frame.decode(bytes(h))
    # a length field claiming 4 GiB must not make the decoder read or allocate it
    huge = frame.encode_header(frame.TYPES["EAGER"], 0, 2**32 - 1, 1)
    with pytest.raises(ProtocolError):
        frame.decode(huge + b"x" * 100)


@settings(max_examples=3000, deadline=None)   # a busy CI host must not fail a decoder test on time
@given(st.binary(max_size=200))
def test_random_bytes_never_crash(blob):
    try:
        frames = frame.decode(blob)
    except ProtocolError:
        return
    assert sum(24 + len(f["body"]) for f in frames) == len(blob)


@settings(max_examples=3000, deadline=None)   # a busy CI host must not fail a decoder test on time
@given(st.data())
def test_mutated_valid_messages_decode_or_raise(data):
    base = data.draw(st.sampled_from([
        frame.encode_eager(3, b"hello world"),
        frame.encode_rndv(4, 1, 1 << 20, 65536, 0xDEADBEEF, 65536, b"12345678"),
        frame.encode_hello(70000, 32, 1 << 40),
        frame.encode_header(frame.TYPES["CHUNK_DONE"], 1, 0, 9, 3, 0),
        frame.encode_post(5, 0x7F0000001000, 1 << 20, b"rkey0123"),
        frame.encode_put(5, 1 << 20),
    ]))
    blob = bytearray(base)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    try:
        frames = frame.decode(bytes(blob[:cut]))
    except ProtocolError:
        return
    for f in frames:
        assert f["type"] in frame.TYPES
