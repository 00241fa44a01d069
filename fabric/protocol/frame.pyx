# cython: language_level=3
"""Python view of the frame codec (frame.pxd), for tests, tools and docs.

The engine uses the inline C functions directly; these wrappers run the very
same code, so property tests of them test the engine's decoder.
"""
from libc.stdint cimport uint8_t, uint64_t
from fabric.errors import ProtocolError

HEADER_SIZE = FRAME_HEADER
VERSION = FRAME_VERSION
MAGIC = FRAME_MAGIC
TYPES = {"HELLO": F_HELLO, "EAGER": F_EAGER, "RNDV": F_RNDV,
         "CHUNK_DONE": F_CHUNK_DONE, "CREDIT": F_CREDIT, "CLOSE": F_CLOSE,
         "POST": F_POST, "PUT": F_PUT, "PING": F_PING, "PONG": F_PONG}
TYPE_NAMES = {v: k for k, v in TYPES.items()}


def encode_header(int ftype, int flags, uint64_t body_length, uint64_t msg_id,
                  uint64_t aux=0, int credits=0):
    cdef uint8_t buf[FRAME_HEADER]
    if body_length > 0xFFFFFFFF or aux > 0xFFFFFFFF or not 0 <= credits <= 0xFFFF:
        raise ValueError("field out of range")
    put_header(buf, ftype, flags, <uint32_t>body_length, msg_id, <uint32_t>aux, <uint16_t>credits)
    return (<char*>buf)[:FRAME_HEADER]


def encode_eager(uint64_t msg_id, bytes payload, int credits=0):
    return encode_header(F_EAGER, 0, len(payload), msg_id, 0, credits) + payload


def encode_rndv(uint64_t msg_id, uint64_t index, uint64_t total, uint64_t offset,
                uint64_t raddr, uint64_t length, bytes rkey):
    cdef bytearray out = bytearray(FRAME_HEADER + RNDV_FIXED + len(rkey))
    cdef uint8_t* p = <uint8_t*><char*>out
    if len(rkey) > MAX_RKEY or length > 0xFFFFFFFF or index > 0xFFFFFFFF:
        raise ValueError("field out of range")
    put_rndv(p, msg_id, <uint32_t>index, total, offset, raddr, <uint32_t>length,
             <const uint8_t*><const char*>rkey, <uint32_t>len(rkey))
    return bytes(out)


def encode_hello(uint64_t max_recv, uint64_t credits, uint64_t max_message,
                 uint32_t max_rendezvous=0, uint32_t max_chunks=0, uint32_t features=0):
    cdef uint8_t buf[FRAME_HEADER + HELLO_BODY]
    put_hello(buf, <uint32_t>max_recv, <uint32_t>credits, max_message, max_rendezvous, max_chunks,
              features)
    return (<char*>buf)[:FRAME_HEADER + HELLO_BODY]


def encode_post(uint64_t msg_id, uint64_t raddr, uint64_t cap, bytes rkey):
    cdef bytearray out = bytearray(FRAME_HEADER + POST_FIXED + len(rkey))
    if len(rkey) > MAX_RKEY:
        raise ValueError("field out of range")
    put_post(<uint8_t*><char*>out, msg_id, raddr, cap, <const uint8_t*><const char*>rkey,
             <uint32_t>len(rkey))
    return bytes(out)


def encode_put(uint64_t msg_id, uint64_t total):
    cdef uint8_t buf[FRAME_HEADER + PUT_BODY]
    put_put(buf, msg_id, total)
    return (<char*>buf)[:FRAME_HEADER + PUT_BODY]


def decode(data):
    """Decode every frame of one fabric message; raise ProtocolError on the
    first invalid one. Returns a list of dicts (bodies as bytes)."""
    cdef const uint8_t[::1] view = memoryview(data).cast("B")
    cdef size_t pos = 0, n = view.shape[0]
    cdef frame_t f
    cdef const char* error = NULL
    cdef int used
    out = []
    while pos < n:
        used = parse_frame(&view[pos], n - pos, &f, &error)
        if used < 0:
            raise ProtocolError(f"{error.decode()} at byte {pos}")
        d = {"type": TYPE_NAMES[f.type], "flags": f.flags, "msg_id": f.msg_id,
             "aux": f.aux, "credits": f.credits,
             "body": bytes(view[pos + FRAME_HEADER: pos + used])}
        if f.type == F_RNDV:
            d.update(total=f.total, offset=f.offset, raddr=f.raddr, length=f.length,
                     rkey=bytes(view[pos + FRAME_HEADER + RNDV_FIXED: pos + used]))
        elif f.type == F_HELLO:
            d.update(max_recv=f.hello_max_recv, credits_offered=f.hello_credits,
                     max_message=f.hello_max_message, max_rendezvous=f.hello_max_rendezvous,
                     max_chunks=f.hello_max_chunks, features=f.hello_features)
        elif f.type == F_POST and not (f.flags & POST_WITHDRAW):
            d.update(raddr=f.raddr, cap=f.cap,
                     rkey=bytes(view[pos + FRAME_HEADER + POST_FIXED: pos + used]))
        elif f.type == F_PUT and not (f.flags & PUT_DECLINED):
            d.update(total=f.total)
        out.append(d)
        pos += used
    return out
