# cython: language_level=3
"""TEST-ONLY: an in-memory fabric whose every operation waits for the test.

Never a user-facing backend: it is not in fabric.backends.KNOWN, `auto` never
picks it, `python -m fabric info` does not list it. tests/test_memory_fabric.py
uses it to let hypothesis choose the interleavings of sends, pulls, credits,
CHUNK_DONE, CLOSE and failures that real fabrics rarely produce.

A MemoryLink is one connection: two channel ends ("sides" 0 and 1) in one
process, each attached to an engine Worker by Worker._attach_connected() on
an eventfd that stands for the connection. Nothing the engine posts moves on
its own. Every operation becomes a pending item, performed only when the test
calls deliver(id) or fail(id):

  send      posted by a side; its bytes stay in the engine's memory and are
            copied only when delivered (so an engine that reused a buffer
            before its completion corrupts the message, and the test sees it).
            Delivering it puts the bytes on the wire: an `arrive` item toward
            the peer and a `send_done` item (the local completion).
  arrive    the message reaching the peer: FAB_EV_RECV there.
  send_done FAB_EV_SEND at the sender.
  read      a one-sided pull from the peer's registered region, checked at
            delivery against the registrations the owner has then (a stale
            key or a range outside the region completes with -EACCES, like
            the tcp fabric's refused read).
  write     (FAB_CAP_ORDERED_WRITE) a one-sided write into the peer's region
            registered for it to write (a posted receive buffer). It goes
            on the wire in order with the side's sends: its bytes are taken
            from the engine's memory and placed in the peer's when it is
            delivered, and it completes (FAB_EV_WRITE) then; writes of a
            side complete in posting order. A stale key, a region the peer
            may not write, or a range outside it fails the owner's channel
            (as the tcp fabric does) and completes the write with -EACCES.
  eof       the peer's channel closed: this side's channel fails.

What the contract (interface.pxd) promises is kept, and nothing more: sends
(and writes) of one side go on the wire in posting order and arrive in that
order (only the oldest `send`/`write` and the oldest `arrive` of a direction
are deliverable);
send completions and reads complete in any order; with FAB_CAP_ORDERED_CLOSE
the eof travels in order behind the data, without it it may overtake it.

The fabric also checks the engine's side of the contract and records each
breach as a violation (MemoryLink.violations()): sends of unregistered memory
without FAB_CAP_SEND_ANY_MEMORY, reads into an unregistered destination
without FAB_CAP_READ_ANY_MEMORY, deregistering what is not registered,
messages larger than the receiver's max_recv, and (counted as overruns) more
messages arriving than the receiver has buffers posted: a buffer is busy from
its arrival until the poll after the one that returned it, since the data of
a FAB_EV_RECV stays valid until the next poll().
"""
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcpy, memset
from posix.uio cimport iovec

from fabric._posix cimport (eventfd, EFD_NONBLOCK, EFD_CLOEXEC, read, write, close, snprintf,
                            pthread_mutex_t, pthread_mutex_init, pthread_mutex_destroy,
                            pthread_mutex_lock, pthread_mutex_unlock, EPOLLIN, ECONNRESET,
                            EPROTO, EINVAL, ENOMEM)
from fabric._bytes cimport wr64, rd64
from fabric.backends.interface cimport *
from fabric.protocol.frame cimport frame_t, parse_frame, F_HELLO

cdef enum:
    IT_SEND = 1
    IT_ARRIVE = 2
    IT_SEND_DONE = 3
    IT_READ = 4
    IT_EOF = 5
    IT_WRITE = 6

cdef enum:
    EIO_ = 5
    EACCES_ = 13
    ENOBUFS_ = 105
    MAX_VIOLATIONS = 16
    VIOLATION_TEXT = 200

KIND_NAMES = {IT_SEND: "send", IT_ARRIVE: "arrive", IT_SEND_DONE: "send_done",
              IT_READ: "read", IT_EOF: "eof", IT_WRITE: "write"}

# The capabilities of a link unless the test asks for others: what a
# verbs-like fabric has, minus native large transfers (send_large/recv_large
# are not modelled).
DEFAULT_CAPS = FAB_CAP_NATIVE_READ | FAB_CAP_ORDERED_CLOSE
CAP_SEND_ANY_MEMORY = FAB_CAP_SEND_ANY_MEMORY
CAP_READ_ANY_MEMORY = FAB_CAP_READ_ANY_MEMORY
CAP_SEND_COPIES = FAB_CAP_SEND_COPIES
CAP_READS_SERVED = FAB_CAP_READS_SERVED
CAP_ORDERED_CLOSE = FAB_CAP_ORDERED_CLOSE
CAP_ORDERED_WRITE = FAB_CAP_ORDERED_WRITE


cdef struct mem_item:
    mem_item* prev
    mem_item* next
    uint64_t id
    int kind
    int side                   # the side it completes on (send/send_done/read: the poster)
    uint64_t ctx
    iovec* iov                 # send: the engine's scatter list (its memory, not copied yet)
    int iovcnt
    size_t length
    char* data                 # arrive: the bytes on the wire (owned)
    uint32_t credits           # credits its frames return (credit accounting)
    int counts                 # it takes one of the receiver's credits (not a HELLO)
    char* dst                  # read: the destination; write: the source (engine memory)
    uint64_t raddr
    uint8_t rkey[FAB_MAX_RKEY]
    uint32_t rkey_len
    int ordered                # eof: behind the data of its direction


cdef struct mem_cq:
    mem_cq* next
    fab_completion ev
    char* owned
    uint32_t credits
    int counts


cdef struct mem_region:
    uint64_t key               # 0: slot free
    char* addr
    size_t length
    int remote                 # reg's remote: FAB_REG_READ / FAB_REG_WRITE by the peer, or 0
    size_t served              # bytes the peer has read (FAB_CAP_READS_SERVED)
    uint64_t mr_ctx            # the engine's fab_mr*, until FAB_EV_SERVED is reported


cdef struct mem_side:
    void* link                 # mem_link*
    int index
    fab_channel* ch
    int fd
    int attached
    int closed
    mem_cq* cq_head
    mem_cq* cq_tail
    mem_cq* handed             # returned by the last poll; data valid until the next one
    uint32_t recv_depth
    uint32_t bufs_in_use
    mem_region* regions
    uint32_t nregions
    uint32_t key_gen
    uint64_t pattern           # send k returns FAB_DONE iff bit k % pattern_bits (with SEND_COPIES)
    uint32_t pattern_bits
    uint64_t nsends
    uint64_t overruns
    uint64_t regions_at_close
    uint64_t recvs
    uint64_t reads


cdef struct mem_link:
    pthread_mutex_t lock
    int refs
    mem_side sides[2]
    mem_item* head
    mem_item* tail
    uint64_t next_id
    uint32_t caps
    int send_depth
    uint32_t rkey_len
    int strict_recv            # an overrun fails the receiver (a fabric without retries)
    int nviolations
    char violations[MAX_VIOLATIONS][VIOLATION_TEXT]


cdef struct mem_chan:
    fab_channel base
    mem_link* link
    int side


cdef fab_channel_ops MEM_OPS
MEM_OPS.send = mem_send
MEM_OPS.reg = mem_reg
MEM_OPS.dereg = mem_dereg
MEM_OPS.read = mem_read
MEM_OPS.write = mem_write
MEM_OPS.send_large = NULL
MEM_OPS.recv_large = NULL
MEM_OPS.cancel_read = mem_cancel_read
MEM_OPS.poll = mem_poll
MEM_OPS.arm = mem_arm
MEM_OPS.close = mem_close
MEM_OPS.recycle = mem_recycle


# ------------------------------------------------------------------ helpers

cdef void violation(mem_link* L, const char* what, uint64_t a, uint64_t b) noexcept nogil:
    if L.nviolations < MAX_VIOLATIONS:
        snprintf(L.violations[L.nviolations], VIOLATION_TEXT, "%s (%llu, %llu)", what,
                 <unsigned long long>a, <unsigned long long>b)
    L.nviolations += 1


cdef void signal_side(mem_side* s) noexcept nogil:
    """The engine's epoll sees this side readable (a completion is queued)."""
    cdef uint64_t one = 1
    if s.fd >= 0 and not s.closed:
        write(s.fd, &one, 8)


cdef void fail_side(mem_side* s, int err, const char* what) noexcept nogil:
    if s.ch != NULL and not s.closed:
        fab_fail(s.ch, err, what)
        signal_side(s)


cdef mem_item* item_new(mem_link* L, int kind, int side) noexcept nogil:
    cdef mem_item* it = <mem_item*>calloc(1, sizeof(mem_item))
    if it == NULL:
        return NULL
    L.next_id += 1
    it.id = L.next_id
    it.kind = kind
    it.side = side
    it.counts = 1
    it.prev = L.tail
    if L.tail != NULL:
        L.tail.next = it
    else:
        L.head = it
    L.tail = it
    return it


cdef void item_free(mem_link* L, mem_item* it) noexcept nogil:
    if it.prev != NULL:
        it.prev.next = it.next
    else:
        L.head = it.next
    if it.next != NULL:
        it.next.prev = it.prev
    else:
        L.tail = it.prev
    free(it.iov)
    free(it.data)
    free(it)


cdef int cq_push(mem_side* s, int kind, int status, uint64_t ctx, char* owned, size_t length,
                 uint32_t credits, int counts) noexcept nogil:
    cdef mem_cq* q = <mem_cq*>calloc(1, sizeof(mem_cq))
    if q == NULL:
        free(owned)
        return -1
    q.ev.kind = kind
    q.ev.status = status
    q.ev.ctx = ctx
    q.ev.data = owned
    q.ev.length = length
    q.owned = owned
    q.credits = credits
    q.counts = counts
    if s.cq_tail == NULL:
        s.cq_head = q
    else:
        s.cq_tail.next = q
    s.cq_tail = q
    signal_side(s)
    return 0


cdef void drop_served(mem_side* s, uint64_t ctx) noexcept nogil:
    """Take a FAB_EV_SERVED for ctx not yet polled out of the queue."""
    cdef mem_cq** p = &s.cq_head
    cdef mem_cq* q
    s.cq_tail = NULL
    while p[0] != NULL:
        q = p[0]
        if q.ev.kind == FAB_EV_SERVED and q.ev.ctx == ctx:
            p[0] = q.next
            free(q)
            continue
        s.cq_tail = q
        p = &q.next


cdef void cq_free_list(mem_cq* q) noexcept nogil:
    cdef mem_cq* n
    while q != NULL:
        n = q.next
        free(q.owned)
        free(q)
        q = n


cdef void frames_credits(const uint8_t* data, size_t length, uint32_t* credits, int* counts) noexcept nogil:
    """What a fabric message does to the credits: the credits its frames
    return, and whether it uses one of the receiver's (HELLO does not)."""
    cdef size_t pos = 0
    cdef int used
    cdef frame_t f
    cdef const char* error = NULL
    credits[0] = 0
    counts[0] = 1
    while pos < length:
        used = parse_frame(data + pos, length - pos, &f, &error)
        if used < 0:
            return
        pos += <size_t>used
        credits[0] += f.credits
        if f.type == F_HELLO:
            counts[0] = 0


cdef char* gather(iovec* iov, int cnt, size_t total) noexcept nogil:
    cdef char* out = <char*>malloc(total if total else 1)
    cdef size_t off = 0
    cdef int i
    if out == NULL:
        return NULL
    for i in range(cnt):
        if iov[i].iov_len:
            memcpy(out + off, iov[i].iov_base, iov[i].iov_len)
            off += iov[i].iov_len
    return out


cdef mem_region* region_of(mem_side* s, uint64_t key) noexcept nogil:
    cdef uint32_t slot = <uint32_t>(key & 0xFFFFFFFFU)
    if slot == 0 or slot > s.nregions:
        return NULL
    if s.regions[slot - 1].key != key:
        return NULL
    return &s.regions[slot - 1]


cdef bint covers(mem_region* r, const char* p, size_t length) noexcept nogil:
    cdef size_t start = <size_t>r.addr
    cdef size_t at = <size_t>p
    return r != NULL and at >= start and length <= r.length and at - start <= r.length - length


cdef void rkey_tail(uint8_t* rkey, uint32_t rkey_len, uint64_t key) noexcept nogil:
    """Keys longer than 8 bytes carry a pattern that reads check, so an
    engine that truncated or mangled a key is caught."""
    cdef uint32_t i
    wr64(rkey, key)
    for i in range(8, rkey_len):
        rkey[i] = <uint8_t>((key >> ((i % 8) * 8)) ^ (i * 29))


# ---------------------------------------------------------- channel operations

cdef int mem_send(fab_channel* ch, iovec* iov, fab_mr** mrs, int iovcnt, uint64_t ctx) noexcept nogil:
    cdef mem_chan* c = <mem_chan*>ch
    cdef mem_link* L = c.link
    cdef mem_side* s = &L.sides[c.side]
    cdef mem_item* it
    cdef mem_item* p
    cdef size_t total = 0
    cdef int i, done = 0, rc = FAB_PENDING
    cdef char* flat
    cdef uint32_t credits
    cdef int counts
    pthread_mutex_lock(&L.lock)
    if ch.failed:
        rc = -ch.failed
    else:
        for i in range(iovcnt):
            total += iov[i].iov_len
            if not (L.caps & FAB_CAP_SEND_ANY_MEMORY) and iov[i].iov_len:
                if mrs == NULL or mrs[i] == NULL or not covers(
                        region_of(s, rd64(mrs[i].rkey)), <char*>iov[i].iov_base, iov[i].iov_len):
                    violation(L, "send of memory not registered on the channel", i, iov[i].iov_len)
        if True:
            # The frames are read now only to know their credits; the bytes
            # that travel are taken when the send is delivered.
            flat = gather(iov, iovcnt, total)
            if flat == NULL:
                rc = fab_fail(ch, ENOMEM, "memory fabric")
            else:
                frames_credits(<uint8_t*>flat, total, &credits, &counts)
                if (L.caps & FAB_CAP_SEND_COPIES) and s.pattern_bits:
                    done = (s.pattern >> (s.nsends % s.pattern_bits)) & 1
                    p = L.head
                    while p != NULL and done:
                        if (p.kind == IT_SEND or p.kind == IT_WRITE) and p.side == c.side:
                            done = 0          # would overtake an earlier send or write
                        p = p.next
                s.nsends += 1
                if done:
                    it = item_new(L, IT_ARRIVE, 1 - c.side)
                    if it == NULL:
                        free(flat)
                        rc = fab_fail(ch, ENOMEM, "memory fabric")
                    else:
                        it.data = flat
                        it.length = total
                        it.credits = credits
                        it.counts = counts
                        rc = FAB_DONE
                else:
                    free(flat)
                    it = item_new(L, IT_SEND, c.side)
                    if it != NULL:
                        it.iov = <iovec*>malloc((iovcnt if iovcnt else 1) * sizeof(iovec))
                    if it == NULL or it.iov == NULL:
                        rc = fab_fail(ch, ENOMEM, "memory fabric")
                    else:
                        memcpy(it.iov, iov, iovcnt * sizeof(iovec))
                        it.iovcnt = iovcnt
                        it.length = total
                        it.ctx = ctx
                        it.credits = credits
                        it.counts = counts
                ch.activity += 1
    pthread_mutex_unlock(&L.lock)
    return rc


cdef int mem_reg(fab_channel* ch, void* addr, size_t length, fab_mr* mr, int remote) noexcept nogil:
    cdef mem_chan* c = <mem_chan*>ch
    cdef mem_link* L = c.link
    cdef mem_side* s = &L.sides[c.side]
    cdef uint32_t i, n, slot = 0
    cdef mem_region* grown
    cdef uint64_t key
    cdef int rc = FAB_DONE
    pthread_mutex_lock(&L.lock)
    if ch.failed:
        pthread_mutex_unlock(&L.lock)
        return -ch.failed
    for i in range(s.nregions):
        if s.regions[i].key == 0:
            slot = i + 1
            break
    if slot == 0:
        n = s.nregions * 2 if s.nregions else 16
        grown = <mem_region*>realloc(s.regions, n * sizeof(mem_region))
        if grown == NULL:
            pthread_mutex_unlock(&L.lock)
            return -ENOMEM
        for i in range(s.nregions, n):
            grown[i].key = 0
        s.regions = grown
        slot = s.nregions + 1
        s.nregions = n
    s.key_gen += 1
    # generation in the high half: a stale key never matches a reused slot
    key = (<uint64_t>s.key_gen << 32) | slot
    s.regions[slot - 1].key = key
    s.regions[slot - 1].addr = <char*>addr
    s.regions[slot - 1].length = length
    s.regions[slot - 1].remote = remote
    s.regions[slot - 1].served = 0
    s.regions[slot - 1].mr_ctx = <uint64_t><size_t>mr if remote == FAB_REG_READ else 0
    mr.handle = <void*><size_t>slot
    mr.addr = <uint64_t><size_t>addr
    mr.length = length
    mr.rkey_len = L.rkey_len
    rkey_tail(mr.rkey, L.rkey_len, key)
    ch.live_regions += 1
    pthread_mutex_unlock(&L.lock)
    return rc


cdef void mem_dereg(fab_channel* ch, fab_mr* mr) noexcept nogil:
    cdef mem_chan* c = <mem_chan*>ch
    cdef mem_link* L = c.link
    cdef mem_side* s = &L.sides[c.side]
    cdef mem_region* r
    pthread_mutex_lock(&L.lock)
    r = region_of(s, rd64(mr.rkey))
    if r == NULL or <size_t>mr.handle != (r - s.regions) + 1:
        violation(L, "dereg of a region that is not registered", <size_t>mr.handle, rd64(mr.rkey))
    else:
        if r.mr_ctx == 0:
            drop_served(s, <uint64_t><size_t>mr)   # reported only while the region lives
        r.key = 0
        ch.live_regions -= 1
    pthread_mutex_unlock(&L.lock)


cdef int mem_read(fab_channel* ch, void* dst, fab_mr* dst_mr, size_t length, uint64_t raddr,
                  uint8_t* rkey, uint32_t rkey_len, uint64_t ctx) noexcept nogil:
    cdef mem_chan* c = <mem_chan*>ch
    cdef mem_link* L = c.link
    cdef mem_side* s = &L.sides[c.side]
    cdef mem_item* it
    cdef int rc = FAB_PENDING
    pthread_mutex_lock(&L.lock)
    if ch.failed:
        rc = -ch.failed
    elif rkey_len != L.rkey_len:
        rc = -EINVAL               # not a key of this fabric (the engine fails the message)
    else:
        if not (L.caps & FAB_CAP_READ_ANY_MEMORY) and length:
            if dst_mr == NULL or not covers(region_of(s, rd64(dst_mr.rkey)), <char*>dst, length):
                violation(L, "read into memory not registered on the channel", <size_t>dst, length)
        it = item_new(L, IT_READ, c.side)
        if it == NULL:
            rc = fab_fail(ch, ENOMEM, "memory fabric")
        else:
            it.dst = <char*>dst
            it.length = length
            it.raddr = raddr
            it.ctx = ctx
            it.rkey_len = rkey_len
            memcpy(it.rkey, rkey, rkey_len)
    pthread_mutex_unlock(&L.lock)
    return rc


cdef int mem_write(fab_channel* ch, void* src, fab_mr* src_mr, size_t length, uint64_t raddr,
                   uint8_t* rkey, uint32_t rkey_len, uint64_t ctx) noexcept nogil:
    cdef mem_chan* c = <mem_chan*>ch
    cdef mem_link* L = c.link
    cdef mem_side* s = &L.sides[c.side]
    cdef mem_item* it
    cdef int rc = FAB_PENDING
    pthread_mutex_lock(&L.lock)
    if ch.failed:
        rc = -ch.failed
    elif not (L.caps & FAB_CAP_ORDERED_WRITE):
        violation(L, "write on a link without FAB_CAP_ORDERED_WRITE", length, 0)
        rc = -EINVAL
    elif rkey_len != L.rkey_len:
        rc = -EINVAL
    else:
        if not (L.caps & FAB_CAP_SEND_ANY_MEMORY) and length:
            if src_mr == NULL or not covers(region_of(s, rd64(src_mr.rkey)), <char*>src, length):
                violation(L, "write from memory not registered on the channel", <size_t>src, length)
        it = item_new(L, IT_WRITE, c.side)
        if it == NULL:
            rc = fab_fail(ch, ENOMEM, "memory fabric")
        else:
            it.dst = <char*>src
            it.length = length
            it.raddr = raddr
            it.ctx = ctx
            it.rkey_len = rkey_len
            memcpy(it.rkey, rkey, rkey_len)
            ch.activity += 1
    pthread_mutex_unlock(&L.lock)
    return rc


cdef int mem_cancel_read(fab_channel* ch, uint64_t ctx) noexcept nogil:
    # A read not yet performed is dropped; one performed but not yet polled
    # loses its completion. Either way no byte lands in dst any more and no
    # completion follows.
    cdef mem_chan* c = <mem_chan*>ch
    cdef mem_link* L = c.link
    cdef mem_side* s = &L.sides[c.side]
    cdef mem_item* it
    cdef mem_cq** q
    cdef mem_cq* dead
    pthread_mutex_lock(&L.lock)
    it = L.head
    while it != NULL:
        if it.kind == IT_READ and it.side == c.side and it.ctx == ctx:
            item_free(L, it)
            break
        it = it.next
    q = &s.cq_head
    s.cq_tail = NULL
    while q[0] != NULL:
        if q[0].ev.kind == FAB_EV_READ and q[0].ev.ctx == ctx:
            dead = q[0]
            q[0] = dead.next
            free(dead)
            continue
        s.cq_tail = q[0]
        q = &q[0].next
    pthread_mutex_unlock(&L.lock)
    return 0


cdef void release_handed(mem_side* s) noexcept nogil:
    """The data handed out by the last poll is free again, and so are its
    receive buffers (link lock held)."""
    cdef mem_cq* q = s.handed
    cdef mem_cq* n
    while q != NULL:
        n = q.next
        if q.ev.kind == FAB_EV_RECV:
            s.bufs_in_use -= 1
        free(q.owned)
        free(q)
        q = n
    s.handed = NULL


cdef void mem_recycle(fab_channel* ch) noexcept nogil:
    cdef mem_chan* c = <mem_chan*>ch
    pthread_mutex_lock(&c.link.lock)
    release_handed(&c.link.sides[c.side])
    pthread_mutex_unlock(&c.link.lock)


cdef int mem_poll(fab_channel* ch, fab_completion* out, int max_events) noexcept nogil:
    cdef mem_chan* c = <mem_chan*>ch
    cdef mem_link* L = c.link
    cdef mem_side* s = &L.sides[c.side]
    cdef mem_cq* q
    cdef int k = 0
    cdef uint64_t junk
    pthread_mutex_lock(&L.lock)
    release_handed(s)          # (what the engine did not recycle)
    read(s.fd, &junk, 8)
    while k < max_events and s.cq_head != NULL:
        q = s.cq_head
        s.cq_head = q.next
        if s.cq_head == NULL:
            s.cq_tail = NULL
        out[k] = q.ev
        k += 1
        q.next = s.handed
        s.handed = q
    if ch.failed and k < max_events:
        out[k].kind = FAB_EV_FAILED
        out[k].status = -ch.failed
        out[k].ctx = 0
        out[k].data = NULL
        out[k].length = 0
        k += 1
    if s.cq_head != NULL:
        signal_side(s)
    pthread_mutex_unlock(&L.lock)
    return k


cdef int mem_arm(fab_channel* ch, uint32_t* events) noexcept nogil:
    cdef mem_chan* c = <mem_chan*>ch
    cdef mem_link* L = c.link
    cdef int ready
    pthread_mutex_lock(&L.lock)
    ready = ch.failed != 0 or L.sides[c.side].cq_head != NULL
    pthread_mutex_unlock(&L.lock)
    events[0] = EPOLLIN
    return 1 if ready else 0


cdef void link_unref(mem_link* L) noexcept nogil:
    """Drop a reference (the lock NOT held); the last one frees the link."""
    cdef int last, i
    pthread_mutex_lock(&L.lock)
    L.refs -= 1
    last = L.refs == 0
    pthread_mutex_unlock(&L.lock)
    if not last:
        return
    while L.head != NULL:
        item_free(L, L.head)
    for i in range(2):
        cq_free_list(L.sides[i].cq_head)
        cq_free_list(L.sides[i].handed)
        free(L.sides[i].regions)
        if L.sides[i].fd >= 0:
            close(L.sides[i].fd)
    pthread_mutex_destroy(&L.lock)
    free(L)


cdef void mem_close(fab_channel* ch) noexcept nogil:
    cdef mem_chan* c = <mem_chan*>ch
    cdef mem_link* L = c.link
    cdef int me = c.side
    cdef mem_side* s = &L.sides[me]
    cdef mem_side* peer = &L.sides[1 - me]
    cdef mem_item* it
    cdef mem_item* n
    cdef uint32_t i
    pthread_mutex_lock(&L.lock)
    # Everything that would touch this side's memory goes: its sends not on
    # the wire yet, its reads, its completions, what arrives for it. What is
    # on the wire toward the peer stays, and the peer learns of the close.
    it = L.head
    while it != NULL:
        n = it.next
        if it.side == me:
            item_free(L, it)
        it = n
    if peer.attached and not peer.closed:
        it = item_new(L, IT_EOF, 1 - me)
        if it != NULL:
            it.ordered = (L.caps & FAB_CAP_ORDERED_CLOSE) != 0
    cq_free_list(s.cq_head)
    cq_free_list(s.handed)
    s.cq_head = s.cq_tail = s.handed = NULL
    for i in range(s.nregions):
        if s.regions[i].key != 0:
            s.regions_at_close += 1
            s.regions[i].key = 0
    s.closed = 1
    s.ch = NULL
    if s.fd >= 0:
        close(s.fd)
        s.fd = -1
    pthread_mutex_unlock(&L.lock)
    free(c)
    link_unref(L)


cdef fab_channel* mem_attach(void* domain, int fd, size_t max_recv, uint32_t recv_depth,
                            const char* host) noexcept nogil:
    cdef mem_side* s = <mem_side*>domain
    cdef mem_link* L
    cdef mem_chan* c
    if s == NULL or s.fd != fd or s.attached:
        close(fd)
        if s != NULL and s.fd == fd:
            s.fd = -1
        return NULL
    L = <mem_link*>s.link
    c = <mem_chan*>calloc(1, sizeof(mem_chan))
    if c == NULL:
        close(fd)
        s.fd = -1
        return NULL
    pthread_mutex_lock(&L.lock)
    c.link = L
    c.side = s.index
    c.base.ops = &MEM_OPS
    c.base.fd = fd
    c.base.caps = L.caps
    c.base.max_recv = max_recv
    c.base.recv_depth = recv_depth
    c.base.send_depth = L.send_depth
    snprintf(c.base.local_name, 64, "memory:%d", s.index)
    snprintf(c.base.peer_name, 64, "memory:%d", 1 - s.index)
    s.ch = &c.base
    s.attached = 1
    s.recv_depth = recv_depth
    L.refs += 1
    pthread_mutex_unlock(&L.lock)
    return &c.base


# ------------------------------------------------------------- the backend

cdef class MemoryBackend(Backend):
    """Test-only backend of MemoryLinks (see the module docstring)."""
    cdef mem_side* next_side       # what the next prepare_attach hands to attach

    def __init__(self):
        self.name = "memory"
        self.caps = DEFAULT_CAPS

    @staticmethod
    def available():
        return True, "in-memory test fabric"

    def default_options(self):
        # no progress thread: only the test moves anything
        return {"progress_thread": 0, "spin_us": 0, "spin_max_us": 0}

    def _tune(self, int fd, dict options):
        pass                      # not a socket

    cdef fab_listener* listen(self, object domain, str host, int port, dict options) except NULL:
        raise NotImplementedError("the memory fabric connects by MemoryLink.attach()")

    cdef int dial(self, object domain, str host, int port, double timeout, dict options) except -1:
        raise NotImplementedError("the memory fabric connects by MemoryLink.attach()")

    cdef int prepare_attach(self, object domain, dict options, fab_attach* out) except -1:
        out.attach = mem_attach
        out.domain = self.next_side
        out.recv_depth = recv_depth_for(options)
        self.next_side = NULL
        return 0


cdef class MemoryLink:
    """One connection of the memory fabric: two sides, the pending items."""
    cdef mem_link* L

    def __cinit__(self, uint32_t caps=DEFAULT_CAPS, int send_depth=2, uint32_t rkey_len=8,
                  bint strict_recv=False):
        cdef int i
        if rkey_len < 8 or rkey_len > FAB_MAX_RKEY:
            raise ValueError("rkey_len must be 8..256")
        self.L = <mem_link*>calloc(1, sizeof(mem_link))
        if self.L == NULL:
            raise MemoryError()
        pthread_mutex_init(&self.L.lock, NULL)
        self.L.refs = 1
        self.L.caps = caps
        self.L.send_depth = send_depth
        self.L.rkey_len = rkey_len
        self.L.strict_recv = strict_recv
        for i in range(2):
            self.L.sides[i].link = self.L
            self.L.sides[i].index = i
            self.L.sides[i].fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
            if self.L.sides[i].fd < 0:
                raise OSError("eventfd failed")

    def __dealloc__(self):
        if self.L != NULL:
            link_unref(self.L)
            self.L = NULL

    def set_send_pattern(self, int side, uint64_t bits, uint32_t nbits):
        """With FAB_CAP_SEND_COPIES: send k of `side` completes at once
        (FAB_DONE, copied) iff bit k % nbits of `bits` is set."""
        pthread_mutex_lock(&self.L.lock)
        self.L.sides[side].pattern = bits
        self.L.sides[side].pattern_bits = nbits if nbits <= 64 else 64
        pthread_mutex_unlock(&self.L.lock)

    def attach(self, worker, int side):
        """An Endpoint of `worker` (whose backend is a MemoryBackend) on this
        side, in its handshake (HELLO posted)."""
        cdef MemoryBackend backend = worker.backend
        if side not in (0, 1) or self.L.sides[side].attached or self.L.sides[side].fd < 0:
            raise ValueError("side already attached")
        backend.next_side = &self.L.sides[side]
        try:
            return worker._attach_connected(self.L.sides[side].fd, False)
        finally:
            backend.next_side = NULL

    cdef bint _deliverable(self, mem_item* it):
        cdef mem_item* p = self.L.head
        if it.kind == IT_SEND or it.kind == IT_WRITE:
            while p != it:
                if (p.kind == IT_SEND or p.kind == IT_WRITE) and p.side == it.side:
                    return False
                p = p.next
        elif it.kind == IT_ARRIVE or (it.kind == IT_EOF and it.ordered):
            while p != it:
                if p.side == it.side and (p.kind == IT_ARRIVE or (p.kind == IT_EOF and p.ordered)):
                    return False
                p = p.next
        return True

    def pending(self):
        """[(id, kind, side, nbytes, deliverable)] in posting order."""
        cdef mem_item* p
        out = []
        pthread_mutex_lock(&self.L.lock)
        try:
            p = self.L.head
            while p != NULL:
                out.append((p.id, KIND_NAMES[p.kind], p.side, p.length, self._deliverable(p)))
                p = p.next
        finally:
            pthread_mutex_unlock(&self.L.lock)
        return out

    cdef mem_item* _find(self, uint64_t ident):
        cdef mem_item* it = self.L.head
        while it != NULL and it.id != ident:
            it = it.next
        return it

    def deliver(self, uint64_t ident):
        """Perform one deliverable item; returns what happened."""
        pthread_mutex_lock(&self.L.lock)
        try:
            return self._perform(ident, 0)
        finally:
            pthread_mutex_unlock(&self.L.lock)

    def fail(self, uint64_t ident):
        """Make one item fail: a send, its arrival or its completion fails the
        channel it belongs to (a reliable fabric has no other way to lose
        one); a read completes with -EIO."""
        pthread_mutex_lock(&self.L.lock)
        try:
            return self._perform(ident, 1)
        finally:
            pthread_mutex_unlock(&self.L.lock)

    cdef str _perform(self, uint64_t ident, int failing):
        cdef mem_link* L = self.L
        cdef mem_item* it = self._find(ident)
        cdef mem_side* s
        cdef mem_side* owner
        cdef mem_item* a
        cdef mem_region* r
        cdef char* flat
        cdef uint64_t key
        cdef uint8_t expect[FAB_MAX_RKEY]
        if it == NULL:
            raise KeyError(ident)
        if not self._deliverable(it):
            raise ValueError(f"item {ident} may not overtake an earlier one")
        s = &L.sides[it.side]
        if s.closed:
            item_free(L, it)
            return "dropped"
        if s.ch == NULL:
            raise ValueError(f"side {it.side} is not attached yet")
        if it.kind == IT_SEND:
            if s.ch.failed:
                item_free(L, it)
                return "dropped"
            if failing:
                item_free(L, it)
                fail_side(s, EIO_, "memory fabric: injected send failure")
                return "failed"
            flat = gather(it.iov, it.iovcnt, it.length)
            if flat == NULL:
                raise MemoryError()
            a = item_new(L, IT_ARRIVE, 1 - it.side)
            a.data = flat
            a.length = it.length
            a.credits = it.credits
            a.counts = it.counts
            a = item_new(L, IT_SEND_DONE, it.side)
            a.ctx = it.ctx
            a.length = it.length
            item_free(L, it)
            return "sent"
        if it.kind == IT_SEND_DONE:
            if failing:
                item_free(L, it)
                fail_side(s, EIO_, "memory fabric: injected send completion error")
                return "failed"
            cq_push(s, FAB_EV_SEND, 0, it.ctx, NULL, 0, 0, 0)
            item_free(L, it)
            return "completed"
        if it.kind == IT_ARRIVE:
            if s.ch.failed:
                item_free(L, it)
                return "dropped"
            if failing:
                item_free(L, it)
                fail_side(s, EIO_, "memory fabric: injected loss of a message")
                return "failed"
            if it.length > s.ch.max_recv:
                violation(L, "message larger than the receiver's max_recv", it.length, s.ch.max_recv)
                item_free(L, it)
                fail_side(s, EPROTO, "memory fabric: message larger than max_recv")
                return "failed"
            if s.bufs_in_use >= s.recv_depth:
                s.overruns += 1
                if L.strict_recv:
                    violation(L, "message arrived with no receive buffer posted", s.bufs_in_use, s.recv_depth)
                    item_free(L, it)
                    fail_side(s, ENOBUFS_, "memory fabric: no receive buffer posted")
                    return "failed"
            s.bufs_in_use += 1
            s.recvs += 1
            cq_push(s, FAB_EV_RECV, 0, 0, it.data, it.length, it.credits, it.counts)
            it.data = NULL
            item_free(L, it)
            return "arrived"
        if it.kind == IT_EOF:
            item_free(L, it)
            fail_side(s, ECONNRESET, "memory fabric: peer closed the connection")
            return "eof"
        if it.kind == IT_WRITE:
            return self._perform_write(it, failing)
        # a read
        if s.ch.failed:
            item_free(L, it)
            return "dropped"
        s.reads += 1
        if failing:
            cq_push(s, FAB_EV_READ, -EIO_, it.ctx, NULL, 0, 0, 0)
            item_free(L, it)
            return "failed"
        owner = &L.sides[1 - it.side]
        if owner.closed or owner.ch == NULL:
            item_free(L, it)
            fail_side(s, ECONNRESET, "memory fabric: peer closed the connection during a read")
            return "failed"
        key = rd64(it.rkey)
        r = region_of(owner, key)
        rkey_tail(expect, it.rkey_len, key)
        # a region registered for local use only (remote=0) is never readable
        if (r == NULL or r.remote != FAB_REG_READ or memcmp_(expect, it.rkey, it.rkey_len)
                or not covers(r, <char*><size_t>it.raddr, it.length)):
            cq_push(s, FAB_EV_READ, -EACCES_, it.ctx, NULL, 0, 0, 0)
            item_free(L, it)
            return "refused"
        if it.length:
            memcpy(it.dst, <char*><size_t>it.raddr, it.length)
        cq_push(s, FAB_EV_READ, 0, it.ctx, NULL, it.length, 0, 0)
        r.served += it.length
        if (L.caps & FAB_CAP_READS_SERVED) and r.mr_ctx != 0 and r.served >= r.length:
            cq_push(owner, FAB_EV_SERVED, 0, r.mr_ctx, NULL, 0, 0, 0)   # all of it went out
            r.mr_ctx = 0
        item_free(L, it)
        return "read"

    cdef str _perform_write(self, mem_item* it, int failing):
        """Place a write's bytes in the owner's region, or refuse it."""
        cdef mem_link* L = self.L
        cdef mem_side* s = &L.sides[it.side]
        cdef mem_side* owner = &L.sides[1 - it.side]
        cdef mem_region* r
        cdef uint64_t key
        cdef uint8_t expect[FAB_MAX_RKEY]
        if s.ch.failed:
            item_free(L, it)
            return "dropped"
        if failing:
            item_free(L, it)
            fail_side(s, EIO_, "memory fabric: injected write failure")
            return "failed"
        if owner.closed or owner.ch == NULL:
            item_free(L, it)
            fail_side(s, ECONNRESET, "memory fabric: peer closed the connection during a write")
            return "failed"
        key = rd64(it.rkey)
        r = region_of(owner, key)
        rkey_tail(expect, it.rkey_len, key)
        if (r == NULL or r.remote != FAB_REG_WRITE or memcmp_(expect, it.rkey, it.rkey_len)
                or not covers(r, <char*><size_t>it.raddr, it.length)):
            violation(L, "write outside the regions the peer registered for writing", it.raddr, it.length)
            fail_side(owner, EPROTO, "peer wrote outside the buffers posted to it")
            cq_push(s, FAB_EV_WRITE, -EACCES_, it.ctx, NULL, 0, 0, 0)
            item_free(L, it)
            return "refused"
        if it.length:
            memcpy(<char*><size_t>it.raddr, it.dst, it.length)
        cq_push(s, FAB_EV_WRITE, 0, it.ctx, NULL, it.length, 0, 0)
        item_free(L, it)
        return "written"

    def fail_channel(self, int side, int err=ECONNRESET):
        """The connection breaks at `side` (its peer died): its channel fails
        now; the other side learns of it when side's channel closes."""
        pthread_mutex_lock(&self.L.lock)
        fail_side(&self.L.sides[side], err, "memory fabric: injected connection failure")
        pthread_mutex_unlock(&self.L.lock)

    def inflight(self, int side):
        """(messages, credits) on their way from `side` to its peer and not
        yet polled there: the messages that use one of the peer's credits,
        and the credits their frames return."""
        cdef mem_item* it
        cdef mem_cq* q
        cdef int msgs = 0
        cdef uint64_t credits = 0
        pthread_mutex_lock(&self.L.lock)
        it = self.L.head
        while it != NULL:
            if ((it.kind == IT_SEND and it.side == side)
                    or (it.kind == IT_ARRIVE and it.side == 1 - side)):
                msgs += it.counts
                credits += it.credits
            it = it.next
        q = self.L.sides[1 - side].cq_head
        while q != NULL:
            if q.ev.kind == FAB_EV_RECV:
                msgs += q.counts
                credits += q.credits
            q = q.next
        pthread_mutex_unlock(&self.L.lock)
        return msgs, int(credits)

    def state(self, int side):
        cdef mem_side* s = &self.L.sides[side]
        cdef uint32_t i
        cdef int remote = 0
        pthread_mutex_lock(&self.L.lock)
        try:
            for i in range(s.nregions):
                if s.regions[i].key != 0 and s.regions[i].remote:
                    remote += 1
            return {"attached": bool(s.attached), "closed": bool(s.closed), "remote_regions": remote,
                    "failed": s.ch.failed if s.ch != NULL else 0,
                    "live_regions": s.ch.live_regions if s.ch != NULL else 0,
                    "regions_at_close": s.regions_at_close, "bufs_in_use": s.bufs_in_use,
                    "recv_depth": s.recv_depth, "overruns": s.overruns,
                    "queued": s.cq_head != NULL, "recvs": s.recvs, "reads": s.reads}
        finally:
            pthread_mutex_unlock(&self.L.lock)

    def violations(self):
        cdef int i
        pthread_mutex_lock(&self.L.lock)
        try:
            out = [self.L.violations[i].decode(errors="replace")
                   for i in range(min(self.L.nviolations, MAX_VIOLATIONS))]
            if self.L.nviolations > MAX_VIOLATIONS:
                out.append(f"... {self.L.nviolations - MAX_VIOLATIONS} more")
            return out
        finally:
            pthread_mutex_unlock(&self.L.lock)


cdef inline int memcmp_(const uint8_t* a, const uint8_t* b, uint32_t n) noexcept nogil:
    cdef uint32_t i
    for i in range(n):
        if a[i] != b[i]:
            return 1
    return 0
