# Part of fabric.protocol.engine (included by engine.pyx).
#
# Endpoint lifecycle: creation, handshake (HELLO), close (CLOSE), failure.
# Owns: the state machine EP_HANDSHAKE -> EP_OPEN -> (EP_FAILED ->) EP_DEAD, and
# listeners' pending handshakes (with their timeout).
# Invariants: a failure is only marked (ep_fail, first reason wins); the
# channel is closed and operations failed at a safe point (ep_settle), never in
# the middle of parsing data that belongs to the channel; after ep_settle the
# backend touches no memory of ours.

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
    elif err == EPROTO or err == EKEYREJECTED_:
        ep_fail(ep, err, ep.ch.error)        # a TLS certificate refused: AuthenticationError
    else:
        ep_fail(ep, ECONNRESET, ep.ch.error)

cdef int on_hello(ep_t* ep, frame_t* f) noexcept nogil:
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
    ep.peer_max_message = f.hello_max_message if f.hello_max_message else 0xFFFFFFFFFFFFFFFFULL
    # what the peer accepts in flight (0: an older peer that did not say)
    ep.peer_max_rendezvous = f.hello_max_rendezvous if f.hello_max_rendezvous else ep.w.opts.max_rendezvous
    ep.peer_max_chunks = f.hello_max_chunks if f.hello_max_chunks else ep.w.opts.window_cap
    ep.peer_features = f.hello_features
    if ep.w.opts.fault == FAULT_FLOOD:          # test-only: a peer that ignores both
        ep.peer_max_rendezvous = ep.peer_max_chunks = 0xFFFFFFFFU
    ep.slab_cap = slab_size_for(&ep.w.opts, f.hello_max_recv)
    ep.eager_limit = eager_limit_for(&ep.w.opts, ep.slab_cap)
    ep.state = EP_OPEN
    ep.opened = 1
    adapt_open(ep)
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
    post_release(ep)       # nothing more comes: the post goes unused
    ep.peer_post_active = 0
    fail_op_list(ep, ep.sendq_head, ESHUTDOWN_)
    ep.sendq_head = NULL
    ep.sendq_tail = NULL
    ep.close_requested = 1


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
    listener_release(ep)
    auth_free(ep)
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
    fail_op_list(ep, ep.put_out, err)
    ep.sendq_head = ep.sendq_tail = ep.zc_out = ep.rndv_out = ep.put_out = NULL
    ep.post_state = POST_NONE      # (its region went with the channel)
    ep.peer_post_active = 0
    ep.rndv_out_count = 0
    # Incomplete rendezvous messages are lost with the connection; complete
    # messages before the first incomplete one stay receivable, in order.
    while ep.rndv_in != NULL:
        m = ep.rndv_in
        ep.rndv_in = m.rnext
        ep.rndv_in_count -= 1
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
            ep.w.inbuf_total -= m.charge
            inmsg_maybe_free(m)
            m = n
    ep_deliver(ep)
cdef void send_hello(ep_t* ep) noexcept nogil:
    cdef iovec v
    cdef int rc
    cdef size_t max_recv = ep.ch.max_recv
    if ep.w.opts.fault_stage == FS_HELLO and fault_fires(ep, FS_HELLO):
        send_garbage(ep)          # instead of HELLO
        return
    put_hello(ep.hello, <uint32_t>max_recv, ep.w.opts.credits, ep.w.opts.max_message,
              ep.w.opts.max_rendezvous, ep.w.opts.window_cap, our_features(ep))
    v.iov_base = ep.hello
    v.iov_len = FRAME_HEADER + HELLO_BODY
    if not (ep.ch.caps & FAB_CAP_SEND_ANY_MEMORY):
        ep.hello_mr = <fab_mr*>calloc(1, sizeof(fab_mr))
        if ep.hello_mr == NULL or ep.ch.ops.reg(ep.ch, ep.hello, sizeof(ep.hello), ep.hello_mr, 0) < 0:
            ep_fail(ep, ENOMEM, "cannot register the handshake buffer")
            return
        ep.own_regions += 1
    rc = ep.ch.ops.send(ep.ch, &v, &ep.hello_mr if ep.hello_mr != NULL else NULL, 1, 0)
    if rc == FAB_PENDING:
        ep.pending_sends += 1
    elif rc < 0:
        ep_channel_failed(ep)

cdef ep_t* ep_alloc(worker_t* w) noexcept nogil:
    """A zeroed endpoint of w, not yet registered (NULL: no memory)."""
    cdef ep_t* ep = <ep_t*>calloc(1, sizeof(ep_t))
    if ep == NULL:
        return NULL
    ep.node.kind = KIND_EP
    ep.w = w
    ep.dirty.obj = ep
    ep.runnable.obj = ep
    ep.next_in_id = 1
    # until the application shows it takes large messages with recv_into(),
    # pull them into our memory as they come (within recv_budget): a thread
    # that sends before it receives must not wait for itself
    ep.pull_ahead = 1
    return ep

cdef void ep_bind_channel(ep_t* ep, fab_channel* ch) noexcept nogil:
    """Give a registered endpoint its connected channel: HANDSHAKE state,
    HELLO sent. Takes ownership of ch."""
    cdef epoll_event ev
    ep.ch = ch
    ep.caps = ch.caps
    memcpy(ep.local_name, ch.local_name, 64)
    memcpy(ep.peer_name, ch.peer_name, 64)
    ep.local_name[63] = 0
    ep.peer_name[63] = 0
    ch.owner = ep
    ep.state = EP_HANDSHAKE
    ep.armed = EPOLLIN
    if ch.fd >= 0:
        ev.events = EPOLLIN
        ev.data.u64 = ep.node.key
        if epoll_ctl(ep.w.epfd, EPOLL_CTL_ADD, ch.fd, &ev) != 0:
            ep_fail(ep, ENOMEM, "cannot watch the connection's descriptor")
            return
    q_add(&ep.w.dirty, &ep.dirty)
    send_hello(ep)

cdef ep_t* ep_create(worker_t* w, fab_channel* ch) noexcept nogil:
    """A new endpoint in HANDSHAKE state on a connected channel, without the
    authentication stage (the in-memory test fabric has no socket); sends
    HELLO. Takes ownership of ch (closes it on failure)."""
    cdef ep_t* ep = ep_alloc(w)
    if ep == NULL:
        ch.ops.close(ch)
        return NULL
    if node_register(w, &ep.node, -1, 0) == 0:
        ch.ops.close(ch)
        free(ep)
        return NULL
    ep_bind_channel(ep, ch)
    return ep

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
    ep.w.inbuf_total -= ep.inbuf_bytes     # whatever is still charged (none, normally)
    ep.inbuf_bytes = 0
    if ep.posted.result != NULL:
        msg_free(ep.posted.result)
    msg_free(ep.stash_data)
    free(ep.hello_mr)
    free(ep)

cdef uint32_t our_max_recv(worker_t* w) noexcept nogil:
    """The largest fabric message we accept: our own slab size."""
    return <uint32_t>slab_size_for(&w.opts, 0xFFFFFFFFU)

cdef void progress_listener(lst_t* l) noexcept nogil:
    cdef ep_t* ep
    cdef int fd
    if l.closed:
        return
    while not l.closed and not l.disarmed:
        if <uint32_t>l.npending >= l.w.opts.max_pending and not listener_evict(l):
            # every pending handshake is young: accept again once one ends
            # or grows old enough to give way (the sweep re-arms us)
            listener_disarm(l, listener_next_room(l), 0)
            break
        fd = l.fl.accept(l.fl)
        if fd < 0:
            if fd != -EAGAIN:
                # out of descriptors (EMFILE) or another error: the socket stays
                # readable, so look again shortly instead of spinning on it
                listener_disarm(l, monotonic_now() + 0.05, 1)
            break
        ep = ep_create_gated(l.w, fd, ROLE_ACCEPTOR, NULL, l)
        if ep == NULL:
            continue
        ep.lst_next = l.pending
        l.pending = ep
        l.npending += 1
        progress_ep(ep)
    listener_sweep(l)

cdef void listener_check_room(ep_t* ep) noexcept nogil:
    """A connection that delivered its preamble to a listener at its
    max_connections is marked to be turned away (the flag in our answer
    tells the connector why)."""
    cdef lst_t* l = ep.listener
    if l != NULL and l.nconnections >= l.w.opts.max_connections:
        ep.auth.ours[6] |= AUTH_FULL

cdef int listener_take_place(ep_t* ep) noexcept nogil:
    """An authenticated connection takes its place among the listener's
    max_connections (a stranger never holds one); -1, the endpoint failed,
    if others took the last places while it authenticated."""
    cdef lst_t* l = ep.listener
    if l == NULL:
        return 0
    if l.nconnections >= l.w.opts.max_connections:
        ep_fail(ep, ECONNREFUSED_, "turned away: the listener reached its connection limit "
                                   "(max_connections) while this connection authenticated")
        return -1
    l.nconnections += 1
    ep.admitted_by = l.node.key
    return 0

cdef void listener_release(ep_t* ep) noexcept nogil:
    """The connection gives back its place (closed, failed or refused)."""
    cdef node_t* node
    if ep.admitted_by == 0:
        return
    node = node_lookup(ep.w, ep.admitted_by)
    ep.admitted_by = 0
    if node != NULL and node.kind == KIND_LST and (<lst_t*>node).nconnections > 0:
        (<lst_t*>node).nconnections -= 1

cdef void listener_disarm(lst_t* l, double until, int out_of_fds) noexcept nogil:
    """Take the listening socket out of the epoll set until `until` (or,
    when the table is full, until a pending handshake ends)."""
    cdef epoll_event ev
    if not l.disarmed:
        ev.events = 0
        ev.data.u64 = l.node.key
        epoll_ctl(l.w.epfd, EPOLL_CTL_MOD, l.fl.fd, &ev)
        l.disarmed = 1
    l.rearm_at = until
    l.out_of_fds = out_of_fds

cdef void listener_rearm(lst_t* l) noexcept nogil:
    cdef epoll_event ev
    if l.disarmed and not l.closed:
        ev.events = EPOLLIN
        ev.data.u64 = l.node.key
        epoll_ctl(l.w.epfd, EPOLL_CTL_MOD, l.fl.fd, &ev)
        l.disarmed = 0

cdef inline int evictable(ep_t* ep, double now) noexcept nogil:
    """0: keep; else a rank (lower goes first) for a pending connection that
    may give way to a new one: those that have not delivered their preamble
    within the grace period (silent ones first; the listener has not
    answered them, so a legitimate but slow client sees its connection end
    unanswered and retries), then those that owe us their MAC four grace
    periods after our preamble (a stranger can send a preamble, not a MAC).
    A connection past authentication is never dropped."""
    if ep.state != EP_AUTH or now < handshake_may_give_way(ep):
        return 0
    if ep.auth.stage == AS_PREAMBLE:
        return 1 if ep.auth.heard == 0 else 2
    return 3 if ep.auth.stage == AS_PEER_MAC else 0

cdef inline double handshake_may_give_way(ep_t* ep) noexcept nogil:
    """When a pending connection may be dropped to make room (see evictable);
    for one that never may, when it ends at the latest."""
    if ep.state == EP_AUTH and ep.auth.stage == AS_PREAMBLE:
        return ep.auth.started + EVICT_GRACE
    if ep.state == EP_AUTH and ep.auth.stage == AS_PEER_MAC:
        return ep.auth.answered + 4 * EVICT_GRACE
    return ep.hs_deadline

cdef int listener_evict(lst_t* l) noexcept nogil:
    """Drop the pending handshake that most deserves it to make room: 1 if
    one went. Legitimate peers answer in milliseconds; a table full of
    connections that stay silent (or trickle) must not lock them out."""
    cdef ep_t* ep = l.pending
    cdef ep_t* victim = NULL
    cdef int rank, best = 99
    cdef double now = monotonic_now()
    while ep != NULL:
        rank = evictable(ep, now)
        # the list is newest first: on a tie the later (older) one wins
        if rank and rank <= best:
            best = rank
            victim = ep
        ep = ep.lst_next
    if victim == NULL:
        return 0
    ep_fail(victim, ETIMEDOUT, "dropped while pending: the listener's table of pending handshakes "
                               "was full (max_pending_handshakes) and this one was the slowest")
    l.evicted += 1
    listener_sweep(l)
    return 1

cdef double listener_next_room(lst_t* l) noexcept nogil:
    """When the oldest pending handshake may give way (see evictable)."""
    cdef ep_t* ep = l.pending
    cdef double best = monotonic_now() + 0.05
    cdef double t
    cdef int found = 0
    while ep != NULL:
        t = handshake_may_give_way(ep)
        if not found or t < best:
            best = t
            found = 1
        ep = ep.lst_next
    return best

cdef void listener_sweep(lst_t* l) noexcept nogil:
    """Move finished handshakes to the ready queue; drop failed or expired
    ones (garbage, slow, unauthenticated or vanished clients never reach
    accept()). A connection that failed after its handshake is still handed
    out, like an accepted socket that was reset: what its peer sent before
    stays receivable, then the error."""
    cdef ep_t** p = &l.pending
    cdef ep_t* ep
    cdef double now = monotonic_now()
    while p[0] != NULL:
        ep = p[0]
        if (ep.state == EP_HANDSHAKE or ep.state == EP_AUTH) and now > ep.hs_deadline:
            ep_fail(ep, ETIMEDOUT, "handshake timed out")
            ep_settle(ep)
        if ep.state == EP_HANDSHAKE or ep.state == EP_AUTH:
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
            if ep.err == EKEYREJECTED_ or ep.err == ECONNREFUSED_ or (ep.err == EPROTO and ep.ch == NULL):
                l.refused += 1
                snprintf(l.last_refusal, 200, "%s: %s", ep.peer_name, ep.error)
            ep.listener = NULL
            ep_free(ep)
    if l.disarmed and (now >= l.rearm_at or
                       (not l.out_of_fds and <uint32_t>l.npending < l.w.opts.max_pending)):
        listener_rearm(l)

cdef double next_handshake_deadline(worker_t* w) noexcept nogil:
    """The earliest handshake deadline of any listener (-1: none), so a
    blocked waiter wakes to expire a handshake nobody finishes, or to let a
    listener that gave up its place in the epoll set look again."""
    cdef uint32_t i
    cdef lst_t* l
    cdef ep_t* ep
    cdef double best = -1.0
    for i in range(w.nslots):
        if w.slots[i] == NULL or w.slots[i].kind != KIND_LST:
            continue
        l = <lst_t*>w.slots[i]
        if l.disarmed and (best < 0 or l.rearm_at < best):
            best = l.rearm_at
        ep = l.pending
        while ep != NULL:
            if best < 0 or ep.hs_deadline < best:
                best = ep.hs_deadline
            ep = ep.lst_next
    return best

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
