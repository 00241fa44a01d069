# The engine's frame format, version 1. This file is the single definition;
# docs/guides/concepts.rst describes it for readers.
#
# A fabric message (one backend send) carries one or more frames back to back.
# Every frame starts with a 24-byte little-endian header:
#
#   off size field
#     0    1 magic        0xFB
#     1    1 version      1
#     2    1 type         HELLO..CLOSE below
#     3    1 flags        per type; unknown bits are an error
#     4    4 body_length  bytes of body following the header
#     8    8 msg_id       message sequence number on this endpoint (from 1)
#    16    4 aux          RNDV / CHUNK_DONE: chunk index; otherwise 0
#    20    2 credits      receive buffers the sender of this frame returns
#    22    2 reserved     0
#
# Bodies:
#   HELLO       32 bytes: u32 max_recv, u32 credits, u64 max_message,
#               u32 max_rendezvous, u32 max_chunks, u32 features, u32 0.
#               max_rendezvous and max_chunks bound what the sender of the
#               HELLO accepts in flight from its peer: rendezvous messages
#               announced and not yet fully pulled, and unanswered chunk
#               announcements per message (0: not declared). features:
#               HELLO_WRITES_POSTED, the sender writes messages into buffers
#               its peer posts (POST/PUT below); HELLO_MEASURES, the sender
#               answers PING with PONG; unknown bits are ignored.
#   EAGER       the message bytes (possibly none)
#   RNDV        announces one chunk of a rendezvous message:
#               u64 total, u64 offset, u64 raddr, u32 length, u16 rkey_len,
#               u16 0, then rkey_len bytes of remote key. Chunks of a message
#               are announced in order and tile [0, total) without gaps.
#               Flag RNDV_NATIVE: no key (length 0, address 0); the chunk comes
#               by the fabric's own rendezvous under tag (msg_id << 24 | index).
#   CHUNK_DONE  no body; the receiver has pulled chunk `aux` of `msg_id` (or,
#               with flag DONE_FAILED, gives up on the message).
#   CREDIT      no body; carries only `credits`.
#   CLOSE       no body; the sender will send nothing more.
#   PING        no body; msg_id is the sender's own cookie (its clock); sent
#               only to a peer whose HELLO has HELLO_MEASURES.
#   PONG        no body; answers a PING, echoing its msg_id (the sender of
#               the PING measures the round trip). A peer sending more than
#               64 PINGs on one connection is cut off (each costs a PONG).
#   POST        (receiver to sender) a receive buffer waits for message
#               msg_id: u64 raddr, u64 cap, u16 rkey_len, u16 0, u32 0, then
#               rkey_len bytes of key (the region registered for the peer to
#               write). The sender may write a message of at most cap bytes
#               there and send PUT instead of announcing it. Flag
#               POST_WITHDRAW, no body: the receiver takes the buffer back
#               (the sender answers with PUT/PUT_DECLINED unless the message's
#               own first frame answers it).
#   PUT         (sender to receiver) message msg_id, u64 total bytes, has been
#               written at the start of the posted buffer; it is the message's
#               only frame and follows its writes on the channel. Flag
#               PUT_DECLINED, no body: the post of msg_id will not be written
#               (answer to POST_WITHDRAW).
# A post lives until the first frame of its message arrives (PUT, or EAGER /
# RNDV when the sender did not use it), a PUT_DECLINED, the peer's CLOSE, or
# the connection's end.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset
from fabric._bytes cimport wr16, wr32, wr64, rd16, rd32, rd64

cdef enum:
    FRAME_MAGIC = 0xFB
    FRAME_VERSION = 1
    FRAME_HEADER = 24
    HELLO_BODY = 32
    RNDV_FIXED = 32
    MAX_RKEY = 256

cdef enum:
    F_HELLO = 1
    F_EAGER = 2
    F_RNDV = 3
    F_CHUNK_DONE = 4
    F_CREDIT = 5
    F_CLOSE = 6
    F_POST = 7
    F_PUT = 8
    F_PING = 9
    F_PONG = 10

cdef enum:
    DONE_FAILED = 1
    RNDV_NATIVE = 1      # RNDV flag: the chunk travels by the fabric's own rendezvous (no key)
    POST_WITHDRAW = 1    # POST flag: the receiver takes its buffer back
    PUT_DECLINED = 1     # PUT flag: the post will not be written
    POST_FIXED = 24
    PUT_BODY = 8
    HELLO_WRITES_POSTED = 1  # HELLO feature: writes messages into buffers the peer posts
    HELLO_MEASURES = 2       # HELLO feature: answers PING with PONG

cdef struct frame_t:
    int type
    int flags
    uint32_t body_length
    uint64_t msg_id
    uint32_t aux
    uint32_t credits
    const uint8_t* body
    # RNDV
    uint64_t total
    uint64_t offset
    uint64_t raddr
    uint64_t cap                # POST: the posted buffer's size
    uint32_t length
    uint32_t rkey_len
    const uint8_t* rkey
    # HELLO
    uint32_t hello_max_recv
    uint32_t hello_credits
    uint64_t hello_max_message
    uint32_t hello_max_rendezvous
    uint32_t hello_max_chunks
    uint32_t hello_features


cdef inline void put_header(uint8_t* p, int ftype, int flags, uint32_t body_length,
                            uint64_t msg_id, uint32_t aux, uint16_t credits) noexcept nogil:
    p[0] = FRAME_MAGIC
    p[1] = FRAME_VERSION
    p[2] = <uint8_t>ftype
    p[3] = <uint8_t>flags
    wr32(p + 4, body_length)
    wr64(p + 8, msg_id)
    wr32(p + 16, aux)
    wr16(p + 20, credits)
    wr16(p + 22, 0)


cdef inline void set_credits(uint8_t* header, uint16_t credits) noexcept nogil:
    wr16(header + 20, credits)


cdef inline size_t put_rndv(uint8_t* p, uint64_t msg_id, uint32_t index, uint64_t total,
                            uint64_t offset, uint64_t raddr, uint32_t length,
                            const uint8_t* rkey, uint32_t rkey_len, int flags=0) noexcept nogil:
    """Writes a whole RNDV frame; returns its size."""
    put_header(p, F_RNDV, flags, RNDV_FIXED + rkey_len, msg_id, index, 0)
    p += FRAME_HEADER
    wr64(p, total)
    wr64(p + 8, offset)
    wr64(p + 16, raddr)
    wr32(p + 24, length)
    wr16(p + 28, <uint16_t>rkey_len)
    wr16(p + 30, 0)
    memcpy(p + RNDV_FIXED, rkey, rkey_len)
    return FRAME_HEADER + RNDV_FIXED + rkey_len


cdef inline size_t put_hello(uint8_t* p, uint32_t max_recv, uint32_t credits,
                             uint64_t max_message, uint32_t max_rendezvous,
                             uint32_t max_chunks, uint32_t features=0) noexcept nogil:
    put_header(p, F_HELLO, 0, HELLO_BODY, 0, 0, 0)
    p += FRAME_HEADER
    memset(p, 0, HELLO_BODY)
    wr32(p, max_recv)
    wr32(p + 4, credits)
    wr64(p + 8, max_message)
    wr32(p + 16, max_rendezvous)
    wr32(p + 20, max_chunks)
    wr32(p + 24, features)
    return FRAME_HEADER + HELLO_BODY


cdef inline size_t put_post(uint8_t* p, uint64_t msg_id, uint64_t raddr, uint64_t cap,
                            const uint8_t* rkey, uint32_t rkey_len) noexcept nogil:
    """Writes a whole POST frame; returns its size."""
    put_header(p, F_POST, 0, POST_FIXED + rkey_len, msg_id, 0, 0)
    p += FRAME_HEADER
    memset(p, 0, POST_FIXED)
    wr64(p, raddr)
    wr64(p + 8, cap)
    wr16(p + 16, <uint16_t>rkey_len)
    memcpy(p + POST_FIXED, rkey, rkey_len)
    return FRAME_HEADER + POST_FIXED + rkey_len


cdef inline size_t put_put(uint8_t* p, uint64_t msg_id, uint64_t total) noexcept nogil:
    put_header(p, F_PUT, 0, PUT_BODY, msg_id, 0, 0)
    wr64(p + FRAME_HEADER, total)
    return FRAME_HEADER + PUT_BODY


cdef inline int parse_frame(const uint8_t* p, size_t avail, frame_t* f,
                            const char** error) noexcept nogil:
    """Decode and validate the frame at p. Returns its total size (> 0), or
    -1 with *error set to a static explanation. Never reads past avail."""
    cdef const uint8_t* b
    if avail < FRAME_HEADER:
        error[0] = "truncated frame header"
        return -1
    if p[0] != FRAME_MAGIC:
        error[0] = "bad frame magic"
        return -1
    if p[1] != FRAME_VERSION:
        error[0] = "unsupported frame version"
        return -1
    if rd16(p + 22) != 0:
        error[0] = "reserved header bits set"
        return -1
    f.type = p[2]
    f.flags = p[3]
    f.body_length = rd32(p + 4)
    f.msg_id = rd64(p + 8)
    f.aux = rd32(p + 16)
    f.credits = rd16(p + 20)
    if f.body_length > avail - FRAME_HEADER:
        error[0] = "frame body longer than its fabric message"
        return -1
    b = p + FRAME_HEADER
    f.body = b
    if f.type == F_EAGER:
        if f.flags != 0 or f.aux != 0 or f.msg_id == 0:
            error[0] = "malformed EAGER frame"
            return -1
    elif f.type == F_RNDV:
        if (f.flags & ~RNDV_NATIVE) != 0 or f.msg_id == 0 or f.body_length < RNDV_FIXED:
            error[0] = "malformed RNDV frame"
            return -1
        f.total = rd64(b)
        f.offset = rd64(b + 8)
        f.raddr = rd64(b + 16)
        f.length = rd32(b + 24)
        f.rkey_len = rd16(b + 28)
        f.rkey = b + RNDV_FIXED
        if (rd16(b + 30) != 0 or f.rkey_len > MAX_RKEY
                or f.body_length != RNDV_FIXED + f.rkey_len
                or f.length == 0 or f.total == 0
                or f.offset > f.total or f.length > f.total - f.offset
                or ((f.flags & RNDV_NATIVE) and (f.rkey_len != 0 or f.raddr != 0))):
            error[0] = "malformed RNDV frame"
            return -1
    elif f.type == F_CHUNK_DONE:
        if (f.flags & ~DONE_FAILED) != 0 or f.body_length != 0 or f.msg_id == 0:
            error[0] = "malformed CHUNK_DONE frame"
            return -1
    elif f.type == F_CREDIT or f.type == F_CLOSE:
        if f.flags != 0 or f.body_length != 0 or f.msg_id != 0 or f.aux != 0:
            error[0] = "malformed control frame"
            return -1
    elif f.type == F_PING or f.type == F_PONG:
        if f.flags != 0 or f.body_length != 0 or f.aux != 0:
            error[0] = "malformed PING/PONG frame"
            return -1
    elif f.type == F_POST:
        if (f.flags & ~POST_WITHDRAW) != 0 or f.msg_id == 0 or f.aux != 0:
            error[0] = "malformed POST frame"
            return -1
        if f.flags & POST_WITHDRAW:
            if f.body_length != 0:
                error[0] = "malformed POST frame"
                return -1
        else:
            if f.body_length < POST_FIXED:
                error[0] = "malformed POST frame"
                return -1
            f.raddr = rd64(b)
            f.cap = rd64(b + 8)
            f.rkey_len = rd16(b + 16)
            f.rkey = b + POST_FIXED
            if (rd16(b + 18) != 0 or rd32(b + 20) != 0 or f.rkey_len > MAX_RKEY
                    or f.body_length != POST_FIXED + f.rkey_len or f.cap == 0):
                error[0] = "malformed POST frame"
                return -1
    elif f.type == F_PUT:
        if (f.flags & ~PUT_DECLINED) != 0 or f.msg_id == 0 or f.aux != 0:
            error[0] = "malformed PUT frame"
            return -1
        if f.flags & PUT_DECLINED:
            if f.body_length != 0:
                error[0] = "malformed PUT frame"
                return -1
        else:
            if f.body_length != PUT_BODY:
                error[0] = "malformed PUT frame"
                return -1
            f.total = rd64(b)
            if f.total == 0:
                error[0] = "malformed PUT frame"
                return -1
    elif f.type == F_HELLO:
        if f.flags != 0 or f.body_length != HELLO_BODY or f.msg_id != 0 or f.aux != 0:
            error[0] = "malformed HELLO frame"
            return -1
        f.hello_max_recv = rd32(b)
        f.hello_credits = rd32(b + 4)
        f.hello_max_message = rd64(b + 8)
        f.hello_max_rendezvous = rd32(b + 16)
        f.hello_max_chunks = rd32(b + 20)
        f.hello_features = rd32(b + 24)
        if rd32(b + 28) != 0:
            error[0] = "malformed HELLO frame"
            return -1
    else:
        error[0] = "unknown frame type"
        return -1
    return FRAME_HEADER + f.body_length
