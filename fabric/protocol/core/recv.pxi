# Part of fabric.protocol.engine (included by engine.pyx).
#
# Receiving: frame dispatch, matching and pulls.
# Owns: inmsg_t from its first frame to delivery: on_fabric_msg parses a
# received fabric message and dispatches each frame (EAGER, RNDV, CHUNK_DONE,
# CREDIT, HELLO, CLOSE); eager payloads are kept until matched; rendezvous
# messages are pulled with reads into the posted buffer (or an engine buffer
# when nothing is posted yet, pull-ahead), each finished chunk answered with
# CHUNK_DONE.
# Invariants: messages are delivered whole, once, in the sender's order; a
# read only ever targets the region the peer announced for that chunk; nothing
# half-pulled is handed out after a failure.

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
            ep.rndv_in_count -= 1
            break
        p = &p[0].rnext
    m.in_rndv = 0

cdef void chunk_done(ep_t* ep, uint64_t msg_id, uint32_t index, int failed) noexcept nogil:
    cdef uint8_t* room = ctrl_room(ep, FRAME_HEADER)
    if room != NULL:
        put_header(room, F_CHUNK_DONE, DONE_FAILED if failed else 0, 0, msg_id, index, 0)
        fault_due(ep, FS_CHUNK_DONE, 0)

cdef inline void uncharge_desc(ep_t* ep, inmsg_t* m, desc_t* d) noexcept nogil:
    """A chunk's record goes: its bytes leave the budget, unless the message
    already left the queue (inq_pop released its whole charge then)."""
    if m.in_inq:
        release_budget(ep, sizeof(desc_t) + d.rkey_len)
        m.charge -= sizeof(desc_t) + d.rkey_len

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
            m.ndescs -= 1
            uncharge_desc(ep, m, d)
            free(d)
    if m.in_rndv and m.next_offset == m.total and m.descs == NULL and m.reads == 0:
        rndv_unlink(ep, m)
        inmsg_maybe_free(m)

cdef int issue_reads(ep_t* ep, inmsg_t* m) noexcept nogil:
    cdef desc_t* d = m.descs
    cdef int rc
    cdef fab_mr* dst_mr = NULL
    if not (ep.ch.caps & FAB_CAP_READ_ANY_MEMORY):
        if not m.dst_registered and m.descs != NULL:   # (none left: a finished message)
            rc = ep.ch.ops.reg(ep.ch, m.data, m.total, &m.dst_mr, 0)
            if rc < 0:
                ep_fail(ep, -rc, "registering the receive buffer failed")
                return -1
            m.dst_registered = 1
        dst_mr = &m.dst_mr
    while d != NULL and <uint32_t>m.reads < ep.w.opts.window_cap:
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
    m.ndescs -= 1
    uncharge_desc(ep, m, d)
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
    if m.failed and m.reads == 0:
        # (not before its last read ended: it may still write into p.dst)
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
        post_buffer(ep)
        progress_ep(ep)

cdef void pull_ahead(ep_t* ep) noexcept nogil:
    """Start pulling the next rendezvous message into memory of our own when
    nobody has posted a receive yet (bounded by recv_budget): it keeps two
    peers that both send large messages from waiting on each other, and
    overlaps the transfer with the application's work after recv()."""
    cdef inmsg_t* m = ep.inq_head
    while m != NULL:
        if m.rndv and not m.bound and not m.failed:
            if over_budget(ep, m.total, m != ep.inq_head):
                return
            if bind_rndv(ep, m, NULL) < 0:
                return
            charge_budget(ep, m.total)
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
    if f.body_length > ep.w.opts.max_message:
        ep_fail(ep, EPROTO, "peer sent a message larger than max_message")
        return -1
    ep.next_in_id += 1
    post_first_frame(ep, f.msg_id, 0)
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
    charge_budget(ep, m.charge)
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
        if ep.rndv_in_count >= ep.w.opts.max_rendezvous:
            ep_fail(ep, EPROTO, "peer announced more rendezvous messages than this end accepts in "
                                "flight (max_rendezvous)")
            return -1
        ep.next_in_id += 1
        post_first_frame(ep, f.msg_id, 1)
        m = <inmsg_t*>calloc(1, sizeof(inmsg_t))
        if m == NULL:
            ep_fail(ep, ENOMEM, "out of memory")
            return -1
        m.msg_id = f.msg_id
        m.rndv = 1
        m.total = f.total
        m.charge = sizeof(inmsg_t)
        charge_budget(ep, m.charge)
        inq_append(ep, m)
        m.in_rndv = 1
        m.rnext = ep.rndv_in
        ep.rndv_in = m
        ep.rndv_in_count += 1
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
    if m.ndescs >= ep.w.opts.window_cap:
        ep_fail(ep, EPROTO, "peer announced more chunks of a message than this end accepts "
                            "unanswered (chunks_in_flight)")
        return -1
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
    m.ndescs += 1
    m.charge += size
    charge_budget(ep, size)
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
    slot = f.aux % ep.w.opts.window_cap
    if f.aux >= op.announced or op.window_index[slot] != f.aux:
        ep_fail(ep, EPROTO, "peer acknowledged a chunk that is not in flight")
        return -1
    if op.native:
        op.released += 1
    elif op.window_served[slot]:
        op.window_served[slot] = 0                # written in full: released then
    else:
        if ep.w.opts.fault == FAULT_STALE_KEY and not ep.fault_has_stale:
            ep.fault_stale = op.window[slot]     # (a copy: its fields stay, the region goes)
            ep.fault_has_stale = 1
        ep.ch.ops.dereg(ep.ch, &op.window[slot])
        op.released += 1
    op.window_index[slot] = NO_CHUNK
    op.acked += 1
    if f.flags & DONE_FAILED:
        op.any_failed = 1
    if op.acked == op.nchunks:
        rndv_try_finish(ep, op)
        return 0
    rndv_maybe_done_early(ep, op)
    if announce_more(ep, op) < 0:
        return -1
    return 0

cdef int on_fabric_msg(ep_t* ep, const uint8_t* data, size_t length) noexcept nogil:
    """Handle every frame of one received fabric message."""
    cdef size_t pos = 0
    cdef int used, counts = 1, only_credits = 1, has_data = 0
    cdef frame_t f
    cdef const char* error = NULL
    ep.fabric_recvs += 1
    if ep.state == EP_OPEN and ep.c2r + ep.held >= ep.w.opts.credits:
        # every message after HELLO costs the peer one of the credits we
        # offered, back only once we return it: a peer past them ignores
        # flow control (and would make us buffer without bound)
        ep_fail(ep, EPROTO, "peer sent more fabric messages than it had credits for")
        return -1
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
        if (ep.peer_closed and f.type != F_CREDIT and f.type != F_CHUNK_DONE and f.type != F_PONG
                and not (f.type == F_POST and (f.flags & POST_WITHDRAW))
                and not (f.type == F_PUT and (f.flags & PUT_DECLINED))):
            ep_fail(ep, EPROTO, "peer sent frames after CLOSE")
            return -1
        if f.type == F_EAGER:
            has_data = 1
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
        elif f.type == F_PING:
            if on_ping(ep, &f) < 0:
                return -1
        elif f.type == F_PONG:
            if on_pong(ep, &f) < 0:
                return -1
        elif f.type == F_POST:
            if on_post(ep, &f) < 0:
                return -1
        elif f.type == F_PUT:
            has_data = (f.flags & PUT_DECLINED) == 0
            if on_put(ep, &f) < 0:
                return -1
    if counts:
        if only_credits:
            ep.c2r += 1       # no data held: back at once, but not worth a CREDIT of its own
            ep.c2r_quiet += 1
        elif has_data and over_budget(ep, 0, ep.inq_head != NULL):
            # Bound the peer: its credit comes back when the app receives.
            # Only messages carrying data: holding the credits of RNDV
            # announcements would stall the rendezvous that the buffered
            # messages wait behind (a deadlock).
            ep.held += 1
        else:
            ep.c2r += 1
    return 0
