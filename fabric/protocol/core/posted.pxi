# Part of fabric.protocol.engine (included by engine.pyx).
#
# Receiver-posted buffers (POST / PUT, see frame.pxd).
# Owns, on the receiving side, the endpoint's one post: a recv_into() buffer
# registered for the peer to write and offered to it for the next message
# (POST), until that message's first frame, a PUT_DECLINED, the peer's CLOSE
# or the connection's end; a withdrawn post (the receive gave up) waits for
# the peer's answer, at most handshake_timeout, then fails the connection.
# On the sending side: the peer's pending post and the sends written into
# posts (put ops): chunks written with the fabric's one-sided write
# (chunks_in_flight ahead where the source must be registered), then the PUT
# frame in the data path, which the fabric delivers after the writes
# (FAB_CAP_ORDERED_WRITE). The op completes when every write completed.
# Invariants: the peer can write only into the region posted for the message
# it is about to send, within the posted size; the region is deregistered
# before the receive that posted it returns, whatever ends it; a post is
# used for message N only if N had not been framed when the POST arrived,
# and both sides decide that from N's first frame alone.

cdef enum:
    POST_NONE = 0
    POST_POSTED = 1          # offered to the peer for message post_id
    POST_WITHDRAWING = 2     # taken back: waiting for the peer's answer
    POST_MISSES_MAX = 3      # posts in a row that the peer did not use: stop posting

cdef inline bint posts_possible(ep_t* ep) noexcept nogil:
    return (ep.w.opts.posted_receives and ep.ch != NULL and ep.ch.ops.write != NULL
            and (ep.caps & FAB_CAP_ORDERED_WRITE) != 0)

cdef void post_release(ep_t* ep) noexcept nogil:
    """The post ends: its region goes (no write can land after this)."""
    if ep.post_state == POST_NONE:
        return
    if ep.ch != NULL:
        ep.ch.ops.dereg(ep.ch, &ep.post_mr)
    ep.post_state = POST_NONE
    ep.post_dst = NULL

cdef void post_buffer(ep_t* ep) noexcept nogil:
    """Offer the waiting recv_into()'s buffer to the peer for the next
    message, when the peer writes into posts and the message has not begun."""
    cdef posted_t* p = &ep.posted
    cdef uint8_t* room
    cdef int rc
    if (ep.post_state != POST_NONE or ep.state != EP_OPEN or ep.peer_closed or ep.close_requested
            or not (ep.peer_features & HELLO_WRITES_POSTED) or not posts_possible(ep)
            or not p.active or p.done or p.withdrawing or p.dst == NULL or p.msg != NULL
            or ep.inq_head != NULL or p.cap <= ep.eager_limit or ep.post_misses >= POST_MISSES_MAX):
        return
    # A POST is unsolicited: like data it must leave the reserved credits to
    # the frames that answer the peer (CHUNK_DONE, CREDIT, PUT_DECLINED), or
    # two peers posting at once can spend the last credits on both sides
    # with none returned. Without credits to spare now, no post.
    if ep.peer_credits <= CREDIT_RESERVE or ep.pending_sends >= ep.ch.send_depth:
        return
    rc = ep.ch.ops.reg(ep.ch, p.dst, p.cap, &ep.post_mr, FAB_REG_WRITE)
    if rc < 0:
        if ep.ch.failed:
            ep_channel_failed(ep)
        return                    # (no post: the message is pulled as before)
    room = ctrl_room(ep, FRAME_HEADER + POST_FIXED + ep.post_mr.rkey_len)
    if room == NULL:
        ep.ch.ops.dereg(ep.ch, &ep.post_mr)
        return
    put_post(room, ep.next_in_id, ep.post_mr.addr, p.cap, ep.post_mr.rkey, ep.post_mr.rkey_len)
    ep.post_state = POST_POSTED
    ep.post_id = ep.next_in_id
    ep.post_dst = p.dst
    ep.post_cap = p.cap
    ep.posts_offered += 1
    ep.frames_sent += 1

cdef void post_first_frame(ep_t* ep, uint64_t msg_id, int large) noexcept nogil:
    """The first frame of message msg_id arrived and it is not a PUT: the
    sender did not use the post, which ends now. large: the message is a
    rendezvous one (a post would have been worth it: keep posting)."""
    if ep.post_state != POST_NONE and ep.post_id == msg_id:
        post_release(ep)
        if large:
            ep.post_misses = 0
        else:
            ep.post_misses += 1
    elif large and ep.posted.active and ep.posted.dst != NULL and ep.posted.cap > ep.eager_limit:
        ep.post_misses = 0        # a large message into recv_into: posting pays again

cdef int post_withdraw(ep_t* ep) noexcept nogil:
    """The receive that posted gives up. 1 while the peer may still write
    into its buffer (wait and call again), 0 once it cannot."""
    cdef uint8_t* room
    if ep.post_state == POST_POSTED:
        if ep.state != EP_OPEN:
            post_release(ep)
            return 0
        room = ctrl_room(ep, FRAME_HEADER)
        if room == NULL:
            return 0              # (the endpoint failed: ep_settle closes the channel)
        put_header(room, F_POST, POST_WITHDRAW, 0, ep.post_id, 0, 0)
        ep.frames_sent += 1
        ep.post_state = POST_WITHDRAWING
        ep.post_deadline = monotonic_now() + ep.w.opts.handshake_timeout
        ep_flush(ep)
    if ep.post_state != POST_WITHDRAWING:
        return 0
    if ep.state != EP_OPEN:
        ep_settle(ep)             # closes the channel: nothing lands any more
        ep.post_state = POST_NONE
        return 0
    if monotonic_now() >= ep.post_deadline:
        ep_fail(ep, ETIMEDOUT, "peer did not answer the withdrawal of a posted receive buffer "
                               "within handshake_timeout")
        ep_settle(ep)
        ep.post_state = POST_NONE
        return 0
    return 1

cdef int on_put(ep_t* ep, frame_t* f) noexcept nogil:
    """PUT: message msg_id was written into our post (or, DECLINED, will not be)."""
    cdef posted_t* p = &ep.posted
    cdef inmsg_t* m
    if f.flags & PUT_DECLINED:
        if ep.post_state != POST_NONE and ep.post_id == f.msg_id:
            post_release(ep)
        return 0                  # (an answer to a post that already ended: nothing to do)
    if f.msg_id != ep.next_in_id:
        ep_fail(ep, EPROTO, "peer sent a message out of sequence")
        return -1
    if ep.post_state == POST_NONE or ep.post_id != f.msg_id:
        ep_fail(ep, EPROTO, "peer wrote a message into a buffer that was not posted to it")
        return -1
    if f.total > ep.post_cap or f.total > ep.w.opts.max_message:
        ep_fail(ep, EPROTO, "peer wrote a message larger than the buffer posted to it")
        return -1
    ep.next_in_id += 1
    ep.puts_received += 1
    ep.post_misses = 0
    if ep.post_state == POST_POSTED and p.active and not p.done and not p.withdrawing and p.dst == ep.post_dst:
        post_release(ep)
        p.length = f.total
        p.done = 1
        ep.pull_ahead = 0
        return 0
    # The receive gave up meanwhile (its caller waits in withdraw, so the
    # buffer is still there): the message moves to memory of our own.
    m = <inmsg_t*>calloc(1, sizeof(inmsg_t))
    if m == NULL:
        ep_fail(ep, ENOMEM, "out of memory")
        return -1
    m.data = msg_alloc(f.total)
    if m.data == NULL:
        free(m)
        ep_fail(ep, ENOMEM, "out of memory")
        return -1
    memcpy(m.data, ep.post_dst, f.total)
    post_release(ep)
    m.msg_id = f.msg_id
    m.total = f.total
    m.own_data = 1
    m.received = m.total
    m.charge = f.total + sizeof(inmsg_t)
    charge_budget(ep, m.charge)
    inq_append(ep, m)
    return 0

# ---------------------------------------------------------------- sending side

cdef int on_post(ep_t* ep, frame_t* f) noexcept nogil:
    """POST from the peer: a buffer for our message msg_id (or withdrawn)."""
    cdef uint8_t* room
    if f.flags & POST_WITHDRAW:
        if ep.peer_post_active and ep.peer_post_id == f.msg_id:
            ep.peer_post_active = 0
            room = ctrl_room(ep, FRAME_HEADER)
            if room == NULL:
                return -1
            put_header(room, F_PUT, PUT_DECLINED, 0, f.msg_id, 0, 0)
            ep.frames_sent += 1
        # else the message has begun: its own first frame answers the peer
        return 0
    if not (our_features(ep) & HELLO_WRITES_POSTED):
        ep_fail(ep, EPROTO, "peer posted a receive buffer, though this end said it does not "
                            "write into posted buffers")
        return -1
    ep.peer_posts += 1
    if f.msg_id >= ep.decided_id:
        ep.peer_posts_follow = 1  # (late for the last decision, or in time for the next)
    if f.msg_id <= ep.decided_id:
        return 0                  # that message left already: the peer learns it from its frame
    if f.msg_id != ep.decided_id + 1 or ep.peer_post_active:
        ep_fail(ep, EPROTO, "peer posted a receive buffer out of sequence")
        return -1
    ep.peer_post_active = 1
    ep.peer_post_id = f.msg_id
    ep.peer_post_addr = f.raddr
    ep.peer_post_cap = f.cap
    ep.peer_post_rkey_len = f.rkey_len
    memcpy(ep.peer_post_rkey, f.rkey, f.rkey_len)
    return 0

cdef inline uint32_t our_features(ep_t* ep) noexcept nogil:
    """What our HELLO offered (it depends only on options and the channel)."""
    return HELLO_MEASURES | (HELLO_WRITES_POSTED if posts_possible(ep) else 0)

cdef void look_for_post(ep_t* ep, size_t total) noexcept nogil:
    """A large message is about to be queued (lock held). A peer that posts
    its receives posts the one for this message right behind its request
    (send, then recv_into), so its POST may be in the channel unread: read
    what arrived first, so the message is decided with the POST in hand
    and not a moment before it. (One poll of the channel per large send to
    such a peer, none while earlier messages queue.)"""
    cdef double until
    if not (total > ep.eager_limit and ep.peer_posts and ep.state == EP_OPEN and ep.sendq_head == NULL
            and not ep.peer_post_active and not uses_native(ep, total)):
        return
    progress_ep(ep)
    if ep.peer_post_active or not ep.peer_posts_follow or ep.w.opts.spin <= 0:
        return
    # The peer's last POST came for the last message, in time or just after
    # we had decided: it is likely on its way. Wait for it as long as the
    # engine would spin (a pull costs a round trip more than a write); a
    # peer that stopped posting costs this once (the flag drops).
    until = monotonic_now() + min(ep.w.opts.spin, 100e-6)
    while not ep.peer_post_active and ep.state == EP_OPEN and monotonic_now() < until:
        progress_ep(ep)

cdef int put_decide(ep_t* ep, sendop_t* op) noexcept nogil:
    """op reached the head of the queue: write it into the peer's post if
    one waits for it and fits. 1 if op is now a put op."""
    cdef int use
    ep.decided_id = op.msg_id
    if not ep.peer_post_active or ep.peer_post_id != op.msg_id:
        ep.peer_posts_follow = 0  # (until a POST shows the peer still posts)
        return 0
    ep.peer_post_active = 0
    use = (op.total > ep.eager_limit and op.total <= ep.peer_post_cap
           and not uses_native(ep, op.total))
    if ep.w.opts.fault == FAULT_BAD_WRITE or ep.w.opts.fault == FAULT_STALE_POST:
        use = op.total > ep.eager_limit
    if not use:
        return 0
    op.put_rkey = <uint8_t*>malloc(ep.peer_post_rkey_len + 1)
    if op.put_rkey == NULL:
        ep_fail(ep, ENOMEM, "out of memory")
        return -1
    memcpy(op.put_rkey, ep.peer_post_rkey, ep.peer_post_rkey_len)
    op.put_rkey_len = ep.peer_post_rkey_len
    op.put_raddr = ep.peer_post_addr
    if ep.w.opts.fault == FAULT_BAD_WRITE:
        op.put_raddr += ep.peer_post_cap - 1      # straddles the end of what was posted
    elif ep.w.opts.fault == FAULT_STALE_POST and ep.fault_has_stale_post:
        op.put_raddr = ep.fault_stale_post_addr   # the previous message's post, released since
        memcpy(op.put_rkey, ep.fault_stale_post_rkey, op.put_rkey_len)
    if ep.w.opts.fault == FAULT_STALE_POST:
        ep.fault_stale_post_addr = ep.peer_post_addr
        memcpy(ep.fault_stale_post_rkey, ep.peer_post_rkey, op.put_rkey_len)
        ep.fault_has_stale_post = 1
    op.put = 1
    op.nchunks = 0
    op.state = OP_PUT
    return 1

cdef inline bint put_needs_reg(ep_t* ep) noexcept nogil:
    return not (ep.caps & FAB_CAP_SEND_ANY_MEMORY)

cdef int put_issue(ep_t* ep, sendop_t* op) noexcept nogil:
    """Write what the window allows; frame PUT once every write is issued.
    0 framed (op leaves the queue), 1 waiting, -1 failed."""
    cdef char* ptr
    cdef size_t length
    cdef uint32_t w = ep.w.opts.window_cap
    cdef uint32_t slot
    cdef fab_mr* mr
    cdef uint8_t* room
    cdef int rc
    if op.window == NULL and put_needs_reg(ep):
        op.window = <fab_mr*>calloc(w, sizeof(fab_mr))
        if op.window == NULL:
            ep_fail(ep, ENOMEM, "out of memory")
            return -1
    while op.msg_off < op.total:
        if put_needs_reg(ep) and op.put_issued - op.put_done >= ep.window:
            return 1
        next_chunk(ep, op, &ptr, &length)
        mr = NULL
        if put_needs_reg(ep):
            slot = op.put_issued % w
            mr = &op.window[slot]
            rc = ep.ch.ops.reg(ep.ch, ptr, length, mr, FAB_REG_LOCAL)
            if rc < 0:
                if ep.ch.failed:
                    ep_channel_failed(ep)
                else:
                    ep_fail(ep, -rc, "memory registration failed")
                return -1
        rc = ep.ch.ops.write(ep.ch, ptr, mr, length, op.put_raddr + op.msg_off, op.put_rkey,
                             op.put_rkey_len, <uint64_t><size_t>op | TAG_WRITE)
        if rc < 0:
            if mr != NULL:
                ep.ch.ops.dereg(ep.ch, mr)
            if rc == -EAGAIN and not ep.ch.failed:
                return 1          # the fabric's write queue is full: a completion brings us back
            if rc == -EINVAL and not ep.ch.failed:
                ep_fail(ep, EPROTO, "peer posted a key this fabric cannot use")
            else:
                ep_channel_failed(ep)
            return -1
        op.put_issued += 1
        op.cur_off += length
        op.msg_off += length
        ep.chunks_written += 1
        if rc == FAB_DONE:
            if mr != NULL:
                ep.ch.ops.dereg(ep.ch, mr)
            op.put_done += 1
        if op.put_issued == 1 and ep.w.opts.fault_stage == FS_PUT and fault_fires(ep, FS_PUT):
            send_garbage(ep)
    room = data_room(ep, FRAME_HEADER + PUT_BODY)
    if room == NULL:
        return 1                  # every slab in use: frame_queue comes back
    put_put(room, op.msg_id, op.total)
    ep.frames_sent += 1
    ep.sent_put += 1
    op.nchunks = op.put_issued
    if not ep.w.opts.coalesce:
        seal_data(ep)
    return 0

cdef void put_maybe_finish(ep_t* ep, sendop_t* op) noexcept nogil:
    """A put op whose PUT is framed completes with its last write."""
    cdef sendop_t** p
    if op.nchunks == 0 or op.put_done < op.nchunks:
        return
    p = &ep.put_out
    while p[0] != NULL and p[0] != op:
        p = &p[0].next
    if p[0] != NULL:
        p[0] = op.next
        op_finish(ep, op, 0)

cdef void on_write_done(ep_t* ep, sendop_t* op, int status) noexcept nogil:
    """FAB_EV_WRITE: the oldest pending write of op finished (a channel's
    writes complete in the order they were issued)."""
    cdef sendop_t* q = ep.put_out
    while q != NULL and q != op:
        q = q.next
    if q == NULL and not (ep.sendq_head == op and op.put):
        return
    if status < 0:
        ep_fail(ep, ECONNRESET, "peer refused a write into the buffer it posted")
        return
    if put_needs_reg(ep) and op.window != NULL:
        ep.ch.ops.dereg(ep.ch, &op.window[op.put_done % ep.w.opts.window_cap])
    op.put_done += 1
    put_maybe_finish(ep, op)
