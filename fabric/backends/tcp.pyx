# cython: language_level=3
"""The TCP fabric: non-blocking sockets, TCP_NODELAY, IPv4 and IPv6.

Wire format below the engine (little-endian, 16-byte header):

    u8 magic 0xFA | u8 kind | u16 zero | u32 length | u64 ident

    MSG        ident 0, `length` bytes of one fabric message follow
               (at most the receiver's max_recv, else the connection closes).
    READ_REQ   ident = request id, 24 bytes follow: u64 addr, u64 length, u64 key.
    READ_RESP  ident = request id, exactly the requested bytes follow.
    READ_ERR   ident = request id, 4 bytes follow: u32 errno of the refusal.
    WRITE      ident = key, `length` = 8 + n bytes follow: u64 addr, then n
               bytes for [addr, addr + n) of a region registered for the
               peer to write (FAB_REG_WRITE: a posted receive buffer).

With TLS (Fabric("tcp", ssl=...), fabric/backends/tls.pyx) the same bytes
run inside a TLS session on the socket.

One-sided read is emulated: the reader sends READ_REQ, the owner's backend
checks the key and range against the regions registered *on this connection*
and answers from the registered memory with one sendmsg (header + region, no
copy); the reader receives the payload straight into the destination. A key is
valid only on the connection it was registered on and only until dereg().
Once every byte of a region has been written in answers, the owner's engine
hears FAB_EV_SERVED (FAB_CAP_READS_SERVED) and completes the send then, at its
last byte written, as sendall would, without waiting for the reader's
CHUNK_DONE; it deregisters the region at that point.

One-sided write is emulated the other way round: the writer sends WRITE with
the bytes right behind its header (from the caller's buffer, no copy); the
owner checks key and range against the regions it registered for the peer to
write and receives the payload straight into the region. A write outside
them fails the connection. A region deregistered while its write is still
arriving takes no more bytes (the rest is discarded). Writes and messages
share one stream, so a message sent after a write arrives after its bytes
(FAB_CAP_ORDERED_WRITE).
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcpy, memmove, memset, strlen
from posix.uio cimport iovec
from cpython.bytes cimport PyBytes_AsString
from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.stdint cimport uintptr_t

from fabric._posix cimport *
from fabric._bytes cimport wr32, wr64, rd32, rd64
from fabric.backends.interface cimport *
from fabric.backends.sockets cimport (accept_socket, listen_socket,
                                     local_and_peer_names, tune_socket)
from fabric.backends.tls cimport fab_tls_ops

cdef extern from *:
    """
    #include <errno.h>
    static inline void fab_set_errno(int e) { errno = e; }
    """
    void set_errno "fab_set_errno"(int e) noexcept nogil

cdef enum:
    EKEYREJECTED_ = 129        # a TLS certificate was refused
    HDR = 16
    MAGIC = 0xFA
    # Answers to the peer's read requests waiting for socket space. A peer
    # that sends requests but never reads the answers would make this queue
    # (about 200 bytes each) grow without bound; legitimate readers have a
    # few chunks per message in flight.
    QUEUED_ANSWERS_MAX = 16384
    K_MSG = 1
    K_READ_REQ = 2
    K_READ_RESP = 3
    K_READ_ERR = 4
    K_WRITE = 5
    WRITE_FIXED = 8
    MAX_IOV = 64
    INLINE_IOV = 8
    DISCARD = 65536
    NOTIFY_SERVED = 2
    NOTIFY_WRITE = 3

cdef struct tcp_send:
    tcp_send* next
    uint64_t ctx
    int notify                 # report FAB_EV_SEND with ctx when sent (NOTIFY_SERVED: FAB_EV_SERVED)
    int answer                 # an answer to the peer's read request
    uint64_t region_key        # ... from this registered region (0: none, or copied out)
    char* owned                # ... its unsent bytes, copied when the region was deregistered
    int iovcnt
    int iovpos
    iovec* iov
    iovec iov_inline[INLINE_IOV]
    uint8_t hdr[HDR + 24]

cdef struct tcp_read:
    tcp_read* next
    uint64_t ident
    uint64_t ctx
    char* dst
    size_t length
    int canceled
    uint64_t region_key        # an incoming write: the region it lands in (else 0)

cdef struct tcp_region:
    uint64_t key               # 0: slot free
    char* addr
    size_t length
    size_t served              # bytes of it written in answers to the peer's reads
    int access                 # FAB_REG_LOCAL / FAB_REG_READ / FAB_REG_WRITE
    uint64_t mr_ctx            # the engine's fab_mr* (FAB_EV_SERVED), 0 once reported or local-only

cdef struct tcp_chan:
    fab_channel base
    char* rbuf
    size_t rcap
    size_t rpos
    size_t rlen
    tcp_read* cur_read         # READ_RESP (or WRITE) payload being received into its dst
    tcp_read write_in          # the incoming WRITE (cur_read points here while it arrives)
    size_t cur_done
    char* discard
    tcp_send* sq_head
    tcp_send* sq_tail
    tcp_send* done_head        # finished sends whose completion is not yet polled
    tcp_send* done_tail
    tcp_read* reads
    uint64_t next_read
    tcp_region* regions
    uint32_t* free_slots
    uint32_t nregions
    uint32_t nfree
    uint32_t key_salt
    uint32_t key_gen
    uint32_t answers           # queued answers to read requests (QUEUED_ANSWERS_MAX)
    uint32_t answers_max       # the most there ever were (fuzzing checks the bound)
    fab_tls_ops* tls_ops       # TLS: the session's functions and state, else NULL
    void* tls


# Per-Fabric state when the Fabric runs TLS (else the domain is NULL).
cdef struct tcp_domain:
    fab_tls_ops* ops
    void* server_ctx           # OpenSSL contexts (a reference each), or NULL
    void* client_ctx
    int check_hostname         # the client context checks host names
    int refs                   # the Fabric and each listener (atomic)


cdef void tcp_domain_unref(tcp_domain* d) noexcept nogil:
    if d != NULL and domain_unref_last(&d.refs):
        if d.server_ctx != NULL:
            d.ops.ctx_free(d.server_ctx)
        if d.client_ctx != NULL:
            d.ops.ctx_free(d.client_ctx)
        free(d)


cdef ssize_t tls_result(tcp_chan* c, ssize_t r, const char* text) noexcept nogil:
    """r from a TLS session call; when it failed (not a wait), the channel
    fails with the session's whole reason (a refused certificate as
    EKEYREJECTED, which the engine reports as an AuthenticationError; a
    reset stays a reset). errno stays for the caller."""
    cdef int err = errno
    if r < 0 and err != EAGAIN and text[0]:
        fab_fail_saying(&c.base, err if err in (EKEYREJECTED_, ECONNRESET, EPIPE) else EPROTO, text)
        set_errno(err)
    return r


cdef ssize_t io_sendv(tcp_chan* c, iovec* iov, int cnt) noexcept nogil:
    """sendmsg on the socket or in the TLS session: bytes taken, or -1 with
    errno (a TLS failure has failed the channel with its reason already)."""
    cdef msghdr mh
    cdef char text[FAB_ERROR_TEXT]
    if c.tls != NULL:
        text[0] = 0
        return tls_result(c, c.tls_ops.sendv(c.tls, iov, cnt, text, FAB_ERROR_TEXT), text)
    memset(&mh, 0, sizeof(mh))
    mh.msg_iov = iov
    mh.msg_iovlen = cnt
    return sendmsg(c.base.fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL)


cdef ssize_t io_recv(tcp_chan* c, char* buf, size_t n) noexcept nogil:
    """recv on the socket or in the TLS session (see io_sendv)."""
    cdef char text[FAB_ERROR_TEXT]
    if c.tls != NULL:
        text[0] = 0
        return tls_result(c, c.tls_ops.recv(c.tls, buf, n, text, FAB_ERROR_TEXT), text)
    return recv(c.base.fd, buf, n, MSG_DONTWAIT)


cdef fab_channel_ops TCP_OPS
TCP_OPS.send = tcp_send_msg
TCP_OPS.reg = tcp_reg
TCP_OPS.dereg = tcp_dereg
TCP_OPS.read = tcp_read_remote
TCP_OPS.write = tcp_write
TCP_OPS.send_large = NULL       # the engine's rendezvous is all there is
TCP_OPS.recv_large = NULL
TCP_OPS.cancel_read = tcp_cancel_read
TCP_OPS.poll = tcp_poll
TCP_OPS.arm = tcp_arm
TCP_OPS.close = tcp_close
TCP_OPS.recycle = NULL


cdef inline void make_header(uint8_t* h, int kind, uint32_t length, uint64_t ident) noexcept nogil:
    h[0] = MAGIC
    h[1] = <uint8_t>kind
    h[2] = 0
    h[3] = 0
    wr32(h + 4, length)
    wr64(h + 8, ident)


# ---------------------------------------------------------------- sending

cdef void advance_iov(tcp_send* s, size_t n) noexcept nogil:
    """Consume n sent bytes from the front of s's scatter list."""
    cdef iovec* v
    while n > 0 and s.iovpos < s.iovcnt:
        v = &s.iov[s.iovpos]
        if n >= v.iov_len:
            n -= v.iov_len
            s.iovpos += 1
        else:
            v.iov_base = <char*>v.iov_base + n
            v.iov_len -= n
            n = 0
    while s.iovpos < s.iovcnt and s.iov[s.iovpos].iov_len == 0:
        s.iovpos += 1


cdef tcp_send* new_send(iovec* iov, int cnt, uint64_t ctx, int notify) noexcept nogil:
    """A queued send owning a copy of the scatter list; the first entry of
    iov may point at a header, which is copied into the entry itself."""
    cdef tcp_send* s = <tcp_send*>calloc(1, sizeof(tcp_send))
    if s == NULL:
        return NULL
    if cnt <= INLINE_IOV:
        s.iov = s.iov_inline
    else:
        s.iov = <iovec*>malloc(cnt * sizeof(iovec))
        if s.iov == NULL:
            free(s)
            return NULL
    memcpy(s.iov, iov, cnt * sizeof(iovec))
    s.iovcnt = cnt
    s.ctx = ctx
    s.notify = notify
    return s


cdef void free_send(tcp_send* s) noexcept nogil:
    if s.iov != s.iov_inline:
        free(s.iov)
    free(s.owned)
    free(s)


cdef void fifo_push(tcp_send** head, tcp_send** tail, tcp_send* s) noexcept nogil:
    s.next = NULL
    if tail[0] == NULL:
        head[0] = s
    else:
        tail[0].next = s
    tail[0] = s


cdef inline void queue_send(tcp_chan* c, tcp_send* s) noexcept nogil:
    fifo_push(&c.sq_head, &c.sq_tail, s)


cdef int flush_sends(tcp_chan* c) noexcept nogil:
    """Write queued sends until the socket is full. 0, or -errno on failure."""
    cdef tcp_send* s
    cdef ssize_t r
    cdef int n
    while c.sq_head != NULL:
        s = c.sq_head
        if s.iovpos >= s.iovcnt:
            c.sq_head = s.next
            if c.sq_head == NULL:
                c.sq_tail = NULL
            if s.answer:
                c.answers -= 1
                if s.region_key != 0 and answer_served(c, s):
                    fifo_push(&c.done_head, &c.done_tail, s)
                    continue
            if s.notify:
                fifo_push(&c.done_head, &c.done_tail, s)
            else:
                free_send(s)
            continue
        n = s.iovcnt - s.iovpos
        if n > MAX_IOV:
            n = MAX_IOV
        r = io_sendv(c, &s.iov[s.iovpos], n)
        if r < 0:
            if errno == EAGAIN:
                return 0
            if errno == EINTR:
                continue
            return fab_fail(&c.base, errno, "send failed")
        advance_iov(s, <size_t>r)
        c.base.activity += 1
    return 0


cdef bint answer_served(tcp_chan* c, tcp_send* s) noexcept nogil:
    """An answer from a live region was written: count its bytes; when the
    whole region has gone, turn s into the region's FAB_EV_SERVED."""
    cdef uint32_t slot = <uint32_t>(s.region_key & 0xFFFFFFFFUL)
    cdef tcp_region* r
    if slot >= c.nregions or c.regions[slot].key != s.region_key:
        return 0
    r = &c.regions[slot]
    r.served += rd32(s.hdr + 4)      # the answer's length (its iov shrank as it went out)
    if r.served < r.length or r.mr_ctx == 0:
        return 0
    s.notify = NOTIFY_SERVED
    return 1


cdef int tcp_send_msg(fab_channel* ch, iovec* iov, fab_mr** mrs, int iovcnt, uint64_t ctx) noexcept nogil:
    cdef tcp_chan* c = <tcp_chan*>ch
    cdef iovec v[MAX_IOV + 1]
    cdef uint8_t hdr[HDR]
    cdef size_t total = 0
    cdef int i
    cdef ssize_t r
    cdef tcp_send* s
    if ch.failed:
        return -ch.failed
    if iovcnt >= MAX_IOV:         # with the header: at most MAX_IOV entries (flush_sends' limit)
        return -EINVAL
    for i in range(iovcnt):
        total += iov[i].iov_len
        v[i + 1] = iov[i]
    if total > 0xFFFFFFFFUL:
        return -EMSGSIZE
    make_header(hdr, K_MSG, <uint32_t>total, 0)
    v[0].iov_base = hdr
    v[0].iov_len = HDR
    r = 0
    if c.sq_head == NULL:
        while True:
            r = io_sendv(c, v, iovcnt + 1)
            if r >= 0 or errno != EINTR:
                break
        if r == <ssize_t>(total + HDR):
            return FAB_DONE
        if r < 0:
            if errno != EAGAIN:
                return fab_fail(ch, errno, "send failed")
            r = 0
    s = new_send(v, iovcnt + 1, ctx, 1)
    if s == NULL:
        return fab_fail(ch, ENOMEM, "send queue")
    memcpy(s.hdr, hdr, HDR)
    s.iov[0].iov_base = s.hdr
    advance_iov(s, <size_t>r)
    queue_send(c, s)
    return FAB_PENDING


# ------------------------------------------------------------ registration

cdef int tcp_reg(fab_channel* ch, void* addr, size_t length, fab_mr* mr, int remote) noexcept nogil:
    cdef tcp_chan* c = <tcp_chan*>ch
    cdef uint32_t slot
    cdef tcp_region* grown
    cdef uint32_t* grown_free
    cdef uint32_t n, i
    if ch.failed:
        return -ch.failed
    if c.nfree == 0:
        n = c.nregions * 2 if c.nregions else 16
        grown = <tcp_region*>realloc(c.regions, n * sizeof(tcp_region))
        if grown == NULL:
            return -ENOMEM
        c.regions = grown
        grown_free = <uint32_t*>realloc(c.free_slots, n * sizeof(uint32_t))
        if grown_free == NULL:
            return -ENOMEM
        c.free_slots = grown_free
        for i in range(c.nregions, n):
            c.regions[i].key = 0
            c.free_slots[c.nfree] = n - 1 - (i - c.nregions)
            c.nfree += 1
        c.nregions = n
    c.nfree -= 1
    slot = c.free_slots[c.nfree]
    c.key_gen += 1
    # The high half changes with every registration, so a key stays valid
    # only until its region is deregistered, even if the slot is reused. (It
    # is odd, so never 0; an earlier `(gen ^ salt) | 1` gave two consecutive
    # registrations of a slot the same key half of the time.)
    c.regions[slot].key = ((<uint64_t>(((c.key_gen << 1) | 1) ^ (c.key_salt & ~1U))) << 32) | slot
    c.regions[slot].addr = <char*>addr
    c.regions[slot].length = length
    c.regions[slot].served = 0
    c.regions[slot].mr_ctx = <uint64_t><size_t>mr if remote == FAB_REG_READ else 0
    c.regions[slot].access = remote
    mr.handle = <void*><size_t>slot
    ch.live_regions += 1
    mr.addr = <uint64_t><size_t>addr
    mr.length = length
    mr.rkey_len = 8
    wr64(mr.rkey, c.regions[slot].key)
    return FAB_DONE


cdef void detach_answers(tcp_chan* c, uint64_t key) noexcept nogil:
    """The region of `key` goes back to the application: answers still queued
    from it take a copy of their unsent bytes (else they would send whatever
    the memory holds by then, after the message completed)."""
    cdef tcp_send* s = c.sq_head
    cdef iovec* v
    while s != NULL:
        if s.answer and s.region_key == key:
            s.region_key = 0
            if s.iovcnt == 2 and s.iovpos <= 1 and s.iov[1].iov_len > 0:
                v = &s.iov[1]
                s.owned = <char*>malloc(v.iov_len)
                if s.owned == NULL:
                    fab_fail(&c.base, ENOMEM, "copying an answer out of a released region")
                    return
                memcpy(s.owned, v.iov_base, v.iov_len)
                v.iov_base = s.owned
        s = s.next


cdef void tcp_dereg(fab_channel* ch, fab_mr* mr) noexcept nogil:
    cdef tcp_chan* c = <tcp_chan*>ch
    cdef uint32_t slot = <uint32_t><size_t>mr.handle
    if slot < c.nregions and c.regions[slot].key != 0:
        detach_answers(c, c.regions[slot].key)
        if c.cur_read == &c.write_in and c.write_in.region_key == c.regions[slot].key:
            c.write_in.canceled = 1       # the rest of that write goes nowhere
        ch.live_regions -= 1
        c.regions[slot].key = 0
        c.free_slots[c.nfree] = slot
        c.nfree += 1


cdef tcp_region* find_region(tcp_chan* c, uint64_t key, uint64_t addr, uint64_t length,
                             int access) noexcept nogil:
    """The live region of `key` registered for `access` by the peer that
    holds [addr, addr + length), or NULL."""
    cdef uint32_t slot = <uint32_t>(key & 0xFFFFFFFFUL)
    cdef tcp_region* r
    if key == 0 or slot >= c.nregions:
        return NULL
    r = &c.regions[slot]
    if r.key != key or r.access != access:
        return NULL
    if addr < <uint64_t><size_t>r.addr or length > r.length:
        return NULL
    if addr - <uint64_t><size_t>r.addr > r.length - length:
        return NULL
    return r


cdef int serve_read(tcp_chan* c, const uint8_t* h, const uint8_t* body) noexcept nogil:
    """Answer a peer's READ_REQ from a region registered on this connection."""
    cdef uint64_t ident = rd64(h + 8)
    cdef uint64_t addr = rd64(body)
    cdef uint64_t length = rd64(body + 8)
    cdef uint64_t key = rd64(body + 16)
    cdef tcp_region* r = find_region(c, key, addr, length, FAB_REG_READ)
    cdef iovec v[2]
    cdef tcp_send* s
    cdef int cnt
    if c.answers >= QUEUED_ANSWERS_MAX:
        return fab_fail(&c.base, EPROTO, "peer sends read requests without taking the answers "
                                         "(more than 16384 queued)")
    if r == NULL or length > 0xFFFFFFFFUL:
        v[0].iov_base = NULL
        v[0].iov_len = HDR + 4
        cnt = 1
    else:
        v[0].iov_base = NULL
        v[0].iov_len = HDR
        v[1].iov_base = <void*><size_t>addr
        v[1].iov_len = <size_t>length
        cnt = 2
    s = new_send(v, cnt, 0, 0)
    if s == NULL:
        return fab_fail(&c.base, ENOMEM, "read service")
    if cnt == 1:
        make_header(s.hdr, K_READ_ERR, 4, ident)
        wr32(s.hdr + HDR, 13)  # EACCES
    else:
        make_header(s.hdr, K_READ_RESP, <uint32_t>length, ident)
    s.iov[0].iov_base = s.hdr
    s.answer = 1
    if cnt == 2:
        s.region_key = key
    c.answers += 1
    if c.answers > c.answers_max:
        c.answers_max = c.answers
    queue_send(c, s)
    return 0


# ---------------------------------------------------------------- writing

cdef int tcp_write(fab_channel* ch, void* src, fab_mr* src_mr, size_t length, uint64_t raddr,
                   uint8_t* rkey, uint32_t rkey_len, uint64_t ctx) noexcept nogil:
    """WRITE header and the caller's bytes in one sendmsg; FAB_DONE when the
    socket took all of it (only when nothing was queued before it, so writes
    complete in order), else queued and reported as FAB_EV_WRITE."""
    cdef tcp_chan* c = <tcp_chan*>ch
    cdef iovec v[2]
    cdef uint8_t hdr[HDR + WRITE_FIXED]
    cdef ssize_t r = 0
    cdef tcp_send* s
    if ch.failed:
        return -ch.failed
    if rkey_len != 8 or length == 0 or length > 0xFFFFFFFFUL - WRITE_FIXED:
        return -EINVAL
    make_header(hdr, K_WRITE, <uint32_t>(length + WRITE_FIXED), rd64(rkey))
    wr64(hdr + HDR, raddr)
    v[0].iov_base = hdr
    v[0].iov_len = HDR + WRITE_FIXED
    v[1].iov_base = src
    v[1].iov_len = length
    if c.sq_head == NULL:
        while True:
            r = io_sendv(c, v, 2)
            if r >= 0 or errno != EINTR:
                break
        if r == <ssize_t>(length + HDR + WRITE_FIXED):
            ch.activity += 1
            return FAB_DONE
        if r < 0:
            if errno != EAGAIN:
                return fab_fail(ch, errno, "send failed")
            r = 0
    s = new_send(v, 2, ctx, NOTIFY_WRITE)
    if s == NULL:
        return fab_fail(ch, ENOMEM, "send queue")
    memcpy(s.hdr, hdr, HDR + WRITE_FIXED)
    s.iov[0].iov_base = s.hdr
    advance_iov(s, <size_t>r)
    queue_send(c, s)
    return FAB_PENDING


cdef int begin_write_in(tcp_chan* c, const uint8_t* h) noexcept nogil:
    """A WRITE header and its address are buffered: check them against the
    regions registered for the peer to write, and receive the payload into
    the region from here on. -1 (the channel failed) if it is not allowed."""
    cdef uint64_t key = rd64(h + 8)
    cdef uint64_t addr = rd64(h + HDR)
    cdef uint64_t n = <uint64_t>rd32(h + 4) - WRITE_FIXED
    cdef size_t take
    if find_region(c, key, addr, n, FAB_REG_WRITE) == NULL:
        fab_fail(&c.base, EPROTO, "peer wrote outside the buffers posted to it")
        return -1
    c.rpos += HDR + WRITE_FIXED
    memset(&c.write_in, 0, sizeof(tcp_read))
    c.write_in.dst = <char*><size_t>addr
    c.write_in.length = <size_t>n
    c.write_in.region_key = key
    take = c.rlen - c.rpos
    if take > n:
        take = <size_t>n
    memcpy(c.write_in.dst, c.rbuf + c.rpos, take)
    c.rpos += take
    c.cur_read = &c.write_in
    c.cur_done = take
    return 0


# ---------------------------------------------------------------- reading

cdef int tcp_read_remote(fab_channel* ch, void* dst, fab_mr* dst_mr, size_t length, uint64_t raddr,
                         uint8_t* rkey, uint32_t rkey_len, uint64_t ctx) noexcept nogil:
    cdef tcp_chan* c = <tcp_chan*>ch
    cdef tcp_read* rd
    cdef iovec v
    cdef tcp_send* s
    if ch.failed:
        return -ch.failed
    if rkey_len != 8 or length > 0xFFFFFFFFUL:
        return -EINVAL
    rd = <tcp_read*>calloc(1, sizeof(tcp_read))
    if rd == NULL:
        return fab_fail(ch, ENOMEM, "read")
    c.next_read += 1
    rd.ident = c.next_read
    rd.ctx = ctx
    rd.dst = <char*>dst
    rd.length = length
    rd.next = c.reads
    c.reads = rd
    v.iov_base = NULL
    v.iov_len = HDR + 24
    s = new_send(&v, 1, 0, 0)
    if s == NULL:
        return fab_fail(ch, ENOMEM, "read")
    make_header(s.hdr, K_READ_REQ, 24, rd.ident)
    wr64(s.hdr + HDR, raddr)
    wr64(s.hdr + HDR + 8, length)
    memcpy(s.hdr + HDR + 16, rkey, 8)
    s.iov[0].iov_base = s.hdr
    queue_send(c, s)
    if flush_sends(c) < 0:
        return -ch.failed
    return FAB_PENDING


cdef tcp_read* take_read(tcp_chan* c, uint64_t ident) noexcept nogil:
    cdef tcp_read** p = &c.reads
    cdef tcp_read* r
    while p[0] != NULL:
        r = p[0]
        if r.ident == ident:
            p[0] = r.next
            r.next = NULL
            return r
        p = &r.next
    return NULL


cdef int tcp_cancel_read(fab_channel* ch, uint64_t ctx) noexcept nogil:
    # Emulated reads can always be cancelled at once: any payload still to
    # come is received into a discard buffer instead of dst.
    cdef tcp_chan* c = <tcp_chan*>ch
    cdef tcp_read* r = c.reads
    while r != NULL:
        if r.ctx == ctx:
            r.canceled = 1
            return 0
        r = r.next
    if c.cur_read != NULL and c.cur_read.ctx == ctx:
        c.cur_read.canceled = 1
    return 0


# ---------------------------------------------------------------- polling

cdef int emit(fab_completion* out, int n, int kind, int status, uint64_t ctx,
              char* data, size_t length) noexcept nogil:
    out[n].kind = kind
    out[n].status = status
    out[n].ctx = ctx
    out[n].data = data
    out[n].length = length
    return n + 1


cdef int emit_served(tcp_chan* c, tcp_send* s, fab_completion* out, int n) noexcept nogil:
    """FAB_EV_SERVED for the region s answered from, if that registration is
    still live and was not reported yet (a region deregistered and its slot
    reused meanwhile has another key: nothing is reported for it)."""
    cdef uint32_t slot = <uint32_t>(s.region_key & 0xFFFFFFFFUL)
    cdef uint64_t ctx
    if slot >= c.nregions or c.regions[slot].key != s.region_key or c.regions[slot].mr_ctx == 0:
        return n
    ctx = c.regions[slot].mr_ctx
    c.regions[slot].mr_ctx = 0
    return emit(out, n, FAB_EV_SERVED, 0, ctx, NULL, 0)


cdef int recv_payload(tcp_chan* c, fab_completion* out, int n) noexcept nogil:
    """Continue receiving the current READ_RESP payload straight into its
    destination. Returns the new event count, or -1 if the socket is empty."""
    cdef tcp_read* r = c.cur_read
    cdef ssize_t got
    cdef size_t want = r.length - c.cur_done
    cdef char* target
    while want > 0:
        if r.canceled:
            target = c.discard
            if want > DISCARD:
                want = DISCARD
        else:
            target = r.dst + c.cur_done
        got = io_recv(c, target, want)
        if got == 0:
            fab_fail(&c.base, ECONNRESET, "peer closed the connection during a read")
            return n
        if got < 0:
            if errno == EINTR:
                continue
            if errno == EAGAIN:
                return -1
            fab_fail(&c.base, errno, "recv failed")
            return n
        c.cur_done += <size_t>got
        c.base.activity += 1
        want = r.length - c.cur_done
    c.cur_read = NULL
    if r == &c.write_in:
        return n                  # an incoming write: nothing to report
    if not r.canceled:
        n = emit(out, n, FAB_EV_READ, 0, r.ctx, NULL, r.length)
    free(r)
    return n


cdef int emit_done(tcp_chan* c, fab_completion* out, int n, int max_events) noexcept nogil:
    """Report written sends (as many as out holds; the rest wait for the next
    poll, which tcp_arm then asks for at once)."""
    cdef tcp_send* s
    while c.done_head != NULL and n < max_events:
        s = c.done_head
        c.done_head = s.next
        if c.done_head == NULL:
            c.done_tail = NULL
        if s.notify == NOTIFY_SERVED:
            n = emit_served(c, s, out, n)
        elif s.notify == NOTIFY_WRITE:
            n = emit(out, n, FAB_EV_WRITE, 0, s.ctx, NULL, 0)
        else:
            n = emit(out, n, FAB_EV_SEND, 0, s.ctx, NULL, 0)
        free_send(s)
    return n


cdef int tcp_poll(fab_channel* ch, fab_completion* out, int max_events) noexcept nogil:
    cdef tcp_chan* c = <tcp_chan*>ch
    cdef int n = 0
    cdef int kind, r2
    cdef int emitted_recv = 0
    cdef uint8_t* h
    cdef uint32_t length
    cdef size_t avail, take
    cdef ssize_t got
    cdef tcp_read* rd
    if ch.failed:
        return emit(out, 0, FAB_EV_FAILED, -ch.failed, 0, NULL, 0)
    if flush_sends(c) < 0:
        return emit(out, n, FAB_EV_FAILED, -ch.failed, 0, NULL, 0)
    # Completed sends first, this flush's included: they free the engine's
    # buffers and its send depth (a send that waits for them may go now).
    n = emit_done(c, out, n, max_events)
    # Data handed out by the previous poll() is no longer referenced: compact.
    if c.rpos > 0:
        if c.rlen > c.rpos:
            memmove(c.rbuf, c.rbuf + c.rpos, c.rlen - c.rpos)
        c.rlen -= c.rpos
        c.rpos = 0
    while n < max_events and not ch.failed:
        if c.cur_read != NULL:
            r2 = recv_payload(c, out, n)
            if r2 < 0:
                break
            n = r2
            continue
        avail = c.rlen - c.rpos
        if avail >= HDR:
            h = <uint8_t*>c.rbuf + c.rpos
            kind = h[1]
            length = rd32(h + 4)
            if h[0] != MAGIC or h[2] != 0 or h[3] != 0 or kind < K_MSG or kind > K_WRITE:
                fab_fail(ch, EPROTO, "malformed frame from peer (bad TCP fabric header)")
                break
            if kind == K_MSG:
                if length > ch.max_recv:
                    fab_fail(ch, EPROTO, "peer sent a fabric message larger than this endpoint accepts")
                    break
                if avail >= HDR + length:
                    n = emit(out, n, FAB_EV_RECV, 0, 0, c.rbuf + c.rpos + HDR, length)
                    c.rpos += HDR + length
                    emitted_recv = 1
                    continue
            elif kind == K_READ_REQ:
                if length != 24 or rd64(h + 8) == 0:
                    fab_fail(ch, EPROTO, "malformed read request from peer")
                    break
                if avail >= HDR + 24:
                    if serve_read(c, h, h + HDR) < 0:
                        break
                    c.rpos += HDR + 24
                    continue
            elif kind == K_READ_ERR:
                if length != 4:
                    fab_fail(ch, EPROTO, "malformed read error from peer")
                    break
                if avail >= HDR + 4:
                    rd = take_read(c, rd64(h + 8))
                    if rd == NULL:
                        fab_fail(ch, EPROTO, "peer answered a read that was not requested")
                        break
                    if not rd.canceled:
                        n = emit(out, n, FAB_EV_READ, -<int>rd32(h + HDR), rd.ctx, NULL, 0)
                    free(rd)
                    c.rpos += HDR + 4
                    continue
            elif kind == K_WRITE:
                if length <= WRITE_FIXED:
                    fab_fail(ch, EPROTO, "malformed write from peer")
                    break
                if avail >= HDR + WRITE_FIXED:
                    if begin_write_in(c, h) < 0:
                        break
                    continue
            else:  # K_READ_RESP: payload goes straight to the read's destination
                rd = take_read(c, rd64(h + 8))
                if rd == NULL or rd.length != length:
                    if rd != NULL:
                        free(rd)
                    fab_fail(ch, EPROTO, "peer answered a read that was not requested (or with a wrong length)")
                    break
                c.rpos += HDR
                take = c.rlen - c.rpos
                if take > length:
                    take = length
                if take and not rd.canceled:
                    memcpy(rd.dst, c.rbuf + c.rpos, take)
                c.rpos += take
                c.cur_read = rd
                c.cur_done = take
                continue
        # Need more bytes. Make room only if no data handed out in this call
        # lives in the buffer (it is valid until the next poll()).
        if c.rpos > 0 and not emitted_recv:
            memmove(c.rbuf, c.rbuf + c.rpos, c.rlen - c.rpos)
            c.rlen -= c.rpos
            c.rpos = 0
        elif c.rlen == c.rcap:
            break
        got = io_recv(c, c.rbuf + c.rlen, c.rcap - c.rlen)
        if got > 0:
            c.rlen += <size_t>got
            ch.activity += 1
            continue
        if got == 0:
            fab_fail(ch, ECONNRESET, "peer closed the connection")
            break
        if errno == EINTR:
            continue
        if errno == EAGAIN:
            break
        fab_fail(ch, errno, "recv failed")
    if c.tls != NULL and c.sq_head != NULL and not ch.failed and c.tls_ops.handshaken(c.tls):
        # The handshake may have finished in this poll's reads, after the
        # flush above found it unfinished: what waited for it goes now. The
        # peer's first message may already have opened the endpoint, and a
        # caller without a progress thread may not poll again.
        if flush_sends(c) < 0 and n < max_events:
            return emit(out, n, FAB_EV_FAILED, -ch.failed, 0, NULL, 0)
        n = emit_done(c, out, n, max_events)
    if ch.failed and n < max_events:
        n = emit(out, n, FAB_EV_FAILED, -ch.failed, 0, NULL, 0)
    return n


cdef int tcp_arm(fab_channel* ch, uint32_t* events) noexcept nogil:
    cdef tcp_chan* c = <tcp_chan*>ch
    cdef uint8_t* h
    cdef uint32_t length
    cdef size_t avail = c.rlen - c.rpos
    if ch.failed or c.done_head != NULL:
        return 1
    if c.cur_read == NULL and avail >= HDR:
        # A complete frame is buffered: progress is possible without the socket.
        h = <uint8_t*>c.rbuf + c.rpos
        length = rd32(h + 4)
        if (h[1] == K_READ_RESP or avail >= HDR + <size_t>length
                or (h[1] == K_WRITE and avail >= HDR + WRITE_FIXED)):
            return 1
    if c.tls != NULL:
        if c.tls_ops.pending(c.tls):
            return 1              # decrypted bytes wait in the session, not in the socket
        # queued data waits for the handshake: until then only the session's wants count
        events[0] = EPOLLIN | (EPOLLOUT if c.tls_ops.want_write(c.tls) or
                               (c.sq_head != NULL and c.tls_ops.handshaken(c.tls)) else 0)
        return 0
    events[0] = EPOLLIN | (EPOLLOUT if c.sq_head != NULL else 0)
    return 0


cdef void tcp_close(fab_channel* ch) noexcept nogil:
    cdef tcp_chan* c = <tcp_chan*>ch
    cdef tcp_send* s
    cdef tcp_read* r
    if c.tls != NULL:
        c.tls_ops.free(c.tls)
        c.tls = NULL
    if ch.fd >= 0:
        close(ch.fd)
        ch.fd = -1
    while c.sq_head != NULL:
        s = c.sq_head
        c.sq_head = s.next
        free_send(s)
    while c.done_head != NULL:
        s = c.done_head
        c.done_head = s.next
        free_send(s)
    while c.reads != NULL:
        r = c.reads
        c.reads = r.next
        free(r)
    if c.cur_read != NULL and c.cur_read != &c.write_in:
        free(c.cur_read)
    free(c.rbuf)
    free(c.discard)
    free(c.regions)
    free(c.free_slots)
    free(c)


# ------------------------------------------------------- connection set-up

cdef fab_channel* new_channel(int fd, size_t max_recv) noexcept nogil:
    cdef tcp_chan* c = <tcp_chan*>calloc(1, sizeof(tcp_chan))
    cdef uint32_t salt = 0
    if c == NULL:
        return NULL
    c.base.ops = &TCP_OPS
    c.base.fd = fd
    c.base.caps = (FAB_CAP_SEND_ANY_MEMORY | FAB_CAP_READ_ANY_MEMORY | FAB_CAP_SEND_COPIES
                   | FAB_CAP_ORDERED_CLOSE | FAB_CAP_READS_SERVED | FAB_CAP_ORDERED_WRITE)
    c.base.max_recv = max_recv
    c.base.send_depth = 1
    c.rcap = max_recv + HDR + 4096
    if c.rcap < 65536:
        c.rcap = 65536
    c.rbuf = <char*>malloc(c.rcap)
    c.discard = <char*>malloc(DISCARD)
    if c.rbuf == NULL or c.discard == NULL:
        free(c.rbuf)
        free(c.discard)
        free(c)
        return NULL
    getrandom(&salt, sizeof(salt), 0)
    c.key_salt = salt
    local_and_peer_names(fd, c.base.local_name, c.base.peer_name, 64)
    return &c.base


cdef struct tcp_lst:
    fab_listener base
    int user_timeout_ms
    int keepalive_s
    tcp_domain* tls            # with a server context: accepted channels run TLS


cdef int tcp_accept(fab_listener* lst) noexcept nogil:
    cdef tcp_lst* l = <tcp_lst*>lst
    cdef int fd = accept_socket(lst.fd)
    if fd >= 0:
        tune_socket(fd, l.user_timeout_ms, l.keepalive_s)
    return fd


cdef fab_channel* tcp_accepted(fab_listener* lst, int fd, size_t max_recv) noexcept nogil:
    cdef tcp_lst* l = <tcp_lst*>lst
    return channel_on(fd, max_recv, l.tls, 1, NULL)


cdef void tcp_close_listener(fab_listener* lst) noexcept nogil:
    cdef tcp_lst* l = <tcp_lst*>lst
    if lst.fd >= 0:
        close(lst.fd)
    tcp_domain_unref(l.tls)
    free(lst)


cdef fab_channel* channel_on(int fd, size_t max_recv, tcp_domain* d, int server, const char* host) noexcept nogil:
    """A channel on a connected socket, in a TLS session when the Fabric
    runs TLS (owns fd: closes it on failure)."""
    cdef fab_channel* ch = new_channel(fd, max_recv)
    cdef tcp_chan* c
    if ch == NULL:
        close(fd)
        return NULL
    if d == NULL:
        return ch
    c = <tcp_chan*>ch
    c.tls_ops = d.ops
    c.tls = d.ops.start(d.server_ctx if server else d.client_ctx, fd, server, host,
                        0 if server else d.check_hostname, ch.error, FAB_ERROR_TEXT)
    if c.tls == NULL:
        ch.failed = EPROTO          # the first poll reports it, with the reason start() gave
    return ch


cdef fab_channel* tcp_attach(void* domain, int fd, size_t max_recv, uint32_t recv_depth,
                             const char* host) noexcept nogil:
    return channel_on(fd, max_recv, <tcp_domain*>domain, 0, host)


cdef class TcpDomain:
    """A Fabric's TLS state: the OpenSSL contexts of its ssl.SSLContexts."""
    cdef tcp_domain* d
    cdef readonly object contexts          # the SSLContexts, alive as long as the Fabric

    def __dealloc__(self):
        self.close()

    def close(self):
        if self.d != NULL:
            tcp_domain_unref(self.d)
            self.d = NULL


def _tls_error(what, side, domain):
    from fabric.errors import FabricError
    if (<TcpDomain>domain).d == NULL:
        return FabricError("the Fabric is closed")
    return FabricError(f"cannot {what}: this Fabric's ssl contexts include no {side} context "
                       f"(ssl.PROTOCOL_TLS_{side.upper()}); pass ssl=(server_context, client_context)")


cdef class TcpBackend(Backend):
    """TCP sockets; one-sided reads are emulated over the stream."""

    def __init__(self):
        self.name = "tcp"
        self.caps = (FAB_CAP_SEND_ANY_MEMORY | FAB_CAP_READ_ANY_MEMORY | FAB_CAP_SEND_COPIES
                     | FAB_CAP_ORDERED_CLOSE | FAB_CAP_READS_SERVED | FAB_CAP_ORDERED_WRITE)

    def default_options(self):
        # Over TCP a rendezvous costs one extra round trip and saves one copy at
        # the receiver; the copy is cheaper below ~64 KiB on loopback.
        return {"eager_limit": 65536, "chunk_size": 4 << 20, "chunks_in_flight": 2,
                "coalesce_limit": 65536 + 4096, "credits": 32}

    @staticmethod
    def available():
        return True, "sockets are always available"

    def open_domain_tls(self, dict options, ssl):
        """Fabric("tcp", ssl=context or (server_context, client_context)):
        listeners use the server context, connects the client context."""
        from fabric.errors import BackendUnavailable
        try:
            from fabric.backends import tls
        except ImportError as e:
            from fabric.backends import _build_config
            left_out = _build_config().get("tls")
            if left_out:
                raise BackendUnavailable(f"TLS is unavailable: not built into this installation: "
                                         f"{left_out}") from None
            # built, but its libssl.so.3 is not on this host (a wheel binds
            # to the OpenSSL 3 that Python's ssl module loads)
            raise BackendUnavailable(f"TLS is unavailable: the tls module cannot load ({e}); it needs "
                                     f"OpenSSL 3 (libssl.so.3), the library Python's ssl module uses") from None
        contexts = list(ssl) if isinstance(ssl, (list, tuple)) else [ssl]
        dom = TcpDomain.__new__(TcpDomain)
        cdef tcp_domain* d = <tcp_domain*>calloc(1, sizeof(tcp_domain))
        if d == NULL:
            raise MemoryError()
        d.refs = 1
        d.ops = <fab_tls_ops*>PyCapsule_GetPointer(tls.ops(), b"fabric.backends.tls.ops")
        (<TcpDomain>dom).d = d                 # from here on, close() releases what is taken
        (<TcpDomain>dom).contexts = tuple(contexts)
        for ctx in contexts:
            pointer, server, client, check = tls.context(ctx)
            if server and client and d.server_ctx == NULL and d.client_ctx == NULL and len(contexts) == 1:
                d.server_ctx = <void*><uintptr_t>pointer        # a generic context plays both roles
                d.client_ctx = <void*><uintptr_t>tls.context(ctx)[0]
                d.check_hostname = check
            elif server and d.server_ctx == NULL:
                d.server_ctx = <void*><uintptr_t>pointer
            elif client and d.client_ctx == NULL:
                d.client_ctx = <void*><uintptr_t>pointer
                d.check_hostname = check
            else:
                d.ops.ctx_free(<void*><uintptr_t>pointer)
                raise ValueError("ssl=: give one server and at most one client context "
                                 "(ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT)")
        return dom

    cdef fab_listener* listen(self, object domain, str host, int port, dict options) except NULL:
        cdef tcp_lst* l
        cdef tcp_domain* d = (<TcpDomain>domain).d if domain is not None else NULL
        if domain is not None and (d == NULL or d.server_ctx == NULL):
            raise _tls_error("listen with TLS", "server", domain)
        l = <tcp_lst*>calloc(1, sizeof(tcp_lst))
        if l == NULL:
            raise MemoryError()
        try:
            l.base.fd = listen_socket(host, port, l.base.address, 96)
        except BaseException:
            free(l)
            raise
        l.base.accept = tcp_accept
        l.base.attach = tcp_accepted
        l.base.close = tcp_close_listener
        l.user_timeout_ms = int(options.get("tcp_user_timeout_ms", 30000))
        l.keepalive_s = int(options.get("tcp_keepalive_s", 10))
        if d != NULL:
            domain_ref(&d.refs)
            l.tls = d
        return &l.base

    cdef int prepare_attach(self, object domain, dict options, fab_attach* out) except -1:
        cdef tcp_domain* d = (<TcpDomain>domain).d if domain is not None else NULL
        if domain is not None and (d == NULL or d.client_ctx == NULL):
            raise _tls_error("connect with TLS", "client", domain)
        out.attach = tcp_attach
        out.domain = d
        out.recv_depth = recv_depth_for(options)
        return 0


# ------------------------------------------------------------- fuzzing hook

MAX_QUEUED_ANSWERS = QUEUED_ANSWERS_MAX


def _fuzz_feed(bytes data, size_t max_recv):
    """Test-only (tests/fuzz): a tcp channel on one end of a socket pair
    receives `data` from the other end, then its EOF; the channel is polled
    until it fails. Returns what it delivered and how it ended."""
    import socket
    cdef fab_completion ev[32]
    cdef fab_channel* ch
    cdef tcp_chan* c
    cdef fab_mr mr
    cdef char region[4096]
    cdef int n, i, rounds = 0
    a, b = socket.socketpair()
    b.setblocking(False)
    ch = new_channel(a.detach(), max_recv)
    if ch == NULL:
        b.close()
        raise MemoryError()
    c = <tcp_chan*>ch
    tcp_reg(ch, region, sizeof(region), &mr, 1)
    out = {"recvs": 0, "recv_bytes": 0, "reads_answered": 0, "failed": 0, "error": "", "queued_max": 0}
    sent = 0
    shut = False
    try:
        while rounds < 100000:
            rounds += 1
            if sent < len(data):
                try:
                    sent += b.send(data[sent:sent + 65536])
                except BlockingIOError:
                    pass
            if sent == len(data) and not shut:
                b.shutdown(socket.SHUT_WR)
                shut = True
            n = tcp_poll(ch, ev, 32)
            for i in range(n):
                if ev[i].kind == FAB_EV_RECV:
                    out["recvs"] += 1
                    out["recv_bytes"] += ev[i].length
                    if ev[i].length > max_recv:
                        raise AssertionError("delivered a message larger than max_recv")
            try:
                while b.recv(65536):
                    out["reads_answered"] += 1
            except (BlockingIOError, ConnectionError):
                pass
            if ch.failed:
                out["failed"] = ch.failed
                out["error"] = ch.error.decode(errors="replace")
                break
        out["queued_max"] = c.answers_max
    finally:
        tcp_dereg(ch, &mr)
        tcp_close(ch)
        b.close()
    return out
