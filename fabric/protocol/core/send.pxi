# Part of fabric.protocol.engine (included by engine.pyx).
#
# Send operations and rendezvous sending.
# Owns: sendop_t from submission to completion: framing queued messages in
# order (frame_queue), posting slabs and zero-copy sends within credits and
# the channel's send depth (ep_flush), announcing rendezvous chunks
# (chunks_in_flight ahead) and releasing them on CHUNK_DONE.
# Invariants: messages leave in submission order; an op's buffers are
# referenced until the op is final (op_finish); a chunk's registration lives
# until its CHUNK_DONE or the endpoint fails.

cdef void reap_push(worker_t* w, sendop_t* op) noexcept nogil:
    op.reap_next = w.reap
    w.reap = op

cdef void op_free(sendop_t* op) noexcept nogil:
    free(op.window)
    free(op.window_index)
    free(op.window_served)
    free(op.put_rkey)
    free(op)

cdef void op_finish(ep_t* ep, sendop_t* op, int err) noexcept nogil:
    """The engine is done with op: final state, drop the engine's reference.
    (An op the application already saw complete keeps its state.)"""
    if not op.user_done:
        op.state = OP_FAILED if err else OP_DONE
        op.err = err
    if op.large_counted:
        op.large_counted = 0
        ep.w.large_sends -= 1
    op.refs -= 1
    if op.refs == 0:
        if op.nviews:
            reap_push(ep.w, op)
        else:
            op_free(op)

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
    if op.native:
        return NATIVE_CHUNK
    if op.chunk == 0:
        op.chunk = ep.chunk_size      # the endpoint's may grow; this message's stays
    return op.chunk

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
    cdef uint32_t slot = op.announced % ep.w.opts.window_cap
    cdef fab_mr* mr = &op.window[slot]
    cdef uint8_t* room
    cdef int rc
    next_chunk(ep, op, &ptr, &length)
    if op.native:
        return announce_native(ep, op, first, ptr, length)
    rc = ep.ch.ops.reg(ep.ch, ptr, length, mr, 1)      # announced: the peer reads it
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
    cdef uint32_t slot = op.announced % ep.w.opts.window_cap
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

cdef void rndv_maybe_done_early(ep_t* ep, sendop_t* op) noexcept nogil:
    """Every byte of a rendezvous send was written (FAB_CAP_READS_SERVED) or
    acknowledged: the application's buffer is free, so the send completes now,
    as a socket's sendall does; the op stays in rndv_out (a reference of its
    own) until the peer's last CHUNK_DONE, which keeps the window's order."""
    if op.user_done or op.released != op.nchunks or op.native_pending > 0 or op.acked == op.nchunks:
        return
    op.refs += 1
    op_finish(ep, op, EACCES_ if op.any_failed else 0)
    op.user_done = 1
    ep.rndv_done_early += 1

cdef void on_chunk_served(ep_t* ep, fab_mr* mr) noexcept nogil:
    """FAB_EV_SERVED: the chunk registered as mr was all written toward the
    peer. Its region goes at once (no later read can see what the application
    puts in that memory after its send completed)."""
    cdef sendop_t* op = ep.rndv_out
    cdef uint32_t w = ep.w.opts.window_cap
    cdef size_t slot
    while op != NULL:
        if not op.native and op.window != NULL and mr >= op.window and mr < op.window + w:
            break
        op = op.next
    if op == NULL:
        return
    slot = <size_t>(mr - op.window)
    if op.window_index[slot] == NO_CHUNK or op.window_served[slot]:
        return
    if ep.w.opts.fault == FAULT_STALE_KEY and not ep.fault_has_stale:
        ep.fault_stale = op.window[slot]     # (a copy: its fields stay, the region goes)
        ep.fault_has_stale = 1
    ep.ch.ops.dereg(ep.ch, mr)
    op.window_served[slot] = 1
    op.released += 1
    ep.chunks_served += 1
    rndv_maybe_done_early(ep, op)

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
        ep.rndv_out_count -= 1
        if not op.any_failed:
            adapt_rndv_done(ep, op)
        op_finish(ep, op, EACCES_ if op.any_failed else 0)

cdef void announce_faulty(ep_t* ep, sendop_t* op, uint8_t* room, fab_mr* mr, size_t length) noexcept nogil:
    """Test-only: behave like a broken or hostile peer (FABRIC_FAULT_INJECT)."""
    cdef uint8_t key[MAX_RKEY]
    cdef uint64_t raddr = mr.addr
    cdef uint32_t key_len = mr.rkey_len
    cdef fab_mr* other
    memcpy(key, mr.rkey, mr.rkey_len)
    if ep.w.opts.fault == FAULT_BAD_KEY:
        key[0] ^= 0x5A
        key[mr.rkey_len - 1] ^= 0xA5
    elif ep.w.opts.fault == FAULT_BAD_RANGE:
        raddr += length            # just past the registered region
    elif ep.w.opts.fault == FAULT_FLOOD:
        pass
    else:
        other = &ep.fault_stale if ep.fault_has_stale else NULL
        if ep.w.opts.fault == FAULT_FOREIGN_KEY:
            other = live_chunk_elsewhere(ep)
        if other != NULL and other.length >= length:
            raddr = other.addr
            key_len = other.rkey_len
            memcpy(key, other.rkey, key_len)
    put_rndv(room, op.msg_id, op.announced, op.total, op.msg_off, raddr,
             <uint32_t>length, key, key_len)

cdef fab_mr* live_chunk_elsewhere(ep_t* ep) noexcept nogil:
    """Test-only: a chunk another endpoint of this worker has announced and
    not yet seen pulled (NULL if none)."""
    cdef uint32_t i, s
    cdef ep_t* other
    cdef sendop_t* op
    for i in range(ep.w.nslots):
        if ep.w.slots[i] == NULL or ep.w.slots[i].kind != KIND_EP or ep.w.slots[i] == &ep.node:
            continue
        other = <ep_t*>ep.w.slots[i]
        op = other.rndv_out
        while op != NULL:
            if not op.native:
                for s in range(ep.w.opts.window_cap):
                    if op.window_index[s] != NO_CHUNK:
                        return &op.window[s]
            op = op.next
    return NULL

cdef int announce_more(ep_t* ep, sendop_t* op) noexcept nogil:
    """Keep the endpoint's window of chunks announced once the first one is
    posted (never more than the peer accepts)."""
    cdef int made = 0
    if op.head_seq > ep.seq_posted:
        return 0
    while op.announced < op.nchunks:
        if op.window_index[op.announced % ep.w.opts.window_cap] != NO_CHUNK:
            break
        if op.announced - op.acked >= ep.peer_max_chunks:
            break           # the peer accepts no more unanswered chunks per message
        if op.announced - op.acked >= ep.window and ep.w.opts.fault != FAULT_FLOOD:
            break           # what this link needs ahead (core/adapt.pxi)
        if announce_chunk(ep, op, 0) != 0:
            return -1
        made = 1
    return made

cdef int start_rndv(ep_t* ep, sendop_t* op) noexcept nogil:
    """Announce the first chunk. -1 failed, 0 started, 1 wait (no slab free
    yet, or the peer's max_rendezvous are in flight), 2 too many chunks."""
    cdef uint32_t w = ep.w.opts.window_cap
    cdef uint32_t i
    cdef uint64_t nchunks = 0
    cdef size_t limit
    cdef int rc
    if ep.rndv_out_count >= ep.peer_max_rendezvous:
        return 1            # one finishing makes room (ep_flush runs frame_queue again)
    op.native = uses_native(ep, op.total)
    limit = chunk_limit(ep, op)
    for i in range(<uint32_t>op.nseg):
        nchunks += (op.segs[i].length + limit - 1) // limit
    if nchunks > 0xFFFFFFF0U:
        return 2
    if op.window == NULL:
        op.window = <fab_mr*>calloc(w, sizeof(fab_mr))
        op.window_index = <uint32_t*>malloc(w * sizeof(uint32_t))
        op.window_served = <uint8_t*>calloc(w, 1)
        if op.window == NULL or op.window_index == NULL or op.window_served == NULL:
            ep_fail(ep, ENOMEM, "out of memory")
            return -1
        for i in range(w):
            op.window_index[i] = NO_CHUNK
    op.nchunks = <uint32_t>nchunks
    if op.rndv_started == 0:
        op.rndv_started = monotonic_now()
    return announce_chunk(ep, op, 1)

cdef int frame_queue(ep_t* ep) noexcept nogil:
    """Turn queued messages into frames, in order. Returns -1 on failure."""
    cdef sendop_t* op
    cdef uint8_t* room
    cdef size_t off
    cdef int i, rc, direct
    while ep.sendq_head != NULL:
        op = ep.sendq_head
        if op.msg_id > ep.decided_id and put_decide(ep, op) < 0:
            return -1
        if op.put:
            rc = put_issue(ep, op)
            if rc < 0:
                return -1
            if rc == 1:
                return 0          # the window or the slabs are full: completions bring us back
            ep.sendq_head = op.next
            if ep.sendq_head == NULL:
                ep.sendq_tail = NULL
            if op.put_done == op.nchunks:
                op_finish(ep, op, 0)
            else:
                op.next = ep.put_out
                ep.put_out = op
            continue
        if op.total <= ep.eager_limit:
            direct = eager_zero_copy_now(ep, op)
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
            ep.rndv_out_count += 1
    maybe_put_close(ep)
    return 0

cdef bint all_announced(ep_t* ep) noexcept nogil:
    """Every chunk of every rendezvous in flight has been announced."""
    cdef sendop_t* op = ep.rndv_out
    while op != NULL:
        if op.announced < op.nchunks or op.native_first != NULL:
            return 0
        op = op.next
    return 1

cdef void maybe_put_close(ep_t* ep) noexcept nogil:
    """CLOSE goes after everything queued before it, announcements of
    rendezvous chunks included: the peer refuses frames after CLOSE."""
    cdef uint8_t* room
    if (not ep.close_requested or ep.close_sent or ep.state != EP_OPEN
            or ep.sendq_head != NULL or not all_announced(ep)):
        return
    room = data_room(ep, FRAME_HEADER)
    if room != NULL:
        put_header(room, F_CLOSE, 0, 0, 0, 0, 0)
        ep.close_sent = 1
        fault_due(ep, FS_CLOSE, ep.open_data.seq)

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
        if ep.close_requested and not ep.close_sent:
            maybe_put_close(ep)       # the last announcement may just have gone out
            if ep.close_sent:
                more = 1
        if (not more and ep.ctrl == NULL and ep.ctrl_ready_head == NULL
                and ep.pending_sends < ep.ch.send_depth and ep.peer_credits > 0):
            threshold = ep.w.opts.credits // 4
            if threshold < 1:
                threshold = 1
            # Credits owed for credit-only messages count apart: answering
            # each CREDIT with a CREDIT would never end between idle peers.
            # They go back once CREDIT_RESERVE of them are owed: each such
            # CREDIT then needs two credit-only messages and makes the peer
            # owe one, so an exchange dies out; and a sender starved at its
            # reserve (its data waits for credits above CREDIT_RESERVE) is
            # owed at least that many whenever the real ones are below the
            # threshold (credits >= 4), so it always gets them back.
            if ep.c2r - ep.c2r_quiet >= threshold or ep.c2r_quiet >= CREDIT_RESERVE:
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
    if op.total > ep.peer_max_message:
        # the peer would fail the whole connection for it: fail this send alone
        op_finish(ep, op, EMSGSIZE)
        return
    ep.next_out_id += 1
    op.msg_id = ep.next_out_id
    op.state = OP_QUEUED
    if op.total > ep.eager_limit and not op.large_counted and ep.caps & FAB_CAP_READS_SERVED:
        # the peer's pulls of it need this side's CPU (FAB_CAP_READS_SERVED:
        # tcp; verbs' NIC and UCX serve their own): the progress thread must
        # watch a busy event loop while it is in flight. (Watching on verbs
        # too slowed the Soft-RoCE guest's Dask transfers past their timeout
        # in one CI run, and serves nothing a NIC does not.)
        # (the thread is not woken for it: that wake-up, as the transfer
        # starts, cost 20-25% of a 1-4 MiB send's time from an idle loop; it
        # looks within LOOP_CHECK)
        op.large_counted = 1
        ep.w.large_sends += 1
    op.next = NULL
    if ep.sendq_tail == NULL:
        ep.sendq_head = op
    else:
        ep.sendq_tail.next = op
    ep.sendq_tail = op
    ep_flush(ep)
