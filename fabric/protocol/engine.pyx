# cython: language_level=3
"""The protocol engine: eager, coalescing, rendezvous with pipelined pulls,
credits and ordering, over any backend of fabric.backends.interface.

Everything below the Python classes at the end runs without the GIL under the
worker's mutex. The rules that keep that safe:
  * Engine code never takes the GIL while it holds the worker lock.
  * Python buffers of a send stay referenced by its sendop_t until the op is
    final; they are released (under the GIL, outside the lock) by whoever
    drops the last reference, or by the reap list.
  * A failed endpoint is only marked (ep_fail); its channel is closed and its
    operations failed at a safe point (ep_settle), never in the middle of
    parsing data that belongs to the channel.

Data path of one message (see frame.pxd for the wire format):
  size <= eager_limit  EAGER frame; sent straight from the caller's buffer
                       when the fabric is free and the backend accepts any
                       memory, else copied into a coalescing buffer (slab)
                       together with other small frames.
  size >  eager_limit  RNDV frames announce chunks of the caller's buffer
                       (registered chunk by chunk, chunks_in_flight ahead);
                       the receiver reads each chunk into the destination and
                       answers CHUNK_DONE, which releases the chunk.
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcpy, memset, strlen
from posix.uio cimport iovec
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_WRITABLE, PyBUF_ANY_CONTIGUOUS)
from cpython.exc cimport PyErr_CheckSignals
cimport cython

from fabric._posix cimport *
from fabric.backends.interface cimport *
from fabric.protocol.frame cimport *

import errno as _errno
import logging as _logging
import sys as _sys
import warnings as _warnings
from fabric import errors as _errors

cdef enum:
    EP_HANDSHAKE = 1
    EP_OPEN = 2
    EP_FAILED = 3        # marked failed, not yet settled
    EP_DEAD = 4          # channel closed, operations failed

cdef enum:
    OP_QUEUED = 1
    OP_ZC = 2
    OP_RNDV = 3
    OP_DONE = 4
    OP_FAILED = 5

cdef enum:
    TAG_SLAB = 1
    TAG_OP = 2
    TAG_DESC = 3
    TAG_NATIVE = 4       # a native chunk send of a rendezvous op
    TAG_MASK = 7         # malloc returns 16-byte aligned blocks

cdef enum:
    KIND_EP = 1
    KIND_LST = 2

cdef enum:
    ESHUTDOWN_ = 108     # closed, locally or by the peer's CLOSE
    EBUSY_ = 16          # another receive is in progress
    EACCES_ = 13         # the peer refused a read, or offered a bad region

cdef enum:
    CREDIT_RESERVE = 2      # credits kept for control frames
    MAX_EVENTS = 32
    MAX_PENDING_HANDSHAKES = 64
    MAX_SEGMENTS_ZC = 62    # scatter entries sent zero-copy in one send
    WAIT_SLICE_MS = 200     # blocking waits wake this often to check signals

cdef enum:
    BG_BEHIND_POLLER = 1 # an application thread is blocked in epoll: asleep until it leaves
    BG_WATCHING = 2      # the application is active: re-check after the grace period
    BG_POLLING = 3       # blocked in epoll, progressing for an application that is away

cdef enum:
    FAULT_BAD_KEY = 1      # announce chunks with a forged remote key
    FAULT_BAD_RANGE = 2    # announce chunks at an address past their region

# Test-only stage faults (FABRIC_FAULT_INJECT=<action>@<stage>[:<n>]): this
# Fabric's process dies (SIGKILL, no clean-up at all) or its endpoint sends a
# garbage fabric message at the n-th time (default 1st) one of its endpoints
# reaches the stage. tests/test_faults.py drives every pair on every backend.
cdef enum:
    FA_DIE = 1
    FA_GARBAGE = 2

cdef enum:
    FS_HELLO = 1           # instead of sending HELLO
    FS_RNDV = 2            # once a message's first RNDV announcement was posted
    FS_PULL = 3            # once the first read of a message was issued (receiver)
    FS_CHUNK_DONE = 4      # once a CHUNK_DONE was posted (receiver)
    FS_BATCH = 5           # posting a coalesced batch of 3 or more frames (garbage: its 2nd frame)
    FS_CLOSE = 6           # once CLOSE was posted

FAULT_ACTIONS = {"die": FA_DIE, "garbage": FA_GARBAGE}
FAULT_STAGES = {"hello": FS_HELLO, "rndv": FS_RNDV, "pull": FS_PULL, "chunk_done": FS_CHUNK_DONE,
                "batch": FS_BATCH, "close": FS_CLOSE}

cdef uint8_t GARBAGE[64]
for _i in range(64):
    GARBAGE[_i] = (0x5A ^ (_i * 37)) & 0xFF     # never a frame: bad magic at offset 0

cdef extern from "<signal.h>" nogil:
    int kill(int pid, int sig)
    enum:
        SIGKILL

cdef uint32_t NO_CHUNK = 0xFFFFFFFFU
cdef size_t NATIVE_CHUNK = 1 << 30
cdef uint64_t WAKE_KEY = 0xFFFFFFFFFFFFFFFFU
cdef uint64_t HUB_KEY = 0xFFFFFFFFFFFFFFFEU
cdef double BG_GRACE = 0.001    # application idle this long before the thread polls


# ============================================ memory of received messages
#
# A large message that recv() hands out lands in memory the engine
# allocates; fresh large blocks come from the kernel as pages it faults in
# and zeroes on first touch (16 MiB: ~4000 faults), which halved what a
# recv() loop moved. Freed blocks of RECV_POOL_MIN bytes or more are kept
# (at most RECV_POOL_SLOTS, RECV_POOL_LIMIT bytes: FABRIC_RECV_CACHE, the
# limit of fabric._buffers' cache too) and handed to the next message that
# fits (a block at most 1.5x its size). They are ordinary malloc blocks, so
# any path may still free() one. The pool never blocks: a thread that finds
# it busy (or a forked child inheriting it held) just uses the allocator.

cdef extern from "<malloc.h>" nogil:
    size_t malloc_usable_size(void* ptr)

cdef enum:
    RECV_POOL_SLOTS = 16
cdef size_t RECV_POOL_MIN = 256 << 10
cdef size_t RECV_POOL_LIMIT = 128 << 20
cdef char* recv_pool_ptr[RECV_POOL_SLOTS]
cdef size_t recv_pool_cap[RECV_POOL_SLOTS]
cdef int recv_pool_n = 0
cdef size_t recv_pool_bytes = 0
cdef uint64_t recv_pool_hits = 0

cdef extern from *:
    """
    static int fab_recv_pool_busy = 0;
    static inline int fab_recv_pool_enter(void) {
        return __atomic_exchange_n(&fab_recv_pool_busy, 1, __ATOMIC_ACQUIRE) == 0;
    }
    static inline void fab_recv_pool_leave(void) {
        __atomic_store_n(&fab_recv_pool_busy, 0, __ATOMIC_RELEASE);
    }
    """
    bint recv_pool_enter "fab_recv_pool_enter"() noexcept nogil
    void recv_pool_leave "fab_recv_pool_leave"() noexcept nogil

cdef char* msg_alloc(size_t n) noexcept nogil:
    """malloc(n), from the pool when a kept block fits."""
    cdef int i, best = -1
    cdef char* p
    global recv_pool_n, recv_pool_bytes, recv_pool_hits
    if n >= RECV_POOL_MIN and recv_pool_n > 0 and recv_pool_enter():
        for i in range(recv_pool_n):
            if recv_pool_cap[i] >= n and recv_pool_cap[i] - n <= n // 2 and (
                    best < 0 or recv_pool_cap[i] < recv_pool_cap[best]):
                best = i
        if best >= 0:
            p = recv_pool_ptr[best]
            recv_pool_bytes -= recv_pool_cap[best]
            recv_pool_n -= 1
            recv_pool_ptr[best] = recv_pool_ptr[recv_pool_n]
            recv_pool_cap[best] = recv_pool_cap[recv_pool_n]
            recv_pool_hits += 1
            recv_pool_leave()
            return p
        recv_pool_leave()
    return <char*>malloc(n if n else 1)

cdef void msg_free(char* p) noexcept nogil:
    """free(p), or keep p for the next large message."""
    cdef size_t cap
    global recv_pool_n, recv_pool_bytes
    if p == NULL:
        return
    cap = malloc_usable_size(p)
    if cap >= RECV_POOL_MIN and recv_pool_bytes + cap <= RECV_POOL_LIMIT and recv_pool_enter():
        if recv_pool_n < RECV_POOL_SLOTS and recv_pool_bytes + cap <= RECV_POOL_LIMIT:
            recv_pool_ptr[recv_pool_n] = p
            recv_pool_cap[recv_pool_n] = cap
            recv_pool_n += 1
            recv_pool_bytes += cap
            recv_pool_leave()
            return
        recv_pool_leave()
    free(p)


def _recv_pool_limit_from_env():
    from fabric._buffers import _cache_limit
    return _cache_limit()


RECV_POOL_LIMIT = _recv_pool_limit_from_env()


def recv_pool_stats():
    """The pool of received-message memory: blocks and bytes kept, blocks reused."""
    return {"blocks": recv_pool_n, "bytes": recv_pool_bytes, "reused": recv_pool_hits,
            "limit": RECV_POOL_LIMIT}


# ===================================================================== utilities

cdef inline void wlock(worker_t* w) noexcept nogil:
    pthread_mutex_lock(&w.lock)

cdef inline void wunlock(worker_t* w) noexcept nogil:
    pthread_mutex_unlock(&w.lock)

cdef inline void alock(worker_t* w) noexcept nogil:
    """Lock on behalf of the application: the progress thread stays away
    while the application itself is driving the engine."""
    pthread_mutex_lock(&w.lock)
    w.last_app = monotonic_now()


cdef inline int ep_usable(ep_t* ep) noexcept nogil:
    return ep.state == EP_OPEN or ep.state == EP_HANDSHAKE

cdef void ep_fail(ep_t* ep, int err, const char* why) noexcept nogil:
    """Mark the endpoint failed (first reason wins); ep_settle finishes it."""
    if ep.state == EP_FAILED or ep.state == EP_DEAD:
        return
    ep.state = EP_FAILED
    ep.err = err
    snprintf(ep.error, 200, "%s", why)

cdef void ep_channel_failed(ep_t* ep) noexcept nogil:
    cdef int err = ep.ch.failed if ep.ch.failed else ECONNRESET
    if ep.peer_closed:
        # The peer said goodbye; its closing the connection is expected.
        ep_fail(ep, ESHUTDOWN_, "connection closed by peer")
    elif err == EPROTO:
        ep_fail(ep, EPROTO, ep.ch.error)
    else:
        ep_fail(ep, ECONNRESET, ep.ch.error)



# ========================================================================= slabs

cdef slab_t* slab_get(ep_t* ep, int control) noexcept nogil:
    cdef slab_t* s = ep.free_slabs
    if s != NULL:
        ep.free_slabs = s.next
    else:
        if not control and <uint32_t>ep.slabs_total >= ep.w.opts.send_buffers:
            return NULL
        s = <slab_t*>malloc(sizeof(slab_t) + sizeof(fab_mr) + ep.slab_cap)
        if s == NULL:
            return NULL
        s.data = <uint8_t*>(<char*>s + sizeof(slab_t) + sizeof(fab_mr))
        s.mr = NULL
        if not (ep.ch.caps & FAB_CAP_SEND_ANY_MEMORY):
            # registered once, for the slab's life; closing the channel
            # releases the registration
            s.mr = <fab_mr*>(<char*>s + sizeof(slab_t))
            if ep.ch.ops.reg(ep.ch, s.data, ep.slab_cap, s.mr) < 0:
                free(s)
                return NULL
            ep.own_regions += 1
        ep.slabs_total += 1
    s.next = NULL
    s.used = 0
    s.seq = 0
    s.frames = 0
    return s

cdef inline void slab_put(ep_t* ep, slab_t* s) noexcept nogil:
    s.next = ep.free_slabs
    ep.free_slabs = s

cdef void free_slab_list(slab_t* s) noexcept nogil:
    cdef slab_t* n
    while s != NULL:
        n = s.next
        free(s)
        s = n

cdef void slab_append(slab_t** head, slab_t** tail, slab_t* s) noexcept nogil:
    s.next = NULL
    if tail[0] == NULL:
        head[0] = s
    else:
        tail[0].next = s
    tail[0] = s

cdef slab_t* next_to_post(slab_t** head, slab_t** tail, slab_t** open_slab) noexcept nogil:
    """The oldest sealed slab of a queue, else the open one if it holds frames."""
    cdef slab_t* s = head[0]
    if s != NULL:
        head[0] = s.next
        if head[0] == NULL:
            tail[0] = NULL
        return s
    s = open_slab[0]
    if s != NULL and s.used > 0:
        open_slab[0] = NULL
        return s
    return NULL

cdef uint8_t* ctrl_room(ep_t* ep, size_t need) noexcept nogil:
    """Space for a control frame; control frames never wait for slabs."""
    cdef slab_t* s = ep.ctrl
    if s != NULL and s.used + need > ep.slab_cap:
        slab_append(&ep.ctrl_ready_head, &ep.ctrl_ready_tail, s)
        s = NULL
        ep.ctrl = NULL
    if s == NULL:
        s = slab_get(ep, 1)
        if s == NULL:
            ep_fail(ep, ENOMEM, "out of memory for control frames")
            return NULL
        ep.ctrl = s
    s.used += need
    s.frames += 1
    return s.data + s.used - need

cdef void seal_data(ep_t* ep) noexcept nogil:
    slab_append(&ep.ready_head, &ep.ready_tail, ep.open_data)
    ep.open_data = NULL

cdef uint8_t* data_room(ep_t* ep, size_t need) noexcept nogil:
    """Space in the open data slab, or NULL when every slab is in use."""
    if ep.open_data != NULL and ep.open_data.used + need > ep.slab_cap:
        seal_data(ep)
    if ep.open_data == NULL:
        ep.open_data = slab_get(ep, 0)
        if ep.open_data == NULL:
            return NULL
        ep.seq_sealed += 1
        ep.open_data.seq = ep.seq_sealed
    ep.open_data.used += need
    ep.open_data.frames += 1
    return ep.open_data.data + ep.open_data.used - need


# ============================================================== send operations

cdef void reap_push(worker_t* w, sendop_t* op) noexcept nogil:
    op.reap_next = w.reap
    w.reap = op

cdef void op_free(sendop_t* op) noexcept nogil:
    free(op.window)
    free(op.window_index)
    free(op)

cdef void op_finish(ep_t* ep, sendop_t* op, int err) noexcept nogil:
    """The engine is done with op: final state, drop the engine's reference."""
    op.state = OP_FAILED if err else OP_DONE
    op.err = err
    op.refs -= 1
    if op.refs == 0:
        if op.nviews:
            reap_push(ep.w, op)
        else:
            op_free(op)

cdef inline uint16_t take_credits(ep_t* ep) noexcept nogil:
    cdef uint32_t c = ep.c2r
    if c > 0xFFFF:
        c = 0xFFFF
    ep.c2r -= c
    if ep.c2r_quiet > ep.c2r:
        ep.c2r_quiet = ep.c2r
    return <uint16_t>c

cdef int post_slab(ep_t* ep, slab_t* s) noexcept nogil:
    cdef iovec v
    cdef int rc
    if ep.w.opts.fault_stage == FS_BATCH:
        fault_batch(ep, s)
    set_credits(s.data, take_credits(ep))
    v.iov_base = s.data
    v.iov_len = s.used
    ep.peer_credits -= 1
    ep.fabric_sends += 1
    rc = ep.ch.ops.send(ep.ch, &v, &s.mr if s.mr != NULL else NULL, 1, <uint64_t><size_t>s | TAG_SLAB)
    if rc == FAB_DONE:
        slab_put(ep, s)
        return 0
    if rc == FAB_PENDING:
        s.next = ep.inflight
        ep.inflight = s
        ep.pending_sends += 1
        return 0
    slab_put(ep, s)
    ep_channel_failed(ep)
    return -1

cdef int post_zero_copy(ep_t* ep, sendop_t* op) noexcept nogil:
    """EAGER frame straight from the caller's buffers: header + payload in
    one scatter-gather send, no copy."""
    cdef iovec v[MAX_SEGMENTS_ZC + 1]
    cdef int i, n = 1, rc
    put_header(op.hdr, F_EAGER, 0, <uint32_t>op.total, op.msg_id, 0, take_credits(ep))
    v[0].iov_base = op.hdr
    v[0].iov_len = FRAME_HEADER
    for i in range(op.nseg):
        if op.segs[i].length:
            v[n].iov_base = op.segs[i].ptr
            v[n].iov_len = op.segs[i].length
            n += 1
    ep.peer_credits -= 1
    ep.fabric_sends += 1
    ep.frames_sent += 1
    ep.sent_eager += 1
    ep.sent_eager_zero_copy += 1
    rc = ep.ch.ops.send(ep.ch, v, NULL, n, <uint64_t><size_t>op | TAG_OP)
    if rc == FAB_DONE:
        op_finish(ep, op, 0)
        return 0
    if rc == FAB_PENDING:
        op.state = OP_ZC
        op.next = ep.zc_out
        ep.zc_out = op
        ep.pending_sends += 1
        return 0
    op_finish(ep, op, ECONNRESET)
    ep_channel_failed(ep)
    return -1

cdef inline int can_post_data(ep_t* ep) noexcept nogil:
    return ep.pending_sends < ep.ch.send_depth and ep.peer_credits > CREDIT_RESERVE

cdef inline size_t chunk_limit(ep_t* ep, sendop_t* op) noexcept nogil:
    """Chunk size of an op: chunk_size for the engine's pulls; native chunks
    go as large as a frame can describe, the fabric pipelines them itself."""
    return NATIVE_CHUNK if op.native else ep.w.opts.chunk_size

cdef void next_chunk(ep_t* ep, sendop_t* op, char** ptr, size_t* length) noexcept nogil:
    """The next chunk to announce: at most chunk_limit, never across segments."""
    cdef size_t n
    while op.segs[op.cur_seg].length == op.cur_off:
        op.cur_seg += 1
        op.cur_off = 0
    n = op.segs[op.cur_seg].length - op.cur_off
    if n > chunk_limit(ep, op):
        n = chunk_limit(ep, op)
    ptr[0] = op.segs[op.cur_seg].ptr + op.cur_off
    length[0] = n

cdef int announce_chunk(ep_t* ep, sendop_t* op, int first) noexcept nogil:
    """Register the next chunk and write its RNDV frame: the first one into the
    data path (it orders the message), later ones as control frames."""
    cdef char* ptr
    cdef size_t length
    cdef uint32_t slot = op.announced % ep.w.opts.chunks_in_flight
    cdef fab_mr* mr = &op.window[slot]
    cdef uint8_t* room
    cdef int rc
    next_chunk(ep, op, &ptr, &length)
    if op.native:
        return announce_native(ep, op, first, ptr, length)
    rc = ep.ch.ops.reg(ep.ch, ptr, length, mr)
    if rc < 0:
        if ep.ch.failed:
            ep_channel_failed(ep)
        else:
            ep_fail(ep, -rc, "memory registration failed")
        return -1
    if first:
        room = data_room(ep, FRAME_HEADER + RNDV_FIXED + mr.rkey_len)
        if room == NULL:
            ep.ch.ops.dereg(ep.ch, mr)
            return 1
        op.head_seq = ep.open_data.seq
    else:
        room = ctrl_room(ep, FRAME_HEADER + RNDV_FIXED + mr.rkey_len)
        if room == NULL:
            ep.ch.ops.dereg(ep.ch, mr)
            return -1
    if ep.w.opts.fault:
        announce_faulty(ep, op, room, mr, length)
    else:
        put_rndv(room, op.msg_id, op.announced, op.total, op.msg_off, mr.addr,
                 <uint32_t>length, mr.rkey, mr.rkey_len)
    ep.chunks_announced += 1
    ep.frames_sent += 1
    if first:
        ep.sent_rndv += 1
    op.window_index[slot] = op.announced
    op.announced += 1
    op.cur_off += length
    op.msg_off += length
    return 0

cdef inline uint64_t native_tag(uint64_t msg_id, uint32_t index) noexcept nogil:
    return (msg_id << 24) | (index & 0xFFFFFF)

cdef int announce_native(ep_t* ep, sendop_t* op, int first, char* ptr, size_t length) noexcept nogil:
    """Announce a chunk that the fabric's own rendezvous carries: the frame
    has no key; the data goes to send_large under the chunk's tag."""
    cdef uint32_t slot = op.announced % ep.w.opts.chunks_in_flight
    cdef size_t need = FRAME_HEADER + RNDV_FIXED
    cdef uint8_t* room
    cdef int rc
    if first:
        room = data_room(ep, need)
        if room == NULL:
            return 1
        op.head_seq = ep.open_data.seq
    else:
        room = ctrl_room(ep, need)
        if room == NULL:
            return -1
    put_rndv(room, op.msg_id, op.announced, op.total, op.msg_off, 0, <uint32_t>length, NULL, 0, RNDV_NATIVE)
    if first:
        # The chunk follows its announcement: handed over once the slab with
        # the RNDV frame is posted (native_send_first), so the fabric's own
        # rendezvous never overtakes the message it belongs to.
        op.native_first = ptr
        op.native_first_len = length
        op.native_pending += 1
    elif native_send(ep, op, ptr, length, op.announced) < 0:
        return -1
    op.window_index[slot] = op.announced
    op.announced += 1
    op.cur_off += length
    op.msg_off += length
    ep.chunks_announced += 1
    ep.chunks_native += 1
    ep.frames_sent += 1
    if first:
        ep.sent_rndv += 1
    return 0

cdef int native_send(ep_t* ep, sendop_t* op, char* ptr, size_t length, uint32_t index) noexcept nogil:
    cdef int rc = ep.ch.ops.send_large(ep.ch, ptr, length, native_tag(op.msg_id, index),
                                       <uint64_t><size_t>op | TAG_NATIVE)
    if rc < 0:
        ep_channel_failed(ep)
        return -1
    if rc == FAB_PENDING:
        op.native_pending += 1
    return 0

cdef int native_send_first(ep_t* ep, sendop_t* op) noexcept nogil:
    """Hand the first native chunk over once its announcement has left."""
    cdef char* ptr = op.native_first
    if ptr == NULL or op.head_seq > ep.seq_posted:
        return 0
    op.native_first = NULL
    op.native_pending -= 1
    return native_send(ep, op, ptr, op.native_first_len, 0)

cdef void rndv_try_finish(ep_t* ep, sendop_t* op) noexcept nogil:
    """A rendezvous send is done when every chunk was acknowledged and the
    fabric released every native chunk send."""
    cdef sendop_t** p
    if op.acked != op.nchunks or op.native_pending > 0:
        return
    p = &ep.rndv_out
    while p[0] != NULL and p[0] != op:
        p = &p[0].next
    if p[0] != NULL:
        p[0] = op.next
        op_finish(ep, op, EACCES_ if op.any_failed else 0)

cdef void announce_faulty(ep_t* ep, sendop_t* op, uint8_t* room, fab_mr* mr, size_t length) noexcept nogil:
    """Test-only: behave like a broken or hostile peer (FABRIC_FAULT_INJECT)."""
    cdef uint8_t key[MAX_RKEY]
    cdef uint64_t raddr = mr.addr
    memcpy(key, mr.rkey, mr.rkey_len)
    if ep.w.opts.fault == FAULT_BAD_KEY:
        key[0] ^= 0x5A
        key[mr.rkey_len - 1] ^= 0xA5
    else:
        raddr += length            # just past the registered region
    put_rndv(room, op.msg_id, op.announced, op.total, op.msg_off, raddr,
             <uint32_t>length, key, mr.rkey_len)

cdef int announce_more(ep_t* ep, sendop_t* op) noexcept nogil:
    """Keep chunks_in_flight chunks announced once the first one is posted."""
    cdef int made = 0
    if op.head_seq > ep.seq_posted:
        return 0
    while op.announced < op.nchunks:
        if op.window_index[op.announced % ep.w.opts.chunks_in_flight] != NO_CHUNK:
            break
        if announce_chunk(ep, op, 0) != 0:
            return -1
        made = 1
    return made

cdef bint uses_native(ep_t* ep, uint64_t total) noexcept nogil:
    """A rendezvous by the fabric's own protocol rather than our pulls."""
    if not (ep.caps & FAB_CAP_NATIVE_LARGE):       # (ep.ch may be gone: a closed endpoint)
        return 0
    if ep.caps & FAB_CAP_LARGE_NATIVE_ONLY:
        return 1
    return ep.w.opts.native_min != 0 and total >= ep.w.opts.native_min

cdef int start_rndv(ep_t* ep, sendop_t* op) noexcept nogil:
    """Announce the first chunk. -1 failed, 0 started, 1 no slab free yet,
    2 too many chunks."""
    cdef uint32_t w = ep.w.opts.chunks_in_flight
    cdef uint32_t i
    cdef uint64_t nchunks = 0
    cdef size_t limit
    cdef int rc
    op.native = uses_native(ep, op.total)
    limit = chunk_limit(ep, op)
    for i in range(<uint32_t>op.nseg):
        nchunks += (op.segs[i].length + limit - 1) // limit
    if nchunks > 0xFFFFFFF0U:
        return 2
    if op.window == NULL:
        op.window = <fab_mr*>calloc(w, sizeof(fab_mr))
        op.window_index = <uint32_t*>malloc(w * sizeof(uint32_t))
        if op.window == NULL or op.window_index == NULL:
            ep_fail(ep, ENOMEM, "out of memory")
            return -1
        for i in range(w):
            op.window_index[i] = NO_CHUNK
    op.nchunks = <uint32_t>nchunks
    return announce_chunk(ep, op, 1)

cdef int frame_queue(ep_t* ep) noexcept nogil:
    """Turn queued messages into frames, in order. Returns -1 on failure."""
    cdef sendop_t* op
    cdef uint8_t* room
    cdef size_t off
    cdef int i, rc, direct
    while ep.sendq_head != NULL:
        op = ep.sendq_head
        if op.total <= ep.eager_limit:
            direct = ((ep.ch.caps & FAB_CAP_SEND_ANY_MEMORY) and ep.ready_head == NULL
                      and (ep.open_data == NULL or ep.open_data.used == 0)
                      and op.nseg <= MAX_SEGMENTS_ZC and can_post_data(ep))
            ep.sendq_head = op.next
            if ep.sendq_head == NULL:
                ep.sendq_tail = NULL
            if direct:
                if post_zero_copy(ep, op) < 0:
                    return -1
                continue
            room = data_room(ep, FRAME_HEADER + op.total)
            if room == NULL:
                # every slab is in use: put it back, wait for completions
                op.next = ep.sendq_head
                ep.sendq_head = op
                if ep.sendq_tail == NULL:
                    ep.sendq_tail = op
                return 0
            put_header(room, F_EAGER, 0, <uint32_t>op.total, op.msg_id, 0, 0)
            ep.sent_eager += 1
            ep.frames_sent += 1
            off = FRAME_HEADER
            for i in range(op.nseg):
                memcpy(room + off, op.segs[i].ptr, op.segs[i].length)
                off += op.segs[i].length
            op_finish(ep, op, 0)
            if not ep.w.opts.coalesce:
                seal_data(ep)
        else:
            rc = start_rndv(ep, op)
            if rc < 0:
                return -1
            if rc == 1:
                return 0
            ep.sendq_head = op.next
            if ep.sendq_head == NULL:
                ep.sendq_tail = NULL
            if rc == 2:
                op_finish(ep, op, EMSGSIZE)
                continue
            fault_due(ep, FS_RNDV, op.head_seq)
            op.state = OP_RNDV
            op.next = ep.rndv_out
            ep.rndv_out = op
    if ep.close_requested and not ep.close_sent and ep.state == EP_OPEN:
        room = data_room(ep, FRAME_HEADER)
        if room != NULL:
            put_header(room, F_CLOSE, 0, 0, 0, 0, 0)
            ep.close_sent = 1
            fault_due(ep, FS_CLOSE, ep.open_data.seq)
    return 0

cdef int ep_flush(ep_t* ep) noexcept nogil:
    """Frame what is queued and post what credits and the backend allow:
    control frames first (they may use the reserved credits), then data."""
    cdef slab_t* s
    cdef sendop_t* op
    cdef int more, rc
    cdef uint32_t threshold
    if ep.state != EP_OPEN:
        return 0
    # whatever this posts may leave the channel wanting other events (a
    # full socket: EPOLLOUT): it must be re-armed before anyone blocks
    q_add(&ep.w.dirty, &ep.dirty)
    if frame_queue(ep) < 0:
        return -1
    while True:
        more = 0
        if ep.pending_sends < ep.ch.send_depth and ep.peer_credits > 0:
            s = next_to_post(&ep.ctrl_ready_head, &ep.ctrl_ready_tail, &ep.ctrl)
            if s != NULL:
                if post_slab(ep, s) < 0:
                    return -1
                if ep.fault_stage_due:
                    fault_after_post(ep, 1)
                continue
        if can_post_data(ep):
            s = next_to_post(&ep.ready_head, &ep.ready_tail, &ep.open_data)
            if s != NULL:
                ep.seq_posted = s.seq
                if post_slab(ep, s) < 0:
                    return -1
                if ep.fault_stage_due:
                    fault_after_post(ep, 0)
                # slabs freed: queued messages may fit now
                if frame_queue(ep) < 0:
                    return -1
                more = 1
        # rendezvous whose first announcement went out may announce more
        op = ep.rndv_out
        while op != NULL:
            if op.native_first != NULL and native_send_first(ep, op) < 0:
                return -1
            if op.announced < op.nchunks:
                rc = announce_more(ep, op)
                if rc < 0:
                    return -1
                more |= rc
            op = op.next
        if (not more and ep.ctrl == NULL and ep.ctrl_ready_head == NULL
                and ep.pending_sends < ep.ch.send_depth and ep.peer_credits > 0):
            threshold = ep.w.opts.credits // 4
            if threshold < 1:
                threshold = 1
            # Credits owed for credit-only messages do not count: two idle
            # peers would otherwise answer each CREDIT with a CREDIT forever
            # (with credits < 8 the threshold is 1). They ride on the next
            # message, and each explicit CREDIT needs `threshold` real
            # messages first, so at most one is ever owed this way.
            if ep.c2r - ep.c2r_quiet >= threshold:
                # Nothing to piggyback on: return credits explicitly.
                put_header(ctrl_room(ep, FRAME_HEADER), F_CREDIT, 0, 0, 0, 0, 0)
                more = 1
        if not more:
            break
    return 0

cdef void ep_submit(ep_t* ep, sendop_t* op) noexcept nogil:
    """Queue a message (in order) and push out what can go now."""
    if ep.state != EP_OPEN or ep.close_requested or ep.peer_closed:
        op_finish(ep, op, ESHUTDOWN_ if (ep.close_requested or ep.peer_closed or ep.err == ESHUTDOWN_)
                  else (ep.err if ep.err else ECONNRESET))
        return
    ep.next_out_id += 1
    op.msg_id = ep.next_out_id
    op.state = OP_QUEUED
    op.next = NULL
    if ep.sendq_tail == NULL:
        ep.sendq_head = op
    else:
        ep.sendq_tail.next = op
    ep.sendq_tail = op
    ep_flush(ep)


# =========================================================== receive operations

cdef void release_budget(ep_t* ep, size_t charge) noexcept nogil:
    ep.inbuf_bytes -= charge
    if ep.held and ep.inbuf_bytes <= ep.w.opts.recv_budget:
        ep.c2r += ep.held
        ep.held = 0

cdef void inmsg_maybe_free(inmsg_t* m) noexcept nogil:
    cdef desc_t* d
    if m.in_inq or m.in_rndv:
        return
    while m.descs != NULL:
        d = m.descs
        m.descs = d.next
        free(d)
    if m.own_data:
        msg_free(m.data)
    free(m)

cdef void inq_append(ep_t* ep, inmsg_t* m) noexcept nogil:
    m.next = NULL
    m.in_inq = 1
    if ep.inq_tail == NULL:
        ep.inq_head = m
    else:
        ep.inq_tail.next = m
    ep.inq_tail = m

cdef void inq_pop(ep_t* ep) noexcept nogil:
    cdef inmsg_t* m = ep.inq_head
    ep.inq_head = m.next
    if ep.inq_head == NULL:
        ep.inq_tail = NULL
    m.in_inq = 0
    release_budget(ep, m.charge)
    m.charge = 0
    inmsg_maybe_free(m)

cdef void rndv_unlink(ep_t* ep, inmsg_t* m) noexcept nogil:
    cdef inmsg_t** p = &ep.rndv_in
    while p[0] != NULL:
        if p[0] == m:
            p[0] = m.rnext
            break
        p = &p[0].rnext
    m.in_rndv = 0

cdef void chunk_done(ep_t* ep, uint64_t msg_id, uint32_t index, int failed) noexcept nogil:
    cdef uint8_t* room = ctrl_room(ep, FRAME_HEADER)
    if room != NULL:
        put_header(room, F_CHUNK_DONE, DONE_FAILED if failed else 0, 0, msg_id, index, 0)
        fault_due(ep, FS_CHUNK_DONE, 0)

cdef void rndv_check(ep_t* ep, inmsg_t* m) noexcept nogil:
    """A rendezvous message leaves the in-progress list when every chunk was
    announced and answered."""
    cdef desc_t* d
    if m.failed:
        # answer the announced chunks nobody will read
        while m.descs != NULL and not m.descs.reading:
            d = m.descs
            m.descs = d.next
            chunk_done(ep, m.msg_id, d.index, 1)
            release_budget(ep, sizeof(desc_t) + d.rkey_len)
            m.charge -= sizeof(desc_t) + d.rkey_len
            free(d)
    if m.in_rndv and m.next_offset == m.total and m.descs == NULL and m.reads == 0:
        rndv_unlink(ep, m)
        inmsg_maybe_free(m)

cdef int issue_reads(ep_t* ep, inmsg_t* m) noexcept nogil:
    cdef desc_t* d = m.descs
    cdef int rc
    cdef fab_mr* dst_mr = NULL
    if not (ep.ch.caps & FAB_CAP_READ_ANY_MEMORY):
        if not m.dst_registered:
            rc = ep.ch.ops.reg(ep.ch, m.data, m.total, &m.dst_mr)
            if rc < 0:
                ep_fail(ep, -rc, "registering the receive buffer failed")
                return -1
            m.dst_registered = 1
        dst_mr = &m.dst_mr
    while d != NULL and <uint32_t>m.reads < ep.w.opts.chunks_in_flight:
        if not d.reading:
            if d.native:
                rc = ep.ch.ops.recv_large(ep.ch, m.data + d.offset, d.length,
                                          native_tag(m.msg_id, d.index), <uint64_t><size_t>d | TAG_DESC)
            else:
                rc = ep.ch.ops.read(ep.ch, m.data + d.offset, dst_mr, d.length, d.raddr,
                                    d.rkey, d.rkey_len, <uint64_t><size_t>d | TAG_DESC)
            if rc < 0:
                if rc == -EINVAL and not ep.ch.failed:
                    # the peer offered a key this fabric cannot use
                    m.failed = 1
                    d.reading = 1
                    m.reads += 1
                    on_read_done(ep, d, -EACCES_)
                    return 0
                ep_channel_failed(ep)
                return -1
            d.reading = 1
            m.reads += 1
            if ep.w.opts.fault_stage == FS_PULL and d.index == 0 and fault_fires(ep, FS_PULL):
                send_garbage(ep)
        d = d.next
    return 0

cdef void on_read_done(ep_t* ep, desc_t* d, int status) noexcept nogil:
    cdef inmsg_t* m = d.msg
    cdef desc_t** p = &m.descs
    d.reading = 0
    m.reads -= 1
    while p[0] != NULL:
        if p[0] == d:
            p[0] = d.next
            break
        p = &p[0].next
    if status < 0:
        m.failed = 1
    else:
        m.received += d.length
    chunk_done(ep, m.msg_id, d.index, status < 0)
    release_budget(ep, sizeof(desc_t) + d.rkey_len)
    m.charge -= sizeof(desc_t) + d.rkey_len
    free(d)
    if m.dst_registered and m.reads == 0 and (m.failed or m.received == m.total):
        ep.ch.ops.dereg(ep.ch, &m.dst_mr)
        m.dst_registered = 0
    if not m.failed and m.bound:
        issue_reads(ep, m)
    rndv_check(ep, m)

cdef int bind_rndv(ep_t* ep, inmsg_t* m, char* dst) noexcept nogil:
    """Give a rendezvous message its destination and start pulling."""
    if dst == NULL:
        dst = msg_alloc(m.total)
        if dst == NULL:
            return -ENOMEM
        m.own_data = 1
    m.data = dst
    m.bound = 1
    if not m.failed:
        return issue_reads(ep, m)
    return 0

cdef void ep_deliver(ep_t* ep) noexcept nogil:
    """Match the head message to the posted receive, in order; then return
    the credits that freed (the peer may be waiting for them)."""
    cdef uint32_t before = ep.c2r
    if ep.state == EP_OPEN:
        q_add(&ep.w.dirty, &ep.dirty)     # binding a message starts reads (see ep_flush)
    match_posted(ep)
    if ep.c2r != before and ep.state == EP_OPEN:
        ep_flush(ep)

cdef void match_posted(ep_t* ep) noexcept nogil:
    cdef posted_t* p = &ep.posted
    cdef inmsg_t* m = ep.inq_head
    cdef int rc
    if not p.active or p.done or p.withdrawing:
        return
    if p.msg == NULL:
        if m == NULL:
            if ep.state == EP_DEAD or ep.state == EP_FAILED or ep.peer_closed:
                p.done = 1
                p.err = ESHUTDOWN_ if (ep.peer_closed or ep.err == ESHUTDOWN_) else (ep.err or ECONNRESET)
            return
        if p.dst != NULL and m.total > p.cap:
            p.done = 1
            p.err = EMSGSIZE
            p.length = m.total
            return
        if not m.rndv:
            p.length = m.total
            if p.dst != NULL:
                memcpy(p.dst, m.data, m.total)
            else:
                p.result = m.data
                m.own_data = 0
            p.done = 1
            inq_pop(ep)
            return
        if m.failed:
            p.done = 1
            p.err = EACCES_
            inq_pop(ep)
            return
        if not m.bound:
            rc = bind_rndv(ep, m, p.dst)
            if rc < 0:
                p.done = 1
                p.err = -rc
                return
        p.msg = m
    m = p.msg
    if m.failed:
        p.done = 1
        p.err = EACCES_
        p.msg = NULL
        inq_pop(ep)
    elif m.received == m.total:
        p.length = m.total
        if p.dst == NULL:
            p.result = m.data
            m.own_data = 0
        elif m.data != p.dst:
            memcpy(p.dst, m.data, m.total)   # pulled ahead before recv_into was posted
            ep.rndv_copied += 1
        # how the application takes large messages decides whether the next
        # ones are pulled into our memory before it asks: a wrong guess costs
        # recv_into a copy and fresh pages for every message
        ep.pull_ahead = p.dst == NULL
        p.done = 1
        p.msg = NULL
        inq_pop(ep)
    elif ep.state == EP_DEAD or ep.state == EP_FAILED:
        p.done = 1
        p.err = ep.err or ECONNRESET
        p.msg = NULL

cdef void ep_post(ep_t* ep, char* dst, size_t cap) noexcept nogil:
    """Post the endpoint's one receive: dst/cap for recv_into, NULL for recv."""
    cdef posted_t* p = &ep.posted
    memset(p, 0, sizeof(posted_t))
    p.active = 1
    p.dst = dst
    p.cap = cap
    ep_deliver(ep)
    if not p.done and ep.state == EP_OPEN:
        progress_ep(ep)

cdef void pull_ahead(ep_t* ep) noexcept nogil:
    """Start pulling the next rendezvous message into memory of our own when
    nobody has posted a receive yet (bounded by recv_budget): it keeps two
    peers that both send large messages from waiting on each other, and
    overlaps the transfer with the application's work after recv()."""
    cdef inmsg_t* m = ep.inq_head
    while m != NULL:
        if m.rndv and not m.bound and not m.failed:
            if ep.inbuf_bytes + m.total > ep.w.opts.recv_budget:
                return
            if bind_rndv(ep, m, NULL) < 0:
                return
            ep.inbuf_bytes += m.total
            m.charge += m.total
            if not ep.peer_closed:
                return
        elif m.rndv and m.received < m.total and not ep.peer_closed:
            return      # one message pulled ahead at a time (all once the peer is leaving)
        m = m.next

cdef int on_eager(ep_t* ep, frame_t* f) noexcept nogil:
    cdef posted_t* p = &ep.posted
    cdef inmsg_t* m
    if f.msg_id != ep.next_in_id:
        ep_fail(ep, EPROTO, "peer sent a message out of sequence")
        return -1
    ep.next_in_id += 1
    if (p.active and not p.done and not p.withdrawing and p.msg == NULL and p.dst != NULL
            and ep.inq_head == NULL and f.body_length <= p.cap):
        memcpy(p.dst, f.body, f.body_length)     # straight into recv_into's buffer
        p.length = f.body_length
        p.done = 1
        return 0
    m = <inmsg_t*>calloc(1, sizeof(inmsg_t))
    if m == NULL:
        ep_fail(ep, ENOMEM, "out of memory")
        return -1
    m.msg_id = f.msg_id
    m.total = f.body_length
    m.data = msg_alloc(f.body_length)
    if m.data == NULL:
        free(m)
        ep_fail(ep, ENOMEM, "out of memory")
        return -1
    memcpy(m.data, f.body, f.body_length)
    m.own_data = 1
    m.received = m.total
    m.charge = f.body_length + sizeof(inmsg_t)
    ep.inbuf_bytes += m.charge
    inq_append(ep, m)
    return 0

cdef int on_rndv(ep_t* ep, frame_t* f) noexcept nogil:
    cdef inmsg_t* m
    cdef desc_t* d
    cdef desc_t** tail
    cdef size_t size
    if f.aux == 0:
        if f.msg_id != ep.next_in_id:
            ep_fail(ep, EPROTO, "peer sent a message out of sequence")
            return -1
        if f.offset != 0:
            ep_fail(ep, EPROTO, "peer's first chunk does not start at offset 0")
            return -1
        if f.total > ep.w.opts.max_message:
            ep_fail(ep, EPROTO, "peer announced a message larger than max_message")
            return -1
        ep.next_in_id += 1
        m = <inmsg_t*>calloc(1, sizeof(inmsg_t))
        if m == NULL:
            ep_fail(ep, ENOMEM, "out of memory")
            return -1
        m.msg_id = f.msg_id
        m.rndv = 1
        m.total = f.total
        m.charge = sizeof(inmsg_t)
        ep.inbuf_bytes += m.charge
        inq_append(ep, m)
        m.in_rndv = 1
        m.rnext = ep.rndv_in
        ep.rndv_in = m
    else:
        m = ep.rndv_in
        while m != NULL and m.msg_id != f.msg_id:
            m = m.rnext
        if m == NULL or f.total != m.total or f.aux != m.next_index or f.offset != m.next_offset:
            ep_fail(ep, EPROTO, "peer announced a chunk out of order")
            return -1
    m.next_index += 1
    m.next_offset += f.length
    if m.failed:
        chunk_done(ep, m.msg_id, f.aux, 1)
        rndv_check(ep, m)
        return 0
    size = sizeof(desc_t) + f.rkey_len
    d = <desc_t*>malloc(size)
    if d == NULL:
        ep_fail(ep, ENOMEM, "out of memory")
        return -1
    d.next = NULL
    d.msg = m
    d.index = f.aux
    d.reading = 0
    d.offset = f.offset
    d.raddr = f.raddr
    d.length = f.length
    d.native = f.flags & RNDV_NATIVE
    if d.native and ep.ch.ops.recv_large == NULL:
        free(d)
        ep_fail(ep, EPROTO, "peer announced a native chunk this fabric cannot receive")
        return -1
    d.rkey_len = f.rkey_len
    d.rkey = <uint8_t*>(<char*>d + sizeof(desc_t))
    memcpy(d.rkey, f.rkey, f.rkey_len)
    tail = &m.descs
    while tail[0] != NULL:
        tail = &tail[0].next
    tail[0] = d
    m.charge += size
    ep.inbuf_bytes += size
    if m.bound:
        return issue_reads(ep, m)
    return 0

cdef int on_chunk_done(ep_t* ep, frame_t* f) noexcept nogil:
    cdef sendop_t** p = &ep.rndv_out
    cdef sendop_t* op
    cdef uint32_t slot
    while p[0] != NULL and p[0].msg_id != f.msg_id:
        p = &p[0].next
    op = p[0]
    if op == NULL:
        ep_fail(ep, EPROTO, "peer acknowledged a chunk of an unknown message")
        return -1
    slot = f.aux % ep.w.opts.chunks_in_flight
    if f.aux >= op.announced or op.window_index[slot] != f.aux:
        ep_fail(ep, EPROTO, "peer acknowledged a chunk that is not in flight")
        return -1
    if not op.native:
        ep.ch.ops.dereg(ep.ch, &op.window[slot])
    op.window_index[slot] = NO_CHUNK
    op.acked += 1
    if f.flags & DONE_FAILED:
        op.any_failed = 1
    if op.acked == op.nchunks:
        rndv_try_finish(ep, op)
        return 0
    if announce_more(ep, op) < 0:
        return -1
    return 0

cdef int on_hello(ep_t* ep, frame_t* f) noexcept nogil:
    cdef size_t cap
    if ep.state != EP_HANDSHAKE:
        ep_fail(ep, EPROTO, "peer repeated its HELLO")
        return -1
    if f.hello_max_recv < 1024 or f.hello_credits < CREDIT_RESERVE + 1:
        ep_fail(ep, EPROTO, "peer offers too little receive space")
        return -1
    if f.hello_credits > 65536:
        ep_fail(ep, EPROTO, "peer offers an implausible number of credits")
        return -1
    ep.caps = ep.ch.caps          # settled by now (a backend may narrow them while connecting)
    ep.peer_credits = <int>f.hello_credits
    ep.peer_max_recv = f.hello_max_recv
    ep.peer_max_message = f.hello_max_message
    cap = ep.w.opts.coalesce_limit
    if cap < ep.w.opts.eager_limit + FRAME_HEADER:
        cap = ep.w.opts.eager_limit + FRAME_HEADER
    if cap > f.hello_max_recv:
        cap = f.hello_max_recv
    if cap < 1024:
        cap = 1024
    ep.slab_cap = cap
    ep.eager_limit = ep.w.opts.eager_limit
    if ep.eager_limit > cap - FRAME_HEADER:
        ep.eager_limit = cap - FRAME_HEADER
    ep.state = EP_OPEN
    ep.opened = 1
    return 0

cdef int on_fabric_msg(ep_t* ep, const uint8_t* data, size_t length) noexcept nogil:
    """Handle every frame of one received fabric message."""
    cdef size_t pos = 0
    cdef int used, counts = 1, only_credits = 1
    cdef frame_t f
    cdef const char* error = NULL
    ep.fabric_recvs += 1
    while pos < length:
        used = parse_frame(data + pos, length - pos, &f, &error)
        if used < 0:
            ep_fail(ep, EPROTO, error)
            return -1
        pos += <size_t>used
        ep.frames_received += 1
        ep.peer_credits += <int>f.credits
        if ep.peer_credits > 1 << 20:
            ep_fail(ep, EPROTO, "peer returned more credits than it was given")
            return -1
        if f.type == F_HELLO:
            counts = 0        # HELLO arrives before any credit was granted
            if on_hello(ep, &f) < 0:
                return -1
            continue
        if ep.state == EP_HANDSHAKE:
            ep_fail(ep, EPROTO, "peer sent frames before its HELLO")
            return -1
        if f.type != F_CREDIT:
            only_credits = 0
        if ep.peer_closed and f.type != F_CREDIT and f.type != F_CHUNK_DONE:
            ep_fail(ep, EPROTO, "peer sent frames after CLOSE")
            return -1
        if f.type == F_EAGER:
            if on_eager(ep, &f) < 0:
                return -1
        elif f.type == F_RNDV:
            if on_rndv(ep, &f) < 0:
                return -1
        elif f.type == F_CHUNK_DONE:
            if on_chunk_done(ep, &f) < 0:
                return -1
        elif f.type == F_CLOSE:
            on_peer_close(ep)
    if counts:
        if only_credits:
            ep.c2r += 1       # no data held: back at once, but not worth a CREDIT of its own
            ep.c2r_quiet += 1
        elif ep.inbuf_bytes > ep.w.opts.recv_budget:
            ep.held += 1      # bound the peer: its credit comes back when the app receives
        else:
            ep.c2r += 1
    return 0

cdef void fail_op_list(ep_t* ep, sendop_t* op, int err) noexcept nogil:
    cdef sendop_t* n
    while op != NULL:
        n = op.next
        op_finish(ep, op, err)
        op = n

cdef void on_peer_close(ep_t* ep) noexcept nogil:
    """The peer will receive nothing more: what we still want to send fails,
    and we answer with our own CLOSE so its close() need not linger."""
    ep.peer_closed = 1
    ep.pull_ahead = 1      # the peer waits to release its buffers: take its messages now
    fail_op_list(ep, ep.sendq_head, ESHUTDOWN_)
    ep.sendq_head = NULL
    ep.sendq_tail = NULL
    ep.close_requested = 1


# ==================================================================== progress

cdef void ep_settle(ep_t* ep) noexcept nogil:
    """Finish a failed endpoint: close the channel (the backend then touches no
    memory of ours), fail every operation, keep complete received messages."""
    cdef slab_t* s
    cdef inmsg_t* m
    cdef inmsg_t* prev
    cdef inmsg_t* n
    cdef desc_t* d
    cdef sendop_t* op
    cdef int err
    if ep.state != EP_FAILED:
        return
    ep.state = EP_DEAD
    err = ep.err
    touch(ep.w, &ep.node)
    if ep.ch != NULL:
        if ep.ch.fd >= 0:
            epoll_ctl(ep.w.epfd, EPOLL_CTL_DEL, ep.ch.fd, NULL)
        ep.ch.ops.close(ep.ch)   # releases every registration too
        ep.ch = NULL
    free_slab_list(ep.free_slabs)
    free_slab_list(ep.open_data)
    free_slab_list(ep.ready_head)
    free_slab_list(ep.ctrl)
    free_slab_list(ep.ctrl_ready_head)
    free_slab_list(ep.inflight)
    ep.free_slabs = ep.open_data = ep.ready_head = ep.ready_tail = NULL
    ep.ctrl = ep.ctrl_ready_head = ep.ctrl_ready_tail = ep.inflight = NULL
    fail_op_list(ep, ep.sendq_head, err)
    fail_op_list(ep, ep.zc_out, err)
    fail_op_list(ep, ep.rndv_out, err)
    ep.sendq_head = ep.sendq_tail = ep.zc_out = ep.rndv_out = NULL
    # Incomplete rendezvous messages are lost with the connection; complete
    # messages before the first incomplete one stay receivable, in order.
    while ep.rndv_in != NULL:
        m = ep.rndv_in
        ep.rndv_in = m.rnext
        m.in_rndv = 0
        while m.descs != NULL:
            d = m.descs
            m.descs = d.next
            free(d)
        m.reads = 0
        m.dst_registered = 0
    if ep.posted.msg != NULL and ep.posted.msg.received < ep.posted.msg.total:
        ep.posted.msg = NULL
        ep.posted.done = 1
        ep.posted.err = err
    prev = NULL
    m = ep.inq_head
    while m != NULL and not (m.rndv and m.received < m.total):
        prev = m
        m = m.next
    if m != NULL:
        if prev == NULL:
            ep.inq_head = NULL
        else:
            prev.next = NULL
        ep.inq_tail = prev
        while m != NULL:
            n = m.next
            m.in_inq = 0
            ep.inbuf_bytes -= m.charge
            inmsg_maybe_free(m)
            m = n
    ep_deliver(ep)
cdef void progress_ep_own(ep_t* ep) noexcept nogil:
    """Non-blocking progress of one endpoint's channel (not its hub)."""
    cdef fab_completion ev[MAX_EVENTS]
    cdef int n, i, k, before = ep.state, moved = 0
    cdef uint64_t tag
    cdef void* obj
    cdef slab_t** sp
    cdef sendop_t** op_p
    if ep.state == EP_OPEN or ep.state == EP_HANDSHAKE:
        for k in range(8):    # bounded, so one busy endpoint cannot starve others
            n = ep.ch.ops.poll(ep.ch, ev, MAX_EVENTS)
            ep.ch.revents = 0
            moved |= n
            for i in range(n):
                if ep.state != EP_OPEN and ep.state != EP_HANDSHAKE:
                    break
                if ev[i].kind == FAB_EV_RECV:
                    on_fabric_msg(ep, <uint8_t*>ev[i].data, ev[i].length)
                elif ev[i].kind == FAB_EV_SEND:
                    tag = ev[i].ctx & TAG_MASK
                    obj = <void*><size_t>(ev[i].ctx & ~<uint64_t>TAG_MASK)
                    if ev[i].ctx == 0:
                        ep.pending_sends -= 1
                    elif tag == TAG_SLAB:
                        sp = &ep.inflight
                        while sp[0] != NULL and sp[0] != <slab_t*>obj:
                            sp = &sp[0].next
                        if sp[0] != NULL:
                            sp[0] = (<slab_t*>obj).next
                            slab_put(ep, <slab_t*>obj)
                        ep.pending_sends -= 1
                    elif tag == TAG_NATIVE:
                        (<sendop_t*>obj).native_pending -= 1
                        rndv_try_finish(ep, <sendop_t*>obj)
                    elif tag == TAG_OP:
                        op_p = &ep.zc_out
                        while op_p[0] != NULL and op_p[0] != <sendop_t*>obj:
                            op_p = &op_p[0].next
                        if op_p[0] != NULL:
                            op_p[0] = (<sendop_t*>obj).next
                            op_finish(ep, <sendop_t*>obj, 0)
                        ep.pending_sends -= 1
                elif ev[i].kind == FAB_EV_READ:
                    on_read_done(ep, <desc_t*><size_t>(ev[i].ctx & ~<uint64_t>TAG_MASK), ev[i].status)
                elif ev[i].kind == FAB_EV_FAILED:
                    ep_channel_failed(ep)
            if ep.state == EP_OPEN:
                ep_flush(ep)
            if n < MAX_EVENTS:
                break
    if ep.state == EP_OPEN:
        # (a posted recv() binds the message it takes itself, in ep_deliver;
        # pulling past it would guess wrong for a reader of headers with
        # recv() and bodies with recv_into())
        if ep.pull_ahead or ep.send_waiters:
            pull_ahead(ep)
        ep_deliver(ep)
    ep_settle(ep)
    if ep.state == EP_OPEN or ep.state == EP_HANDSHAKE:
        q_add(&ep.w.dirty, &ep.dirty)
    if moved or ep.state != before:
        touch(ep.w, &ep.node)

cdef void hub_run(worker_t* w) noexcept nogil:
    """Drive the shared engine of the domain, then progress every channel it
    marked ready (and only those)."""
    cdef fab_hub* hub = w.hub
    cdef fab_channel* ch
    cdef ep_t* ep
    if hub == NULL:
        return
    w.hub_pass += 1
    hub.progress(hub)
    while True:
        ch = hub_pop_ready(hub)
        if ch == NULL:
            break
        ep = <ep_t*>ch.owner
        if ep == NULL:
            continue
        ep.hub_pass = w.hub_pass
        progress_ep_own(ep)
        if ep.listener != NULL:
            listener_sweep(ep.listener)

cdef void progress_ep(ep_t* ep) noexcept nogil:
    """Non-blocking progress of one endpoint (its hub first, if it has one:
    the hub is where its completions come from)."""
    cdef worker_t* w = ep.w
    if ep.ch != NULL and ep.ch.hub != NULL and (ep.state == EP_OPEN or ep.state == EP_HANDSHAKE):
        hub_run(w)
        if ep.hub_pass == w.hub_pass:
            return            # progressed by the hub just now
    progress_ep_own(ep)


# ====================================================================== worker

cdef inline void q_add(qlink_t** head, qlink_t* l) noexcept nogil:
    if l.queued:
        return
    l.queued = 1
    l.prev = NULL
    l.next = head[0]
    if head[0] != NULL:
        head[0].prev = l
    head[0] = l

cdef inline void q_remove(qlink_t** head, qlink_t* l) noexcept nogil:
    if not l.queued:
        return
    if l.prev != NULL:
        l.prev.next = l.next
    else:
        head[0] = l.next
    if l.next != NULL:
        l.next.prev = l.prev
    l.prev = l.next = NULL
    l.queued = 0

cdef inline void* q_pop(qlink_t** head) noexcept nogil:
    cdef qlink_t* l = head[0]
    if l == NULL:
        return NULL
    q_remove(head, l)
    return l.obj

cdef inline void touch(worker_t* w, node_t* node) noexcept nogil:
    """Tell an event loop that uses this worker that node moved."""
    node.gen += 1
    w.gen += 1
    if w.loop_attached and node.key:
        q_add(&w.touched, &node.touched)

cdef uint64_t node_register(worker_t* w, node_t* node, int fd, uint32_t events) noexcept nogil:
    cdef uint32_t i, n
    cdef node_t** grown
    cdef uint32_t* ggens
    cdef epoll_event ev
    for i in range(w.nslots):
        if w.slots[i] == NULL:
            break
    else:
        n = w.nslots * 2 if w.nslots else 16
        grown = <node_t**>realloc(w.slots, n * sizeof(node_t*))
        if grown == NULL:
            return 0
        w.slots = grown
        ggens = <uint32_t*>realloc(w.gens, n * sizeof(uint32_t))
        if ggens == NULL:
            return 0
        w.gens = ggens
        for i in range(w.nslots, n):
            w.slots[i] = NULL
            w.gens[i] = 0
        i = w.nslots
        w.nslots = n
    w.gens[i] += 1
    w.slots[i] = node
    node.slot = i
    node.key = (<uint64_t>w.gens[i] << 32) | i
    node.touched.obj = node
    ev.events = events
    ev.data.u64 = node.key
    if fd >= 0 and epoll_ctl(w.epfd, EPOLL_CTL_ADD, fd, &ev) != 0:
        w.slots[i] = NULL
        node.key = 0
        return 0
    return node.key

cdef void node_unregister(worker_t* w, node_t* node) noexcept nogil:
    if node.key and node.slot < w.nslots and w.slots[node.slot] == node:
        w.slots[node.slot] = NULL
    node.key = 0

cdef node_t* node_lookup(worker_t* w, uint64_t key) noexcept nogil:
    cdef uint32_t slot = <uint32_t>(key & 0xFFFFFFFFU)
    if slot >= w.nslots or w.slots[slot] == NULL or w.slots[slot].key != key:
        return NULL
    return w.slots[slot]

cdef int fault_fires(ep_t* ep, int stage) noexcept nogil:
    """Test-only: this stage is where the configured fault happens now."""
    cdef opts_t* o = &ep.w.opts
    if o.fault_stage != stage:
        return 0
    o.fault_count -= 1
    if o.fault_count != 0:
        return 0
    if o.fault_action == FA_DIE:
        kill(getpid(), SIGKILL)
    return 1

cdef void send_garbage(ep_t* ep) noexcept nogil:
    """Test-only: a fabric message that is no frame at all (bad magic)."""
    cdef iovec v
    cdef int rc
    v.iov_base = GARBAGE
    v.iov_len = 64
    ep.peer_credits -= 1
    rc = ep.ch.ops.send(ep.ch, &v, NULL, 1, 0)      # verbs: inline, needs no registration
    if rc == FAB_PENDING:
        ep.pending_sends += 1
    elif rc < 0:
        ep_channel_failed(ep)

cdef void fault_after_post(ep_t* ep, int control) noexcept nogil:
    """Test-only: a due stage fault fires once its frame has been posted."""
    cdef int stage = ep.fault_stage_due
    if stage == 0:
        return
    if control:
        if ep.fault_seq != 0:
            return
    elif ep.fault_seq == 0 or ep.seq_posted < ep.fault_seq:
        return
    ep.fault_stage_due = 0
    if fault_fires(ep, stage):
        send_garbage(ep)

cdef inline void fault_due(ep_t* ep, int stage, uint64_t seq) noexcept nogil:
    if ep.w.opts.fault_stage == stage and ep.fault_stage_due == 0:
        ep.fault_stage_due = stage
        ep.fault_seq = seq

cdef void fault_batch(ep_t* ep, slab_t* s) noexcept nogil:
    """Test-only: a batch of 3+ frames is about to be posted."""
    cdef uint32_t first
    if s.frames < 3 or not fault_fires(ep, FS_BATCH):
        return
    first = rd32(s.data + 4)                  # body length of the first frame
    if FRAME_HEADER + first < s.used:
        s.data[FRAME_HEADER + first] ^= 0xFF  # the second frame's magic

cdef void send_hello(ep_t* ep) noexcept nogil:
    cdef iovec v
    cdef int rc
    cdef size_t max_recv = ep.ch.max_recv
    if ep.w.opts.fault_stage == FS_HELLO and fault_fires(ep, FS_HELLO):
        send_garbage(ep)          # instead of HELLO
        return
    put_hello(ep.hello, <uint32_t>max_recv, ep.w.opts.credits, ep.w.opts.max_message)
    v.iov_base = ep.hello
    v.iov_len = FRAME_HEADER + HELLO_BODY
    if not (ep.ch.caps & FAB_CAP_SEND_ANY_MEMORY):
        ep.hello_mr = <fab_mr*>calloc(1, sizeof(fab_mr))
        if ep.hello_mr == NULL or ep.ch.ops.reg(ep.ch, ep.hello, sizeof(ep.hello), ep.hello_mr) < 0:
            ep_fail(ep, ENOMEM, "cannot register the handshake buffer")
            return
        ep.own_regions += 1
    rc = ep.ch.ops.send(ep.ch, &v, &ep.hello_mr if ep.hello_mr != NULL else NULL, 1, 0)
    if rc == FAB_PENDING:
        ep.pending_sends += 1
    elif rc < 0:
        ep_channel_failed(ep)

cdef ep_t* ep_create(worker_t* w, fab_channel* ch) noexcept nogil:
    """A new endpoint in HANDSHAKE state on a connected channel; sends HELLO.
    Takes ownership of ch (closes it on failure)."""
    cdef ep_t* ep = <ep_t*>calloc(1, sizeof(ep_t))
    if ep == NULL:
        ch.ops.close(ch)
        return NULL
    ep.node.kind = KIND_EP
    ep.w = w
    ep.ch = ch
    ep.caps = ch.caps
    memcpy(ep.local_name, ch.local_name, 64)
    memcpy(ep.peer_name, ch.peer_name, 64)
    ep.local_name[63] = 0
    ep.peer_name[63] = 0
    ep.dirty.obj = ep
    ep.runnable.obj = ep
    ch.owner = ep
    ep.state = EP_HANDSHAKE
    ep.next_in_id = 1
    ep.armed = EPOLLIN
    # until the application shows it takes large messages with recv_into(),
    # pull them into our memory as they come (within recv_budget): a thread
    # that sends before it receives must not wait for itself
    ep.pull_ahead = 1
    if node_register(w, &ep.node, ch.fd, EPOLLIN) == 0:
        ch.owner = NULL
        ch.ops.close(ch)
        free(ep)
        return NULL
    q_add(&w.dirty, &ep.dirty)
    send_hello(ep)
    return ep

cdef void worker_kick(worker_t* w) noexcept nogil:
    """Wake every thread waiting in this worker so it re-checks its state."""
    cdef uint64_t one = 1
    if w.polling:
        write(w.wake_fd, &one, 8)
    pthread_cond_broadcast(&w.cond)
    notify_loop(w)

cdef void ep_close(ep_t* ep) noexcept nogil:
    """Close locally (lock held): fail what is pending, release the channel
    and the messages. The struct stays valid (threads may still be inside a
    call on it) until ep_free."""
    if ep.closed:
        return
    ep.closed = 1
    if ep.state != EP_DEAD:
        ep_fail(ep, ESHUTDOWN_, "endpoint closed")
        ep_settle(ep)
    touch(ep.w, &ep.node)
    node_unregister(ep.w, &ep.node)
    q_remove(&ep.w.dirty, &ep.dirty)
    q_remove(&ep.w.runnable, &ep.runnable)
    if not ep.posted.active:
        while ep.inq_head != NULL:
            inq_pop(ep)
    worker_kick(ep.w)

cdef void ep_free(ep_t* ep) noexcept nogil:
    """Close and free (lock held); nobody may reference ep afterwards."""
    ep_close(ep)
    q_remove(&ep.w.touched, &ep.node.touched)
    while ep.inq_head != NULL:
        inq_pop(ep)
    if ep.posted.result != NULL:
        free(ep.posted.result)
    free(ep.stash_data)
    free(ep.hello_mr)
    free(ep)

cdef uint32_t our_max_recv(worker_t* w) noexcept nogil:
    cdef size_t cap = w.opts.coalesce_limit
    if cap < w.opts.eager_limit + FRAME_HEADER:
        cap = w.opts.eager_limit + FRAME_HEADER
    if cap < 1024:
        cap = 1024
    return <uint32_t>cap

cdef void progress_listener(lst_t* l) noexcept nogil:
    cdef fab_channel* ch
    cdef ep_t* ep
    cdef int rc
    if l.closed:
        return
    while not l.closed and l.npending < MAX_PENDING_HANDSHAKES:
        rc = l.fl.accept(l.fl, our_max_recv(l.w), &ch)
        if rc != 0:
            break
        ep = ep_create(l.w, ch)
        if ep == NULL:
            continue
        ep.listener = l
        ep.hs_deadline = monotonic_now() + l.w.opts.handshake_timeout
        ep.lst_next = l.pending
        l.pending = ep
        l.npending += 1
        progress_ep(ep)
    listener_sweep(l)

cdef void listener_sweep(lst_t* l) noexcept nogil:
    """Move finished handshakes to the ready queue; drop failed or expired
    ones (garbage, slow or vanished clients never reach accept()). A
    connection that failed after its handshake is still handed out, like
    an accepted socket that was reset: what its peer sent before stays
    receivable, then the error."""
    cdef ep_t** p = &l.pending
    cdef ep_t* ep
    cdef double now = monotonic_now()
    while p[0] != NULL:
        ep = p[0]
        if ep.state == EP_HANDSHAKE and now > ep.hs_deadline:
            ep_fail(ep, ETIMEDOUT, "handshake timed out")
            ep_settle(ep)
        if ep.state == EP_HANDSHAKE:
            p = &ep.lst_next
            continue
        p[0] = ep.lst_next
        l.npending -= 1
        ep.lst_next = NULL
        if ep.opened:
            ep_settle(ep)
            if l.ready_tail == NULL:
                l.ready_head = ep
            else:
                l.ready_tail.lst_next = ep
            l.ready_tail = ep
            touch(l.w, &l.node)
        else:
            ep.listener = NULL
            ep_free(ep)

cdef double next_handshake_deadline(worker_t* w) noexcept nogil:
    """The earliest handshake deadline of any listener (-1: none), so a
    blocked waiter wakes to expire a handshake nobody finishes."""
    cdef uint32_t i
    cdef lst_t* l
    cdef ep_t* ep
    cdef double best = -1.0
    for i in range(w.nslots):
        if w.slots[i] == NULL or w.slots[i].kind != KIND_LST:
            continue
        l = <lst_t*>w.slots[i]
        ep = l.pending
        while ep != NULL:
            if best < 0 or ep.hs_deadline < best:
                best = ep.hs_deadline
            ep = ep.lst_next
    return best

cdef void progress_node(worker_t* w, node_t* node) noexcept nogil:
    cdef ep_t* ep
    if node.kind == KIND_EP:
        ep = <ep_t*>node
        progress_ep(ep)
        if ep.listener != NULL:
            listener_sweep(ep.listener)
    else:
        progress_listener(<lst_t*>node)

cdef void progress_all(worker_t* w) noexcept nogil:
    """Every endpoint and listener once (fabric.progress(): the caller asks
    for everything; waits progress only what has events)."""
    cdef uint32_t i
    hub_run(w)
    for i in range(w.nslots):
        if w.slots[i] != NULL:
            progress_node(w, w.slots[i])

cdef int arm_all(worker_t* w) noexcept nogil:
    """Prepare for blocking: re-arm the endpoints touched since the last time
    (only those: an untouched channel's interest set is still right) and the
    hub. Returns 1 if progress is possible now (see progress_runnable)."""
    cdef uint32_t events
    cdef ep_t* ep
    cdef epoll_event ev
    cdef int ready = 0
    while True:
        ep = <ep_t*>q_pop(&w.dirty)
        if ep == NULL:
            break
        if ep.state != EP_OPEN and ep.state != EP_HANDSHAKE:
            continue
        events = EPOLLIN
        if ep.ch.ops.arm(ep.ch, &events):
            q_add(&w.runnable, &ep.runnable)
            continue
        if events != ep.armed and ep.ch.fd >= 0:
            ev.events = events
            ev.data.u64 = ep.node.key
            epoll_ctl(w.epfd, EPOLL_CTL_MOD, ep.ch.fd, &ev)
            ep.armed = events
    if w.hub != NULL and (w.hub.ready != NULL or w.hub.arm(w.hub)):
        w.hub_pending = 1
    return w.runnable != NULL or w.hub_pending

cdef void progress_runnable(worker_t* w) noexcept nogil:
    """Progress what arm_all found able to progress without waiting."""
    cdef ep_t* ep
    if w.hub_pending:
        w.hub_pending = 0
        hub_run(w)
    while True:
        ep = <ep_t*>q_pop(&w.runnable)
        if ep == NULL:
            break
        progress_node(w, &ep.node)

cdef void handle_events(worker_t* w, epoll_event* evs, int n) noexcept nogil:
    cdef int i
    cdef node_t* node
    for i in range(n):
        if evs[i].data.u64 == WAKE_KEY:
            drain_wake(w)
        elif evs[i].data.u64 == HUB_KEY:
            w.hub_pending = 1
        else:
            node = node_lookup(w, evs[i].data.u64)
            if node != NULL:
                if node.kind == KIND_EP and (<ep_t*>node).ch != NULL:
                    (<ep_t*>node).ch.revents = evs[i].events
                progress_node(w, node)
    progress_runnable(w)

cdef inline void notify_loop(worker_t* w) noexcept nogil:
    """Progress made outside the event loop may have finished what its
    coroutines wait for: make the loop look. That includes progress made by
    a call on the loop's own thread outside poll_events() (Request.done()
    in one coroutine may take the message another one awaits): only
    poll_events() hands `touched` to the waiters, and the socket it drained
    no longer makes fileno() readable."""
    cdef uint64_t one = 1
    # Also while the loop is not watching: a coroutine between its last check
    # and its next wait must still learn that something happened meanwhile.
    if (w.loop_polling or w.loop_attached) and w.touched != NULL and w.notify_fd >= 0:
        write(w.notify_fd, &one, 8)

cdef void drain_wake(worker_t* w) noexcept nogil:
    cdef uint64_t junk
    read(w.wake_fd, &junk, 8)

cdef void* progress_thread_main(void* arg) noexcept nogil:
    """Background progress. A TCP peer's pull, a full socket, a rendezvous
    release or the peer's CLOSE must not wait until the application calls
    fabric again. The thread stays asleep while an application thread is in
    the engine or was there within BG_GRACE (so it does not compete with an
    active application for the CPU); after that it blocks in epoll and
    progresses what has events. An application thread that starts to block
    kicks it out of epoll (wake_fd) and takes over."""
    cdef worker_t* w = <worker_t*>arg
    cdef timespec ts
    cdef epoll_event evs[64]
    cdef int n, ms
    cdef double now, resume, hs
    wlock(w)
    while not w.bg_stop:
        if w.polling:
            w.bg_state = BG_BEHIND_POLLER
            pthread_cond_wait(&w.bg_cond, &w.lock)
            continue
        now = monotonic_now()
        if w.loop_polling and now - w.last_app < 1.0:
            # An event loop polls for us. Should it stop running without
            # saying so, we take over after a second (and notify it).
            w.bg_state = BG_BEHIND_POLLER
            clock_gettime(CLOCK_MONOTONIC, &ts)
            ts.tv_sec += 1
            pthread_cond_timedwait(&w.bg_cond, &w.lock, &ts)
            continue
        resume = w.last_app + BG_GRACE
        if now < resume:
            w.bg_state = BG_WATCHING
            clock_gettime(CLOCK_MONOTONIC, &ts)
            ts.tv_nsec += <long>((resume - now) * 1e9) + 1000
            if ts.tv_nsec >= 1000000000:
                ts.tv_sec += 1
                ts.tv_nsec -= 1000000000
            pthread_cond_timedwait(&w.bg_cond, &w.lock, &ts)
            continue
        w.bg_state = BG_POLLING
        w.polling = 1
        ms = 1000
        hs = next_handshake_deadline(w)
        if hs >= 0:
            ms = <int>((hs - now) * 1000.0) + 1
            if ms < 0:
                ms = 0
            elif ms > 1000:
                ms = 1000
        if arm_all(w):
            ms = 0
        # Progress a loop has not been told of (made while it was not
        # watching) must not wait for this sleep to end as well.
        notify_loop(w)
        wunlock(w)
        n = epoll_wait(w.epfd, evs, 64, ms)
        wlock(w)
        w.polling = 0
        w.bg_state = BG_WATCHING
        if n < 0:
            n = 0
        handle_events(w, evs, n)
        if hs >= 0:
            sweep_listeners(w)
        pthread_cond_broadcast(&w.cond)
        notify_loop(w)
    w.bg_state = 0
    wunlock(w)
    return NULL

cdef void sweep_listeners(worker_t* w) noexcept nogil:
    cdef uint32_t i
    for i in range(w.nslots):
        if w.slots[i] != NULL and w.slots[i].kind == KIND_LST:
            listener_sweep(<lst_t*>w.slots[i])

ctypedef int (*pred_fn)(void* arg) noexcept nogil

cdef inline double spin_for(worker_t* w, ep_t* hint) noexcept nogil:
    """How long a wait on hint busy-polls before it blocks. Waking a blocked
    thread costs tens of microseconds here (an epoll wake-up and, on a VM,
    an interrupt to an idle virtual CPU), paid by the sender's syscall and by
    the receiver: when this endpoint's recent waits ended sooner than
    spin_max, poll a little longer than they took. Waits longer than that
    (an idle connection, a slow peer) keep the short spin."""
    cdef double spin = w.opts.spin
    cdef double typical
    if hint != NULL and w.opts.spin_max > spin:
        typical = hint.typical_wait * 1.25
        if typical > spin and typical <= w.opts.spin_max:
            spin = typical
    return spin

cdef inline void note_wait(ep_t* hint, double elapsed) noexcept nogil:
    if hint != NULL:
        if hint.typical_wait == 0:
            hint.typical_wait = elapsed
        else:
            hint.typical_wait = 0.75 * hint.typical_wait + 0.25 * elapsed

cdef int worker_wait(worker_t* w, pred_fn pred, void* arg, ep_t* hint, double deadline) noexcept nogil:
    """Wait (lock held) until pred(arg). Busy-polls `hint` (spin_for()
    seconds), then blocks in epoll (one thread at a time; the others sleep on
    the condition variable and are woken after each round of progress).
    Returns 0, ETIMEDOUT, ESHUTDOWN_ (the Fabric was closed), or EINTR after
    WAIT_SLICE_MS so the caller can check for signals."""
    cdef double now = monotonic_now()
    cdef double started = now
    cdef double spin = spin_for(w, hint)
    cdef double spin_end = now + spin
    # receive waits teach the endpoint how long its peer takes to answer
    cdef ep_t* learner = hint if pred == pred_posted else NULL
    cdef double slice_end = now + WAIT_SLICE_MS * 1e-3
    cdef double until, hs
    cdef epoll_event evs[64]
    cdef int n, ms
    cdef timespec ts
    cdef uint64_t one = 1
    cdef uint64_t activity
    while True:
        if pred(arg):
            note_wait(learner, monotonic_now() - started)
            return 0
        if w.closed:
            return ESHUTDOWN_
        now = monotonic_now()
        w.last_app = now
        if deadline >= 0 and now >= deadline:
            note_wait(learner, now - started)
            return ETIMEDOUT
        if now >= slice_end:
            return EINTR
        if hint != NULL and now < spin_end and (hint.state == EP_OPEN or hint.state == EP_HANDSHAKE):
            activity = hint.ch.activity + (hint.ch.hub.activity if hint.ch.hub != NULL else 0)
            progress_ep(hint)
            if hint.ch != NULL and (hint.ch.activity + (hint.ch.hub.activity if hint.ch.hub != NULL else 0)
                                    != activity):
                spin_end = now + spin            # data is moving: keep polling
            if hint.listener != NULL:
                listener_sweep(hint.listener)
            if pred(arg):
                pthread_cond_broadcast(&w.cond)
                notify_loop(w)
                note_wait(learner, monotonic_now() - started)
                return 0
            if w.waiters:
                pthread_cond_broadcast(&w.cond)
            wunlock(w)
            # Let whatever else is runnable on this CPU go first: loopback
            # TCP delivers through the softirq thread of the sending CPU, and
            # a process confined to one CPU shares it with its own progress
            # thread; spinning without yielding starves them for the whole
            # spin (measured: round trips of 2 x spin_us with one CPU each).
            sched_yield()
            wlock(w)
            continue
        until = slice_end if deadline < 0 or slice_end < deadline else deadline
        if not w.polling:
            w.polling = 1
            hs = next_handshake_deadline(w)
            if hs >= 0 and hs < until:
                until = hs if hs > now else now
            ms = <int>((until - now) * 1000.0) + 1
            if arm_all(w):
                ms = 0
            wunlock(w)
            n = epoll_wait(w.epfd, evs, 64, ms)
            wlock(w)
            w.polling = 0
            w.last_app = monotonic_now()
            if w.bg_state == BG_BEHIND_POLLER:
                pthread_cond_signal(&w.bg_cond)
            if n < 0:
                n = 0
            handle_events(w, evs, n)
            if hs >= 0:
                sweep_listeners(w)
            pthread_cond_broadcast(&w.cond)
            notify_loop(w)
        else:
            # Another thread is in epoll_wait with the interest set it armed
            # before it slept. What this thread did since (a send that now
            # needs EPOLLOUT, a backend that now has work pending) must reach
            # that set, or both threads sleep until the slice ends (measured:
            # a server with an accept thread and a serving thread moved
            # rendezvous traffic 16x slower). epoll_ctl on a waited-on epoll
            # takes effect at once.
            if arm_all(w):
                progress_runnable(w)
                pthread_cond_broadcast(&w.cond)
                notify_loop(w)
                continue
            if w.bg_state == BG_POLLING:
                write(w.wake_fd, &one, 8)     # the application takes over polling
            clock_gettime(CLOCK_MONOTONIC, &ts)
            ms = <int>((until - now) * 1000.0) + 1
            ts.tv_sec += ms // 1000
            ts.tv_nsec += (ms % 1000) * 1000000
            if ts.tv_nsec >= 1000000000:
                ts.tv_sec += 1
                ts.tv_nsec -= 1000000000
            w.waiters += 1
            pthread_cond_timedwait(&w.cond, &w.lock, &ts)
            w.waiters -= 1


cdef extern from "Python.h":
    # called with the GIL (inside `with gil`), never with the engine lock;
    # leaves the exception set for raise_pending()
    int check_signals_raw "PyErr_CheckSignals"() noexcept

cdef enum:
    SIGNALLED = -1     # wait_sig: a signal handler raised; the exception is pending

cdef int wait_sig(worker_t* w, pred_fn pred, void* arg, ep_t* hint, double deadline) noexcept nogil:
    """worker_wait that also runs signal handlers (lock held, GIL not).
    The GIL is taken only after the engine lock is released: a thread that
    waits for the GIL while it holds the lock blocks every other thread of
    this Fabric, forever once the interpreter is exiting (threads that ask
    for the GIL then never get it). Returns 0, ETIMEDOUT, ESHUTDOWN_, or
    SIGNALLED (the handler's exception is pending: call raise_pending once
    the lock is released)."""
    cdef int rc, sig
    w.in_wait += 1
    while True:
        rc = worker_wait(w, pred, arg, hint, deadline)
        if rc != EINTR:
            break
        wunlock(w)
        with gil:
            sig = check_signals_raw()
        alock(w)
        if sig < 0:
            rc = SIGNALLED
            break
    w.in_wait -= 1
    if w.closed and w.in_wait == 0:
        pthread_cond_broadcast(&w.cond)      # Worker.close waits for waiters to leave
    return rc

cdef int raise_pending() except -1:
    """Raise the exception a signal handler left pending (see wait_sig)."""
    return -1

cdef int pred_op_final(void* arg) noexcept nogil:
    cdef sendop_t* op = <sendop_t*>arg
    return op.state == OP_DONE or op.state == OP_FAILED

cdef int pred_posted(void* arg) noexcept nogil:
    return (<ep_t*>arg).posted.done

cdef int pred_handshake(void* arg) noexcept nogil:
    return (<ep_t*>arg).state != EP_HANDSHAKE

cdef int pred_no_reads(void* arg) noexcept nogil:
    cdef ep_t* ep = <ep_t*>arg
    return ep.posted.msg == NULL or ep.posted.msg.reads == 0 or ep.state == EP_DEAD

cdef int pred_accept(void* arg) noexcept nogil:
    cdef lst_t* l = <lst_t*>arg
    listener_sweep(l)
    return l.ready_head != NULL or l.closed

cdef int ep_drained(ep_t* ep) noexcept nogil:
    """A closing endpoint has sent everything, CLOSE included. Where the
    peer learns of close() by another path than the data (a bootstrap socket
    beside UCX or RDMA traffic), also wait for the peer's answering CLOSE:
    it proves the peer took ours, or it would see a reset instead."""
    if ep.state != EP_OPEN:
        return 1
    return (ep.close_sent and ep.pending_sends == 0 and ep.ready_head == NULL
            and (ep.open_data == NULL or ep.open_data.used == 0) and ep.rndv_out == NULL
            and ep.zc_out == NULL and ep.ctrl_ready_head == NULL
            and (ep.ctrl == NULL or ep.ctrl.used == 0)
            and (ep.peer_closed or (ep.caps & FAB_CAP_ORDERED_CLOSE)))

cdef int pred_drained(void* arg) noexcept nogil:
    return ep_drained(<ep_t*>arg)

cdef int pred_all_drained(void* arg) noexcept nogil:
    cdef worker_t* w = <worker_t*>arg
    cdef uint32_t i
    for i in range(w.nslots):
        if w.slots[i] != NULL and w.slots[i].kind == KIND_EP and not ep_drained(<ep_t*>w.slots[i]):
            return 0
    return 1

cdef int pred_no_waiters(void* arg) noexcept nogil:
    return (<worker_t*>arg).in_wait == 0


# A forked child inherits every Fabric, but none of its threads: their locks
# may be held forever and the progress thread is gone. Each use checks the
# generation recorded at creation against this counter (cheaper than getpid).
cdef int fork_generation = 0

cdef void after_fork_in_child() noexcept nogil:
    global fork_generation
    fork_generation += 1

cdef extern from "<pthread.h>" nogil:
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)

pthread_atfork(NULL, NULL, after_fork_in_child)

cdef inline bint forked(worker_t* w) noexcept nogil:
    return w.fork_gen != fork_generation


# ============================================================== Python layer
#
# The rule: GIL-holding code never holds the engine lock. Every section
# below that takes the lock does so inside `with nogil:` and releases it
# before the GIL is taken again (wait_sig does the same around signal
# checks). Python objects are built only outside the lock: building them may
# run the garbage collector, whose finalizers take the engine lock.

cdef object make_error(int err, str what, str detail=None):
    text = what + (": " + detail if detail else "")
    if err == ETIMEDOUT:
        return _errors.Timeout(text)
    if err == EPROTO:
        return _errors.ProtocolError(text)
    if err == ESHUTDOWN_:
        return _errors.ConnectionClosed(text)
    if err == EACCES_:
        return _errors.RemoteAccessError(text)
    if err == EMSGSIZE:
        return _errors.MessageTooLarge(text)
    if err == ENOMEM:
        return _errors.ResourceLimit(text)
    return _errors.ConnectionLost(text)


cdef inline double deadline_of(timeout) except? -2.0:
    if timeout is None:
        return -1.0
    t = float(timeout)
    if t < 0 or t != t:
        raise ValueError("timeout must be >= 0 or None")
    return monotonic_now() + t


cdef int parse_fault(str text, opts_t* o) except -1:
    """FABRIC_FAULT_INJECT (tests only): bad_key, bad_range, or
    <die|garbage>@<hello|rndv|pull|chunk_done|batch|close>[:<n>]."""
    o.fault = o.fault_action = o.fault_stage = 0
    o.fault_count = 1
    if not text:
        return 0
    if text in ("bad_key", "bad_range"):
        o.fault = FAULT_BAD_KEY if text == "bad_key" else FAULT_BAD_RANGE
        return 0
    action, at, rest = text.partition("@")
    stage, colon, count = rest.partition(":")
    if not at or action not in FAULT_ACTIONS or stage not in FAULT_STAGES or (colon and not count.isdigit()):
        raise ValueError(f"FABRIC_FAULT_INJECT={text!r}: use bad_key, bad_range, or "
                         f"<{'|'.join(FAULT_ACTIONS)}>@<{'|'.join(FAULT_STAGES)}>[:<n>]")
    o.fault_action = FAULT_ACTIONS[action]
    o.fault_stage = FAULT_STAGES[stage]
    o.fault_count = int(count) if colon else 1
    if o.fault_count < 1:
        raise ValueError("FABRIC_FAULT_INJECT: the occurrence must be >= 1")
    return 0


cdef object forked_error():
    return _errors.FabricError(
        "this Fabric was created in another process: a forked child inherits its objects but not its "
        "threads, so it cannot use them; create a new Fabric in the child (or use the 'spawn' or "
        "'forkserver' start method of multiprocessing)")


# The cycle collector must not clear a Worker's attributes: cleared first, its
# domain (UCX worker, verbs context) would be released while its progress
# thread and endpoints still drive it (use after free, seen as UCX reading
# closed descriptors). Its cycles break through its dicts and lists instead.
@cython.no_gc_clear
cdef class Worker:
    """Progress context of one Fabric: a lock, an epoll set, the knobs."""
    cdef worker_t* w
    cdef readonly Backend backend
    cdef readonly dict options
    cdef readonly object domain     # the backend's per-Fabric state
    cdef int fds_closed
    cdef public int loop_users      # event loops that watch fileno() (fabric.aio)
    cdef public object aio_drivers  # fabric.aio: its drivers, per loop
    cdef public object aio_waiters  # fabric.aio: coroutines waiting on it, all loops
    cdef object __weakref__

    def __cinit__(self, Backend backend not None, dict options not None):
        cdef pthread_condattr_t ca
        cdef epoll_event ev
        self.backend = backend
        self.options = dict(options)
        self.w = <worker_t*>calloc(1, sizeof(worker_t))
        if self.w == NULL:
            raise MemoryError()
        self.w.fork_gen = fork_generation
        self.w.epfd = self.w.wake_fd = self.w.notify_fd = -1
        pthread_mutex_init(&self.w.lock, NULL)
        pthread_condattr_init(&ca)
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC)
        pthread_cond_init(&self.w.cond, &ca)
        pthread_cond_init(&self.w.bg_cond, &ca)
        cdef opts_t* o = &self.w.opts
        o.eager_limit = int(options["eager_limit"])
        o.chunk_size = int(options["chunk_size"])
        o.chunks_in_flight = int(options["chunks_in_flight"])
        o.coalesce_limit = int(options["coalesce_limit"])
        o.credits = int(options["credits"])
        o.recv_budget = int(options["recv_budget"])
        o.send_buffers = int(options["send_buffers"])
        o.max_message = int(options["max_message"])
        o.spin = float(options["spin_us"]) * 1e-6
        o.spin_max = float(options.get("spin_max_us", 0)) * 1e-6
        o.handshake_timeout = float(options["handshake_timeout"])
        o.close_linger = float(options["close_linger"])
        o.progress_thread = int(options.get("progress_thread", 1))
        o.native_min = int(options.get("native_min", 0))
        o.coalesce = int(options.get("coalesce", 1))
        # Test-only: make this Fabric announce forged keys or ranges, like a
        # broken peer would (tests/test_endpoint.py). Never set in production.
        fault = __import__("os").environ.get("FABRIC_FAULT_INJECT", "")
        parse_fault(fault, o)
        self.w.epfd = epoll_create1(EPOLL_CLOEXEC)
        self.w.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        self.w.notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        if self.w.epfd < 0 or self.w.wake_fd < 0 or self.w.notify_fd < 0:
            raise OSError(errno, f"cannot create the Fabric's descriptors: {strerror(errno).decode()}")
        ev.events = EPOLLIN
        ev.data.u64 = WAKE_KEY
        epoll_ctl(self.w.epfd, EPOLL_CTL_ADD, self.w.wake_fd, &ev)
        self.domain = backend.open_domain(self.options)
        self.w.hub = backend.hub(self.domain)
        if self.w.hub != NULL:
            ev.events = EPOLLIN
            ev.data.u64 = HUB_KEY
            if epoll_ctl(self.w.epfd, EPOLL_CTL_ADD, self.w.hub.fd, &ev) != 0:
                raise OSError(errno, f"cannot watch the {backend.name} progress descriptor: "
                                     f"{strerror(errno).decode()}")
        if o.progress_thread:
            if pthread_create(&self.w.bg_thread, NULL, progress_thread_main, self.w) != 0:
                raise OSError(errno, "cannot start the progress thread")
            self.w.bg_running = 1

    def __dealloc__(self):
        if self.w == NULL:
            return
        if forked(self.w):
            # Inherited from the parent: its threads and locks do not exist
            # here. Leave everything (the parent still owns the resources).
            self.w = NULL
            return
        # Endpoints and listeners hold a reference to their Worker, so none
        # is left here.
        self._shutdown(0.0, warn=not self.w.closed)
        self.loop_users = 0       # no loop can still reference us (its reader would hold us)
        self._release_fds()
        pthread_cond_destroy(&self.w.bg_cond)
        pthread_mutex_destroy(&self.w.lock)
        pthread_cond_destroy(&self.w.cond)
        free(self.w.slots)
        free(self.w.gens)
        free(self.w)
        self.w = NULL

    cdef int _check(self) except -1:
        if self.w == NULL:
            raise _errors.FabricError("this Worker was never set up")
        if forked(self.w):
            raise forked_error()
        if self.w.closed:
            raise _errors.ConnectionClosed("the Fabric is closed")
        return 0

    @property
    def closed(self):
        return self.w == NULL or self.w.closed != 0

    @property
    def _gen(self):
        return self.w.gen if self.w != NULL else 0

    cdef void _stop_thread(self):
        cdef uint64_t one = 1
        if self.w.bg_running:
            with nogil:
                wlock(self.w)
                self.w.bg_stop = 1
                pthread_cond_signal(&self.w.bg_cond)
                write(self.w.wake_fd, &one, 8)
                wunlock(self.w)
                pthread_join(self.w.bg_thread, NULL)
            self.w.bg_running = 0

    cdef void _release_fds(self):
        """Close the worker's descriptors once no event loop watches them (a
        loop that still has one registered would unregister whatever later
        reuses its number)."""
        if self.fds_closed or self.loop_users > 0:
            return
        self.fds_closed = 1
        if self.w.epfd >= 0:
            close(self.w.epfd)
        if self.w.wake_fd >= 0:
            close(self.w.wake_fd)
        if self.w.notify_fd >= 0:
            close(self.w.notify_fd)
        self.w.epfd = self.w.wake_fd = self.w.notify_fd = -1

    def _loop_detached(self):
        """fabric.aio: an event loop no longer watches fileno()."""
        self.loop_users -= 1
        if self.w != NULL and self.w.closed:
            self._release_fds()

    cdef void _shutdown(self, double linger, bint warn):
        """Close every listener and endpoint (after up to `linger` seconds of
        flushing), stop the progress thread, release the backend's domain."""
        cdef uint32_t i
        cdef node_t* node
        cdef ep_t* ep
        cdef double deadline
        cdef uint64_t one = 1
        cdef worker_t* w = self.w
        if w.closed:
            return
        if warn:
            _warn_unclosed("fabric.Fabric")
        deadline = monotonic_now() + linger
        with nogil:
            alock(w)
            if linger > 0:
                for i in range(w.nslots):
                    node = w.slots[i]
                    if node != NULL and node.kind == KIND_EP and (<ep_t*>node).state == EP_OPEN:
                        (<ep_t*>node).close_requested = 1
                        ep_flush(<ep_t*>node)
                worker_wait_quiet(w, pred_all_drained, w, deadline)
            w.closed = 1
            for i in range(w.nslots):
                node = w.slots[i]
                if node == NULL:
                    continue
                if node.kind == KIND_LST:
                    listener_close(<lst_t*>node)
                else:
                    ep_close(<ep_t*>node)
            worker_kick(w)
            if w.loop_attached and w.notify_fd >= 0:
                write(w.notify_fd, &one, 8)      # event loops detach from us
            # threads still inside a wait see `closed` and leave; the
            # descriptors they may be polling must outlive them
            deadline = monotonic_now() + 2.0
            while w.in_wait > 0 and monotonic_now() < deadline:
                worker_kick(w)
                cond_wait_for(w, 0.05)
            wunlock(w)
        self._stop_thread()
        self.w.hub = NULL
        try:
            self.backend.close_domain(self.domain)
        except Exception:
            pass
        self.domain = None

    def close(self, linger=None):
        """Close everything of this Fabric (see Fabric.close)."""
        if self.w == NULL or self.w.closed:
            return
        if forked(self.w):
            raise forked_error()
        self._shutdown(self.w.opts.close_linger if linger is None else max(0.0, float(linger)), False)
        self._release_fds()
        self.reap()

    def _debug_state(self):
        """The worker's state, for diagnosing a hang (tests, tools)."""
        cdef uint32_t i
        cdef node_t* node
        cdef ep_t* ep
        cdef lst_t* l
        cdef qlink_t* q
        cdef fab_channel* ch
        cdef inmsg_t* m
        cdef sendop_t* op
        cdef int k, n
        if self.w == NULL or forked(self.w):
            return {}
        eps = []
        listeners = []
        counts = {}
        import gc
        gc_was = gc.isenabled()
        gc.disable()           # no finalizer may run (and take the lock) while we hold it
        with nogil:
            alock(self.w)
        try:
            for i in range(self.w.nslots):
                node = self.w.slots[i]
                if node == NULL:
                    continue
                if node.kind == KIND_LST:
                    l = <lst_t*>node
                    pend = []
                    ep = l.pending
                    while ep != NULL:
                        pend.append((ep.state, ep.error.decode(errors="replace")))
                        ep = ep.lst_next
                    listeners.append({"pending": pend, "npending": l.npending,
                                      "ready": l.ready_head != NULL})
                else:
                    ep = <ep_t*>node
                    n = 0
                    m = ep.inq_head
                    while m != NULL:
                        n += 1
                        m = m.next
                    k = 0
                    op = ep.sendq_head
                    while op != NULL:
                        k += 1
                        op = op.next
                    eps.append({"state": ep.state, "error": ep.error.decode(errors="replace"),
                                "peer_credits": ep.peer_credits, "pending_sends": ep.pending_sends,
                                "peer_closed": ep.peer_closed, "armed": ep.armed,
                                "dirty": ep.dirty.queued, "runnable": ep.runnable.queued,
                                "has_channel": ep.ch != NULL, "inq": n, "sendq": k,
                                "rndv_out": ep.rndv_out != NULL, "rndv_in": ep.rndv_in != NULL,
                                "posted": (ep.posted.active, ep.posted.done), "buffered": ep.inbuf_bytes,
                                "held": ep.held, "c2r": ep.c2r, "gen": ep.node.gen,
                                "fabric_recvs": ep.fabric_recvs, "fabric_sends": ep.fabric_sends})
            for k in range(3):
                q = self.w.dirty if k == 0 else (self.w.runnable if k == 1 else self.w.touched)
                n = 0
                while q != NULL:
                    n += 1
                    q = q.next
                counts[("dirty", "runnable", "touched")[k]] = n
            hub_ready = 0
            if self.w.hub != NULL:
                ch = self.w.hub.ready
                while ch != NULL:
                    hub_ready += 1
                    ch = ch.ready_next
        finally:
            wunlock(self.w)
            if gc_was:
                gc.enable()
        return {"endpoints": eps, "listeners": listeners, "lists": counts, "hub_ready": hub_ready,
                "polling": self.w.polling, "waiters": self.w.waiters, "in_wait": self.w.in_wait,
                "bg_state": self.w.bg_state, "loop_polling": self.w.loop_polling, "closed": self.w.closed}

    def _close_begin(self):
        """aclose(): ask every endpoint to flush and say goodbye; True if all are drained."""
        cdef uint32_t i
        cdef node_t* node
        cdef int done
        self._check()
        with nogil:
            alock(self.w)
            for i in range(self.w.nslots):
                node = self.w.slots[i]
                if node != NULL and node.kind == KIND_EP and (<ep_t*>node).state == EP_OPEN:
                    (<ep_t*>node).close_requested = 1
                    ep_flush(<ep_t*>node)
            done = pred_all_drained(self.w)
            wunlock(self.w)
        return bool(done)

    def _all_drained(self):
        cdef int done
        if self.w == NULL or self.w.closed:
            return True
        with nogil:
            alock(self.w)
            done = pred_all_drained(self.w)
            wunlock(self.w)
        return bool(done)

    cdef void reap(self):
        """Release Python buffers of operations that finished without a holder."""
        cdef sendop_t* op
        cdef sendop_t* n
        cdef int i
        if self.w == NULL or self.w.reap == NULL or forked(self.w):
            return
        with nogil:
            alock(self.w)
            op = self.w.reap
            self.w.reap = NULL
            wunlock(self.w)
        while op != NULL:
            n = op.reap_next
            for i in range(op.nviews):
                PyBuffer_Release(&op.views[i])
            op_free(op)
            op = n

    def fileno(self):
        """The epoll descriptor: readable when progress() may have work."""
        self._check()
        return self.w.epfd

    def notify_fileno(self):
        """Readable when another thread made progress while a loop watches."""
        self._check()
        return self.w.notify_fd

    def loop_watch(self, bint on):
        """An event loop starts (True) or stops (False) polling fileno();
        while it does, the progress thread leaves the polling to it."""
        if self.w == NULL or self.w.closed or forked(self.w):
            return
        with nogil:
            alock(self.w)
            self.w.loop_polling = on
            self.w.loop_attached = 1
            if not on:
                pthread_cond_signal(&self.w.bg_cond)
            wunlock(self.w)

    def drain_notify(self):
        """Consume pending notifications (the loop is about to progress)."""
        cdef uint64_t junk
        if self.w == NULL or self.w.notify_fd < 0 or forked(self.w):
            return
        with nogil:
            read(self.w.notify_fd, &junk, 8)

    def progress(self):
        """Non-blocking progress of every endpoint and listener."""
        self._check()
        with nogil:
            alock(self.w)
            progress_all(self.w)
            pthread_cond_broadcast(&self.w.cond)
            notify_loop(self.w)
            wunlock(self.w)
        self.reap()

    def poll_events(self):
        """Non-blocking progress of what has events (for an event loop:
        O(events), not O(endpoints)). Returns the keys of the endpoints and
        listeners that moved since the last call, for fabric.aio."""
        cdef epoll_event evs[64]
        cdef int n
        cdef uint64_t keys[256]
        cdef int nkeys = 0, more = 1, i
        cdef node_t* node
        cdef int rounds, ready
        if self.w == NULL or forked(self.w):
            return []
        out = []
        with nogil:
            alock(self.w)
            self.w.loop_attached = 1
            if not self.w.closed:
                # until quiet: a hub (UCX's event fd) stays readable until re-armed
                for rounds in range(4):
                    ready = arm_all(self.w)
                    n = epoll_wait(self.w.epfd, evs, 64, 0)
                    if n <= 0 and not ready:
                        break
                    handle_events(self.w, evs, n if n > 0 else 0)
                pthread_cond_broadcast(&self.w.cond)
            wunlock(self.w)
        while more:
            nkeys = 0
            with nogil:
                alock(self.w)
                while nkeys < 256:
                    node = <node_t*>q_pop(&self.w.touched)
                    if node == NULL:
                        break
                    keys[nkeys] = node.key
                    nkeys += 1
                more = self.w.touched != NULL
                wunlock(self.w)
            for i in range(nkeys):
                out.append(keys[i])
        self.reap()
        return out

    def arm(self):
        """Prepare fileno() for waiting; False if progress is possible now."""
        cdef int ready
        if self.w == NULL or self.w.closed or forked(self.w):
            return False
        with nogil:
            alock(self.w)
            ready = arm_all(self.w)
            wunlock(self.w)
        return not ready

    def listen(self, str host, int port):
        self._check()
        # binding may resolve a name: no engine lock (backends keep listen() to
        # state that is safe to touch concurrently, see interface.pxd)
        cdef fab_listener* fl = self.backend.listen(self.domain, host, port, self.options)
        cdef lst_t* l = <lst_t*>calloc(1, sizeof(lst_t))
        cdef int ok = 0, closed = 0
        if l == NULL:
            fl.close(fl)
            raise MemoryError()
        l.node.kind = KIND_LST
        l.w = self.w
        l.fl = fl
        with nogil:
            alock(self.w)
            if self.w.closed:
                closed = 1
            else:
                ok = node_register(self.w, &l.node, fl.fd, EPOLLIN) != 0
            wunlock(self.w)
        if not ok:
            fl.close(fl)
            free(l)
            if closed:
                raise _errors.ConnectionClosed("the Fabric is closed")
            raise OSError(errno, f"cannot watch the listening socket: {strerror(errno).decode()}")
        lst = Listener.__new__(Listener)
        (<Listener>lst).l = l
        (<Listener>lst).worker = self
        (<Listener>lst).key = l.node.key
        return lst

    cdef ep_t* _attach_fd(self, int fd, int* why) except? NULL:
        """An endpoint in HANDSHAKE state on a connected socket (HELLO sent);
        NULL with *why = ESHUTDOWN_ (closed) or ENOMEM. Owns fd."""
        cdef fab_attach a
        cdef fab_channel* ch
        cdef ep_t* ep = NULL
        cdef size_t max_recv = our_max_recv(self.w)
        memset(&a, 0, sizeof(a))
        try:
            self.backend.prepare_attach(self.domain, self.options, &a)
        except BaseException:
            close(fd)
            raise
        with nogil:
            alock(self.w)
            if self.w.closed:
                close(fd)
                why[0] = ESHUTDOWN_
            else:
                # the channel is built under the engine lock: another thread
                # may be accepting on this Fabric and touching the same domain
                ch = a.attach(a.domain, fd, max_recv, a.recv_depth)
                if ch != NULL:
                    ep = ep_create(self.w, ch)
                why[0] = ENOMEM
            wunlock(self.w)
        return ep

    def connect(self, str host, int port, timeout=None):
        cdef double deadline = deadline_of(timeout)
        cdef double hs_deadline
        cdef ep_t* ep
        cdef int rc = 0, why = 0, ok = 0
        cdef int fd
        cdef char error[200]
        self._check()
        remaining = -1.0 if deadline < 0 else max(0.0, deadline - monotonic_now())
        try:
            fd = self.backend.dial(self.domain, host, port, remaining, self.options)
        except TimeoutError as e:
            raise _errors.Timeout(str(e)) from None
        except OSError as e:
            raise _errors.ConnectionLost(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        ep = self._attach_fd(fd, &why)
        if ep == NULL:
            if why == ESHUTDOWN_:
                raise _errors.ConnectionClosed("the Fabric is closed")
            raise _errors.ResourceLimit(f"connect to {host}:{port}: cannot set up a {self.backend.name} "
                                        f"channel (out of memory or descriptors)")
        hs_deadline = monotonic_now() + self.w.opts.handshake_timeout
        if deadline >= 0 and deadline < hs_deadline:
            hs_deadline = deadline
        with nogil:
            alock(self.w)
            rc = wait_sig(self.w, pred_handshake, ep, ep, hs_deadline)
            ok = ep.state == EP_OPEN
            if not ok:
                memcpy(error, ep.error, 200)
                ep_free(ep)
            wunlock(self.w)
        if rc == SIGNALLED:
            if ok:
                make_endpoint(self, ep).close(linger=0)
            raise_pending()
        if not ok:
            if rc == ETIMEDOUT:
                raise _errors.Timeout(f"connect to {host}:{port}: no handshake from the peer")
            if rc == ESHUTDOWN_:
                raise _errors.ConnectionClosed("the Fabric was closed during connect")
            raise _errors.ConnectionLost(f"connect to {host}:{port} failed: "
                                         f"{error.decode(errors='replace')}")
        return make_endpoint(self, ep)

    def _attach_connected(self, int fd):
        """fabric.aio: an Endpoint, still in its handshake, on a socket the
        event loop connected (owns fd)."""
        cdef int why = 0
        cdef ep_t* ep
        self._check()
        self.backend._tune(fd, self.options)
        ep = self._attach_fd(fd, &why)
        if ep == NULL:
            if why == ESHUTDOWN_:
                raise _errors.ConnectionClosed("the Fabric is closed")
            raise _errors.ResourceLimit(f"cannot set up a {self.backend.name} channel "
                                        f"(out of memory or descriptors)")
        return make_endpoint(self, ep)


cdef int worker_wait_quiet(worker_t* w, pred_fn pred, void* arg, double deadline) noexcept nogil:
    """worker_wait without signal checks, for bounded waits inside close."""
    cdef int rc
    w.in_wait += 1
    while True:
        rc = worker_wait(w, pred, arg, NULL, deadline)
        if rc != EINTR:
            break
    w.in_wait -= 1
    return rc

cdef void cond_wait_for(worker_t* w, double seconds) noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    ts.tv_nsec += <long>(seconds * 1e9)
    while ts.tv_nsec >= 1000000000:
        ts.tv_sec += 1
        ts.tv_nsec -= 1000000000
    pthread_cond_timedwait(&w.cond, &w.lock, &ts)

cdef void listener_close(lst_t* l) noexcept nogil:
    """Stop accepting (lock held; idempotent). The struct stays valid, because
    another thread may be inside accept(); Listener.__dealloc__ frees it."""
    cdef ep_t* ep
    if l.closed:
        return
    l.closed = 1
    while l.pending != NULL:
        ep = l.pending
        l.pending = ep.lst_next
        ep.listener = NULL
        ep_free(ep)
    while l.ready_head != NULL:
        ep = l.ready_head
        l.ready_head = ep.lst_next
        ep.listener = NULL
        ep_free(ep)
    l.ready_tail = NULL
    touch(l.w, &l.node)
    if l.fl.fd >= 0:
        epoll_ctl(l.w.epfd, EPOLL_CTL_DEL, l.fl.fd, NULL)
    node_unregister(l.w, &l.node)
    l.fl.close(l.fl)
    l.fl = NULL
    worker_kick(l.w)


def _warn_unclosed(what):
    """A ResourceWarning, as sockets give for what was never closed (silent
    while the interpreter shuts down)."""
    try:
        if not _sys.is_finalizing():
            _warnings.warn(f"unclosed {what}; close it (or use it as a context manager)", ResourceWarning, 2)
    except Exception:
        pass


cdef class Message:
    """A received message: a writable buffer owning its memory.

    Use it wherever a buffer is accepted (memoryview, numpy.frombuffer,
    bytes(m)); it compares equal to bytes with the same content."""
    cdef char* data
    cdef Py_ssize_t length
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __dealloc__(self):
        msg_free(self.data)

    def __len__(self):
        return self.length

    def __getbuffer__(self, Py_buffer* view, int flags):
        self.shape[0] = self.length
        self.strides[0] = 1
        view.buf = self.data
        view.obj = self
        view.len = self.length
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL
        if flags & 4:         # PyBUF_FORMAT
            view.format = BYTE_FORMAT
        view.ndim = 1
        view.shape = self.shape if (flags & 8) else NULL   # PyBUF_ND
        view.strides = self.strides if (flags & 16) == 16 else NULL
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __bytes__(self):
        return self.data[:self.length]

    def __getitem__(self, key):
        return memoryview(self)[key]

    def tobytes(self):
        return self.data[:self.length]

    def __eq__(self, other):
        try:
            return memoryview(self) == memoryview(other).cast("B")
        except TypeError:
            return NotImplemented

    def __hash__(self):
        raise TypeError("Message is mutable and unhashable")

    def __repr__(self):
        head = self.data[:min(self.length, 16)]
        return f"<fabric.Message {self.length} bytes {head!r}{'...' if self.length > 16 else ''}>"


cdef char* BYTE_FORMAT = "B"


cdef Message make_message(char* data, size_t length):
    cdef Message m = Message.__new__(Message)
    m.data = data
    m.length = <Py_ssize_t>length
    return m


cdef sendop_t* op_from(object obj) except NULL:
    """A send operation referencing obj's buffers (no copy): one buffer, or a
    list/tuple of buffers forming one message."""
    cdef list parts
    cdef int n, i
    cdef sendop_t* op
    cdef size_t size
    if isinstance(obj, (list, tuple)):
        parts = list(obj)
    else:
        parts = [obj]
    n = len(parts)
    size = sizeof(sendop_t) + n * (sizeof(seg_t) + sizeof(Py_buffer))
    op = <sendop_t*>calloc(1, size)
    if op == NULL:
        raise MemoryError()
    op.views = <Py_buffer*>(<char*>op + sizeof(sendop_t))
    op.segs = <seg_t*>(<char*>op.views + n * sizeof(Py_buffer))
    op.refs = 2           # the engine and the caller
    try:
        for i in range(n):
            part = parts[i]
            try:
                PyObject_GetBuffer(part, &op.views[i], PyBUF_SIMPLE)
            except (TypeError, BufferError):
                part = as_buffer(part)
                PyObject_GetBuffer(part, &op.views[i], PyBUF_SIMPLE)
            op.nviews += 1
            op.segs[i].ptr = <char*>op.views[i].buf
            op.segs[i].length = <size_t>op.views[i].len
            op.total += op.segs[i].length
        op.nseg = n
    except BaseException:
        for i in range(op.nviews):
            PyBuffer_Release(&op.views[i])
        free(op)
        raise
    return op


def as_buffer(obj):
    """Objects without the buffer protocol: DLPack producers (torch CPU
    tensors, JAX arrays) through numpy; a clear error otherwise."""
    if hasattr(obj, "__dlpack__"):
        import numpy
        arr = numpy.from_dlpack(obj)
        if not arr.flags.c_contiguous:
            raise BufferError("fabric sends only C-contiguous tensors; call .contiguous() first")
        return arr
    raise TypeError(f"fabric cannot send {type(obj).__name__}: it supports neither the "
                    "buffer protocol nor DLPack")


cdef int get_writable(object buf, Py_buffer* view) except -1:
    """A writable contiguous view of buf (buffer protocol, or DLPack for
    tensors such as torch CPU tensors, which share their memory)."""
    try:
        PyObject_GetBuffer(buf, view, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS)
    except (TypeError, BufferError):
        if not hasattr(buf, "__dlpack__"):
            raise
        PyObject_GetBuffer(as_buffer(buf), view, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS)
    return 0


cdef void op_release(Worker worker, sendop_t* op):
    """Drop the caller's reference (GIL held, lock not held)."""
    cdef int i, free_it = 0, views = 0
    cdef worker_t* w = worker.w
    if forked(w):
        return          # the parent's memory: leave it
    with nogil:
        alock(w)
        op.refs -= 1
        if op.state == OP_DONE or op.state == OP_FAILED:
            views = op.nviews
            op.nviews = 0
            free_it = op.refs == 0
        wunlock(w)
    for i in range(views):
        PyBuffer_Release(&op.views[i])
    if free_it:
        op_free(op)


@cython.no_gc_clear
cdef class Request:
    """An isend in progress; the buffer must stay untouched until done()."""
    cdef sendop_t* op
    cdef Endpoint ep
    cdef readonly size_t nbytes
    cdef object _error

    def __init__(self):
        raise TypeError("Requests come from Endpoint.isend()")

    def __dealloc__(self):
        if self.op != NULL and self.ep is not None:
            op_release(self.ep.worker, self.op)
            self.op = NULL

    def done(self):
        cdef int final
        cdef ep_t* ep
        if self.op == NULL:
            return True
        if forked(self.ep.w):
            raise forked_error()
        ep = self.ep.ep
        with nogil:
            alock(self.ep.w)
            if ep.state == EP_OPEN:
                progress_ep(ep)
            final = pred_op_final(self.op)
            notify_loop(self.ep.w)
            wunlock(self.ep.w)
        self.ep.worker.reap()
        if final:
            self._finish()
        return bool(final)

    cdef _finish(self):
        cdef int err = self.op.err
        op_release(self.ep.worker, self.op)
        self.op = NULL
        if err:
            self._error = make_error(err, "send failed", self.ep._detail(err))

    def wait(self, timeout=None):
        """Wait until the message has left obj (and raise if it failed)."""
        cdef double deadline = deadline_of(timeout)
        cdef int rc = 0
        cdef ep_t* ep
        cdef worker_t* w
        if self.op != NULL:
            w = self.ep.w
            if forked(w):
                raise forked_error()
            ep = self.ep.ep
            with nogil:
                alock(w)
                ep.send_waiters += 1
                rc = wait_sig(w, pred_op_final, self.op, ep, deadline)
                ep.send_waiters -= 1
                ep_settle(ep)
                wunlock(w)
            self.ep.worker.reap()
            if rc == SIGNALLED:
                raise_pending()
            if rc == ETIMEDOUT:
                raise _errors.Timeout("send did not complete in time (it continues)")
            if rc == ESHUTDOWN_ and not pred_op_final(self.op):
                raise _errors.ConnectionClosed("the Fabric was closed")
            self._finish()
        if self._error is not None:
            raise self._error

    @property
    def error(self):
        return self._error

    @property
    def endpoint(self):
        return self.ep

    async def await_done(self, timeout=None):
        """wait() for asyncio."""
        from fabric import aio
        if self.op == NULL:
            self.wait(0)
            return
        await aio.wait_request(self, timeout)

    def __await__(self):
        return self.await_done().__await__()

    def __repr__(self):
        state = "done" if self.op == NULL else "pending"
        return f"<fabric.Request {self.nbytes} bytes {state}>"


# Logger "fabric" (quiet unless the application configures logging):
# connections at DEBUG, failures at INFO; never on a hot path.
_log = _logging.getLogger("fabric")


cdef str ep_names(ep_t* ep):
    return (f"{ep.local_name.decode(errors='replace')} -> {ep.peer_name.decode(errors='replace')}")


cdef Endpoint make_endpoint(Worker worker, ep_t* ep):
    cdef Endpoint e = Endpoint.__new__(Endpoint)
    e.ep = ep
    e.worker = worker
    e.w = worker.w
    e.key = ep.node.key
    if _log.isEnabledFor(_logging.DEBUG):
        _log.debug("%s connection %s opened", worker.backend.name, ep_names(ep))
    return e


cdef struct recv_result:
    int err
    size_t length
    char* data


cdef void take_result(ep_t* ep, recv_result* r) noexcept nogil:
    """Move a finished receive's result out of the endpoint (lock held)."""
    cdef posted_t* p = &ep.posted
    r.err = p.err
    r.length = p.length
    r.data = p.result
    memset(p, 0, sizeof(posted_t))

cdef int take_stash(ep_t* ep, char* dst, size_t cap, recv_result* r) noexcept nogil:
    """A receive interrupted after it had completed left its message here:
    hand it to this receive. 0 if there is none."""
    if not ep.has_stash:
        return 0
    memset(r, 0, sizeof(recv_result))
    r.length = ep.stash_len
    if dst == NULL:
        r.data = ep.stash_data
    elif ep.stash_len > cap:
        r.err = EMSGSIZE          # kept for a larger buffer
        return 1
    else:
        memcpy(dst, ep.stash_data, ep.stash_len)
        free(ep.stash_data)
    ep.stash_data = NULL
    ep.has_stash = 0
    return 1

cdef void stash_result(ep_t* ep, char* dst, recv_result* r) noexcept nogil:
    """Keep a completed receive's message for the next receive (its caller was
    interrupted): nothing received is ever lost. dst: the receive's buffer
    (recv_into), or NULL (recv: r.data holds the message)."""
    cdef char* copy
    if r.err:
        if r.data != NULL:
            free(r.data)
        return
    if dst == NULL:
        copy = r.data
        if copy == NULL:              # an empty message
            copy = <char*>malloc(1)
            if copy == NULL:
                ep_fail(ep, ENOMEM, "out of memory keeping an interrupted receive")
                return
    else:
        copy = <char*>malloc(r.length if r.length else 1)
        if copy == NULL:
            ep_fail(ep, ENOMEM, "out of memory keeping an interrupted receive")
            return
        memcpy(copy, dst, r.length)
    ep.stash_data = copy
    ep.stash_len = r.length
    ep.has_stash = 1

cdef int unpost(ep_t* ep) noexcept nogil:
    """Withdraw an unfinished receive (lock held). A message already being
    pulled into the caller's buffer moves to memory of our own first, so
    nothing is lost and the caller's buffer is free again. Returns 1 if
    reads into the caller's buffer are still landing (wait, then call
    again), 0 when done."""
    cdef posted_t* p = &ep.posted
    cdef inmsg_t* m = p.msg
    cdef desc_t* d
    cdef char* nb
    cdef recv_result r
    cdef char* dst = p.dst
    if p.done:
        # it completed meanwhile: keep its message for the next receive
        take_result(ep, &r)           # (clears p)
        stash_result(ep, dst, &r)
        return 0
    # From here on the message is never delivered into this receive (its
    # caller has given up on it): it moves to our memory and stays first.
    p.withdrawing = 1
    if m != NULL and p.dst != NULL and m.data == p.dst:
        d = m.descs
        while d != NULL:
            if d.reading and ep.ch != NULL:
                if ep.ch.ops.cancel_read(ep.ch, <uint64_t><size_t>d | TAG_DESC) == 0:
                    d.reading = 0
                    m.reads -= 1
            d = d.next
        if m.reads > 0 and ep.state != EP_DEAD:
            return 1
        if ep.state != EP_DEAD:
            nb = msg_alloc(m.total)
            if nb == NULL:
                ep_fail(ep, ENOMEM, "out of memory moving a message")
            else:
                memcpy(nb, m.data, m.total)
                if m.dst_registered:
                    ep.ch.ops.dereg(ep.ch, &m.dst_mr)
                    m.dst_registered = 0
                m.data = nb
                m.own_data = 1
                m.charge += m.total
                ep.inbuf_bytes += m.total
                if m.received < m.total:
                    issue_reads(ep, m)
    if p.result != NULL:
        free(p.result)
    memset(p, 0, sizeof(posted_t))
    return 0

cdef void withdraw(ep_t* ep) noexcept nogil:
    """unpost, waiting for reads that cannot be cancelled (lock held)."""
    while unpost(ep):
        worker_wait_quiet(ep.w, pred_no_reads, ep, -1.0)

cdef int recv_begin(ep_t* ep, char* dst, size_t cap, recv_result* r) noexcept nogil:
    """Start a receive (lock held): 1 if it completed at once (r filled), 0
    if it is posted, -EBUSY if another receive is in progress, -ESHUTDOWN_
    if the endpoint is closed."""
    if ep.closed:
        return -ESHUTDOWN_
    if ep.posted.active:
        return -EBUSY_
    if take_stash(ep, dst, cap, r):
        return 1
    ep_post(ep, dst, cap)
    if ep.posted.done:
        take_result(ep, r)
        return 1
    return 0


@cython.no_gc_clear
cdef class Endpoint:
    """One connection. send/recv are thread-safe; one receive at a time."""
    cdef ep_t* ep
    cdef worker_t* w
    cdef readonly Worker worker
    cdef readonly uint64_t key      # identifies it to fabric.aio while open
    cdef Py_buffer async_view       # recv buffer of a _try_recv in progress
    cdef int async_view_held
    cdef bint failure_logged
    cdef object __weakref__

    def __init__(self):
        raise TypeError("Endpoints come from Fabric.connect() and Listener.accept()")

    def __dealloc__(self):
        cdef int was_closed
        if self.ep != NULL:
            if forked(self.w):
                self.ep = NULL      # the parent's: leave it
                return
            was_closed = self.ep.closed
            with nogil:
                alock(self.w)
                ep_free(self.ep)
                wunlock(self.w)
            self.ep = NULL
            if not was_closed:
                _warn_unclosed("fabric.Endpoint")
        self._drop_async_view()

    cdef void _drop_async_view(self):
        if self.async_view_held:
            self.async_view_held = 0
            PyBuffer_Release(&self.async_view)

    cdef str _detail(self, int err):
        if self.ep == NULL:
            return None
        if self.ep.closed:
            return "endpoint closed"
        if self.ep.state == EP_DEAD and self.ep.error[0]:
            text = self.ep.error.decode(errors="replace")
            if not self.failure_logged:
                self.failure_logged = True
                _log.info("%s connection %s failed: %s", self.worker.backend.name, ep_names(self.ep), text)
            return text
        return None

    cdef inline int _check_open(self) except -1:
        if self.ep == NULL:
            raise _errors.FabricError("this Endpoint was never connected")
        if forked(self.w):
            raise forked_error()
        if self.ep.closed:
            raise _errors.ConnectionClosed("endpoint is closed")
        return 0

    @property
    def local_address(self):
        self._check_open()
        return self.ep.local_name.decode()

    @property
    def peer_address(self):
        self._check_open()
        return self.ep.peer_name.decode()

    @property
    def closed(self):
        return self.ep == NULL or self.ep.closed != 0 or self.ep.state == EP_DEAD

    @property
    def eager_limit(self):
        self._check_open()
        return self.ep.eager_limit

    def stats(self):
        """Counters for tests and tools."""
        cdef int64_t regions = 0
        self._check_open()
        cdef ep_t* e = self.ep
        with nogil:
            alock(self.w)
            if e.ch != NULL:
                regions = e.ch.live_regions - e.own_regions
            wunlock(self.w)
        return {"peer_credits": e.peer_credits, "pending_sends": e.pending_sends,
                "buffered_bytes": e.inbuf_bytes, "held_credits": e.held,
                "send_buffers": e.slabs_total, "credits_to_return": e.c2r,
                "sent_eager": e.sent_eager, "sent_eager_zero_copy": e.sent_eager_zero_copy,
                "sent_rendezvous": e.sent_rndv, "chunks_announced": e.chunks_announced,
                "chunks_native": e.chunks_native,
                "fabric_sends": e.fabric_sends, "frames_sent": e.frames_sent,
                "fabric_recvs": e.fabric_recvs, "frames_received": e.frames_received,
                "rendezvous_copied": e.rndv_copied,
                # adaptive polling: how long receives waited lately, and how
                # long the next wait busy-polls before it blocks
                "typical_wait_us": e.typical_wait * 1e6, "spin_us": spin_for(e.w, e) * 1e6,
                # registrations made for messages (the endpoint's own buffers excluded)
                "registered_regions": regions}

    def protocol_for(self, size):
        """The protocol a message of `size` bytes takes on this endpoint, and
        its chunk count: ('eager', 0), ('rendezvous', chunks) for the engine's
        pulls, or ('native', chunks) for the fabric's own rendezvous."""
        self._check_open()
        size = int(size)
        if size < 0:
            raise ValueError("size must be >= 0")
        if size <= self.ep.eager_limit:
            return ("eager", 0)
        if uses_native(self.ep, size):
            return ("native", (size + NATIVE_CHUNK - 1) // NATIVE_CHUNK)
        return ("rendezvous", (size + self.w.opts.chunk_size - 1) // self.w.opts.chunk_size)

    def send(self, obj):
        """Send one message (a buffer, or a list/tuple of buffers sent as one
        message). Returns when obj may be reused."""
        cdef sendop_t* op
        cdef int err = 0, rc = 0
        cdef ep_t* ep
        self._check_open()
        op = op_from(obj)
        ep = self.ep
        with nogil:
            alock(self.w)
            ep_submit(ep, op)
            if not pred_op_final(op):
                # While we wait, the peer's large messages are pulled ahead:
                # two peers sending to each other must not wait on each other.
                ep.send_waiters += 1
                rc = wait_sig(self.w, pred_op_final, op, ep, -1.0)
                ep.send_waiters -= 1
            if pred_op_final(op):
                err = op.err
            elif rc == ESHUTDOWN_:
                err = ESHUTDOWN_
            ep_settle(ep)
            wunlock(self.w)
        op_release(self.worker, op)
        self.worker.reap()
        if rc == SIGNALLED:
            raise_pending()
        if err:
            raise make_error(err, "send failed", self._detail(err))

    def isend(self, obj):
        """Start sending; returns a Request. obj must stay untouched until the
        request is done."""
        cdef sendop_t* op
        cdef Request req
        cdef ep_t* ep
        self._check_open()
        op = op_from(obj)
        req = Request.__new__(Request)
        req.op = op
        req.ep = self
        req.nbytes = op.total
        ep = self.ep
        with nogil:
            alock(self.w)
            ep_submit(ep, op)
            ep_settle(ep)
            if not pred_op_final(op):
                notify_loop_dirty(self.w)
            wunlock(self.w)
        return req

    cdef object _result(self, recv_result* r, int want_message):
        """Message / byte count / exception for a taken result (lock NOT held:
        building Python objects may run the garbage collector, whose
        finalizers take the engine lock)."""
        if r.err == EMSGSIZE:
            return _errors.MessageTooLarge(
                f"the next message has {r.length} bytes, more than the buffer holds; it is kept",
                r.length)
        if r.err:
            return make_error(r.err, "receive failed", self._detail(r.err))
        if want_message:
            if r.data == NULL:
                r.data = <char*>malloc(1)
                if r.data == NULL:
                    raise MemoryError()
            return make_message(r.data, r.length)
        return r.length

    cdef object _recv(self, char* dst, size_t cap, timeout):
        cdef double deadline = deadline_of(timeout)
        cdef int rc = 0, begun, done = 0
        cdef recv_result r
        cdef ep_t* ep
        self._check_open()
        ep = self.ep
        memset(&r, 0, sizeof(r))
        with nogil:
            alock(self.w)
            begun = recv_begin(ep, dst, cap, &r)
            if begun == 1:
                done = 1
            elif begun == 0:
                rc = wait_sig(self.w, pred_posted, ep, ep, deadline)
                if ep.posted.done and rc != SIGNALLED:
                    take_result(ep, &r)
                    done = 1
                else:
                    withdraw(ep)       # keeps a message that completed meanwhile
            ep_settle(ep)
            wunlock(self.w)
        if rc == SIGNALLED:
            raise_pending()
        if begun == -EBUSY_:
            raise _errors.BusyError("another receive is in progress on this endpoint")
        if begun == -ESHUTDOWN_:
            raise _errors.ConnectionClosed("endpoint is closed")
        if not done:
            if rc == ESHUTDOWN_:
                raise _errors.ConnectionClosed("the Fabric was closed")
            raise _errors.Timeout("no message arrived in time")
        return self._result(&r, dst == NULL)

    def recv(self, timeout=None):
        """Receive the next message as a Message buffer."""
        r = self._recv(NULL, 0, timeout)
        if isinstance(r, BaseException):
            raise r
        return r

    def recv_into(self, buf, timeout=None):
        """Receive the next message into buf (writable, contiguous); returns
        its size. A message larger than buf raises MessageTooLarge and stays
        queued."""
        cdef Py_buffer view
        self._check_open()
        get_writable(buf, &view)
        try:
            r = self._recv(<char*>view.buf, <size_t>view.len, timeout)
        finally:
            PyBuffer_Release(&view)
        if isinstance(r, BaseException):
            raise r
        return r

    # --- non-blocking primitives for the asyncio layer (fabric.aio) ---------

    def _poll(self):
        """Progress this endpoint without blocking."""
        self._check_open()
        with nogil:
            alock(self.w)
            progress_ep(self.ep)
            notify_loop(self.w)
            wunlock(self.w)
        self.worker.reap()

    def _try_recv(self, buf=None):
        """Start (or continue) the receive; None while it is not complete.
        The buffer stays referenced until completion or _cancel_recv()."""
        cdef char* dst = NULL
        cdef size_t cap = 0
        cdef int done = 0, busy = 0, closed = 0, begun
        cdef recv_result r
        cdef ep_t* ep
        self._check_open()
        ep = self.ep
        if buf is not None and not self.async_view_held:
            get_writable(buf, &self.async_view)
            self.async_view_held = 1
        if self.async_view_held:
            dst = <char*>self.async_view.buf
            cap = <size_t>self.async_view.len
        memset(&r, 0, sizeof(r))
        with nogil:
            alock(self.w)
            if not ep.posted.active:
                begun = recv_begin(ep, dst, cap, &r)
                done = begun == 1
                closed = begun == -ESHUTDOWN_
            elif ep.posted.dst != dst:
                busy = 1
            else:
                if ep.state == EP_OPEN:
                    progress_ep(ep)
                ep_deliver(ep)
                if ep.posted.done:
                    take_result(ep, &r)
                    done = 1
            ep_settle(ep)
            notify_loop(self.w)
            wunlock(self.w)
        if busy:
            raise _errors.BusyError("another receive is in progress on this endpoint")
        if closed:
            self._drop_async_view()
            raise _errors.ConnectionClosed("endpoint is closed")
        if not done:
            return None
        self._drop_async_view()
        result = self._result(&r, buf is None)
        if isinstance(result, BaseException):
            raise result
        return result

    def _cancel_recv(self):
        """Withdraw the receive _try_recv started; a message that completed
        meanwhile is kept for the next receive."""
        if self.ep != NULL and not forked(self.w):
            with nogil:
                alock(self.w)
                if self.ep.posted.active:
                    withdraw(self.ep)
                wunlock(self.w)
        self._drop_async_view()

    @property
    def _gen(self):
        """fabric.aio: bumped whenever this endpoint moves (read before a
        check, compared after registering to wait: no wake-up is lost)."""
        return self.ep.node.gen if self.ep != NULL else 0

    def _state(self):
        """fabric.aio: 0 while the handshake runs, 1 when open, -1 once failed."""
        if self.ep == NULL or self.ep.closed:
            return -1
        if self.ep.state == EP_HANDSHAKE:
            return 0
        return 1 if self.ep.state == EP_OPEN else -1

    def _failure(self):
        """Why the handshake or the connection failed (fabric.aio)."""
        if self.ep == NULL:
            return "never connected"
        return self.ep.error.decode(errors="replace") or "closed"

    def _close_begin(self):
        """aclose(): flush and say goodbye; True once everything left."""
        cdef int done = 1
        if self.ep == NULL or self.ep.closed or forked(self.w):
            return True
        with nogil:
            alock(self.w)
            if self.ep.state == EP_OPEN:
                self.ep.close_requested = 1
                ep_flush(self.ep)
                done = ep_drained(self.ep)
            wunlock(self.w)
        return bool(done)

    def _drained(self):
        cdef int done = 1
        if self.ep == NULL or self.ep.closed or forked(self.w):
            return True
        with nogil:
            alock(self.w)
            progress_ep(self.ep)
            done = ep_drained(self.ep)
            notify_loop(self.w)
            wunlock(self.w)
        return bool(done)

    def close(self, linger=None):
        """Send what is queued and say goodbye (waiting at most `linger`
        seconds, default the close_linger option), then release everything.
        Pending operations fail with ConnectionClosed. Idempotent."""
        cdef double deadline
        cdef int rc = 0
        cdef ep_t* ep = self.ep
        if ep == NULL or ep.closed:
            return
        if forked(self.w):
            raise forked_error()
        deadline = monotonic_now() + (self.w.opts.close_linger if linger is None else max(0.0, float(linger)))
        if _log.isEnabledFor(_logging.DEBUG):
            _log.debug("%s connection %s closed", self.worker.backend.name, ep_names(ep))
        with nogil:
            alock(self.w)
            if not ep.closed:
                if ep.state == EP_OPEN:
                    ep.close_requested = 1
                    ep_flush(ep)
                    rc = wait_sig(self.w, pred_drained, ep, ep, deadline)
                ep_close(ep)
            wunlock(self.w)
        self.worker.reap()
        if rc == SIGNALLED:
            raise_pending()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- asyncio -------------------------------------------------------------

    async def asend(self, obj, timeout=None):
        """send() for asyncio."""
        from fabric import aio
        self._check_open()
        await aio.send(self, obj, timeout)

    async def arecv(self, timeout=None):
        """recv() for asyncio."""
        from fabric import aio
        self._check_open()
        return await aio.recv(self, None, timeout)

    async def arecv_into(self, buf, timeout=None):
        """recv_into() for asyncio; buf stays in use until it returns."""
        from fabric import aio
        self._check_open()
        return await aio.recv(self, buf, timeout)

    async def aclose(self, linger=None):
        from fabric import aio
        if self.ep == NULL:
            return
        await aio.close(self, linger)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    def __repr__(self):
        if self.ep == NULL:
            return "<fabric.Endpoint unconnected>"
        if self.ep.closed:
            return "<fabric.Endpoint closed>"
        return (f"<fabric.Endpoint {self.ep.local_name.decode()} -> {self.ep.peer_name.decode()} "
                f"{self.worker.backend.name}>")


cdef inline void notify_loop_dirty(worker_t* w) noexcept nogil:
    """A call outside any wait left an endpoint with work for the poller
    (an isend waiting for credits or socket space): an event loop that
    polls must re-arm, or the work waits until something else wakes it."""
    cdef uint64_t one = 1
    if w.loop_polling and w.notify_fd >= 0:
        write(w.notify_fd, &one, 8)


@cython.no_gc_clear
cdef class Listener:
    """Accepts endpoints; handshakes run in the background of accept()."""
    cdef lst_t* l
    cdef readonly Worker worker
    cdef readonly uint64_t key      # identifies it to fabric.aio while open
    cdef object __weakref__

    def __init__(self):
        raise TypeError("Listeners come from Fabric.listen()")

    def __dealloc__(self):
        cdef int was_closed
        if self.l != NULL:
            if forked(self.l.w):
                self.l = NULL
                return
            was_closed = self.l.closed
            with nogil:
                alock(self.l.w)
                listener_close(self.l)
                q_remove(&self.l.w.touched, &self.l.node.touched)
                wunlock(self.l.w)
            free(self.l)
            self.l = NULL
            if not was_closed:
                _warn_unclosed("fabric.Listener")

    cdef int _check_open(self) except -1:
        if self.l == NULL:
            raise _errors.FabricError("this Listener was never set up")
        if forked(self.l.w):
            raise forked_error()
        if self.l.closed:
            raise _errors.ConnectionClosed("listener is closed")
        return 0

    @property
    def address(self):
        self._check_open()
        return self.l.fl.address.decode()

    @property
    def closed(self):
        return self.l == NULL or self.l.closed != 0

    @property
    def _gen(self):
        return self.l.node.gen if self.l != NULL else 0

    cdef ep_t* _pop_ready(self) noexcept nogil:
        cdef ep_t* ep = self.l.ready_head
        if ep != NULL:
            self.l.ready_head = ep.lst_next
            if self.l.ready_head == NULL:
                self.l.ready_tail = NULL
            ep.lst_next = NULL
            ep.listener = NULL
        return ep

    def accept(self, timeout=None):
        """The next connected endpoint (after a successful handshake)."""
        cdef double deadline = deadline_of(timeout)
        cdef ep_t* ep = NULL
        cdef int rc = 0
        cdef worker_t* w
        self._check_open()
        w = self.l.w
        with nogil:
            alock(w)
            if not self.l.closed:
                progress_listener(self.l)
                rc = wait_sig(w, pred_accept, self.l, NULL, deadline)
                if rc != SIGNALLED:        # interrupted: a ready connection stays queued
                    ep = self._pop_ready()
            wunlock(w)
        if rc == SIGNALLED:
            raise_pending()
        if ep == NULL:
            if rc == ETIMEDOUT:
                raise _errors.Timeout("no connection arrived in time")
            raise _errors.ConnectionClosed("listener is closed")
        return make_endpoint(self.worker, ep)

    def _try_accept(self):
        cdef ep_t* ep = NULL
        cdef worker_t* w
        self._check_open()
        w = self.l.w
        with nogil:
            alock(w)
            if not self.l.closed:
                progress_listener(self.l)
                ep = self._pop_ready()
            notify_loop(w)
            wunlock(w)
        if ep == NULL and self.l.closed:
            raise _errors.ConnectionClosed("listener is closed")
        return None if ep == NULL else make_endpoint(self.worker, ep)

    def close(self):
        """Stop accepting; handshakes in progress are dropped. Idempotent."""
        if self.l == NULL or self.l.closed:
            return
        if forked(self.l.w):
            raise forked_error()
        with nogil:
            alock(self.l.w)
            listener_close(self.l)
            wunlock(self.l.w)

    async def aaccept(self, timeout=None):
        """accept() for asyncio."""
        from fabric import aio
        self._check_open()
        return await aio.accept(self, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if self.l == NULL:
            return "<fabric.Listener unset>"
        return f"<fabric.Listener {'closed' if self.l.closed else self.address}>"
