# Part of fabric.protocol.engine (included by engine.pyx).
#
# Python layer: Endpoint (send, recv, recv_into, non-blocking variants,
# close), and the hand-over of received messages under the lock.

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
    if ep.stash_err:
        r.err = ep.stash_err
        ep.stash_err = 0
        ep.has_stash = 0
        return 1
    r.length = ep.stash_len
    if dst == NULL:
        r.data = ep.stash_data
    elif ep.stash_len > cap:
        r.err = EMSGSIZE          # kept for a larger buffer
        return 1
    else:
        memcpy(dst, ep.stash_data, ep.stash_len)
        msg_free(ep.stash_data)
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
            msg_free(r.data)
        if r.err == EACCES_:
            # its message failed and left the queue: the next receive reports
            # it (the others stay true: the message too large for the buffer
            # is still queued, a connection error is the endpoint's state)
            ep.stash_err = EACCES_
            ep.stash_data = NULL
            ep.stash_len = 0
            ep.has_stash = 1
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
    if post_withdraw(ep):
        return 1                  # the peer may still write into the buffer
    if m != NULL and p.dst != NULL and m.data == p.dst:
        # Cancelled reads are issued again into our memory, unless the peer's
        # side serves them (FAB_CAP_READS_SERVED): a read it already served
        # may have completed its send, and the region is gone. Those are
        # waited for instead.
        d = m.descs
        while d != NULL:
            if d.reading and ep.ch != NULL and not (ep.caps & FAB_CAP_READS_SERVED):
                if ep.ch.ops.cancel_read(ep.ch, <uint64_t><size_t>d | TAG_DESC) == 0:
                    d.reading = 0
                    m.reads -= 1
            d = d.next
        if m.reads > 0 and ep.state != EP_DEAD:
            return 1
        # (on a dead endpoint only a complete message is still bound here:
        # it stays receivable, so it moves too)
        nb = msg_alloc(m.total)
        if nb == NULL:
            ep_fail(ep, ENOMEM, "out of memory moving a message")
            ep_settle(ep)
            if ep.inq_head == m and m.received == m.total:
                inq_pop(ep)           # (it cannot stay in the caller's buffer)
        else:
            memcpy(nb, m.data, m.total)
            if m.dst_registered and ep.ch != NULL:
                ep.ch.ops.dereg(ep.ch, &m.dst_mr)
            m.dst_registered = 0
            m.data = nb
            m.own_data = 1
            m.charge += m.total
            charge_budget(ep, m.total)
            if m.received < m.total and ep.state == EP_OPEN:
                issue_reads(ep, m)
    if p.result != NULL:
        msg_free(p.result)
    memset(p, 0, sizeof(posted_t))
    return 0

cdef void withdraw(ep_t* ep) noexcept nogil:
    """unpost, waiting for reads that cannot be cancelled (lock held)."""
    while unpost(ep):
        worker_wait_quiet(ep.w, pred_no_reads, ep,
                          ep.post_deadline if ep.post_state == POST_WITHDRAWING else -1.0)

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
        if err == EMSGSIZE and self.ep.state == EP_OPEN:
            return (f"the message is larger than the peer accepts ({self.ep.peer_max_message} bytes, its "
                    f"max_message) or than one message can be split into; the connection stays open")
        if self.ep.state == EP_DEAD and self.ep.error[0]:
            text = self.ep.error.decode(errors="replace")
            if not self.failure_logged:
                self.failure_logged = True
                if self.ep.err == ESHUTDOWN_:
                    # the peer said goodbye (CLOSE): an ending, not a failure
                    _log.debug("%s connection %s closed by the peer", self.worker.backend.name, ep_names(self.ep))
                else:
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

    @property
    def link(self):
        """The link as this endpoint measured it and the thresholds sized to
        it (option adapt): round trip (least of the handshake's PINGs; None
        if the peer was not measured), bandwidth of recent rendezvous sends
        (None before the first), the thresholds in use now, which of them
        adapt (the others were fixed by the user or adapt=0), how often they
        changed and why the last time."""
        self._check_open()
        cdef ep_t* e = self.ep
        cdef opts_t* o = &self.w.opts
        cdef double rtt, bw
        cdef size_t eager, chunk
        cdef uint32_t window
        cdef uint64_t changes
        cdef char reason[120]
        with nogil:
            alock(self.w)
            rtt = e.rtt
            bw = e.bandwidth
            eager = e.eager_limit
            chunk = e.chunk_size
            window = e.window
            changes = e.adaptations
            memcpy(reason, e.adapt_why, sizeof(reason))
            wunlock(self.w)
        reason[sizeof(reason) - 1] = 0
        why = <bytes>reason
        free = [name for bit, name in ((ADAPT_EAGER, "eager_limit"), (ADAPT_CHUNK, "chunk_size"),
                                       (ADAPT_WINDOW, "chunks_in_flight")) if o.adapt & bit]
        return {"rtt_us": rtt * 1e6 if rtt > 0 else None,
                "bandwidth_MBps": bw / 1e6 if bw > 0 else None,
                "eager_limit": eager, "chunk_size": chunk, "chunks_in_flight": window,
                "adapting": free, "bounds": {"adapt_max_chunk": o.adapt_max_chunk,
                                             "adapt_max_window": o.window_cap},
                "changes": changes, "why": why.decode() if changes else
                ("configured values" if not free else "configured values (the link needs no more)")}

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
                "chunks_native": e.chunks_native, "chunks_served": e.chunks_served,
                # receiver-posted buffers: messages written into the peer's
                # posts; our recv_into buffers offered, and written into
                "sent_put": e.sent_put, "chunks_written": e.chunks_written,
                "posts_offered": e.posts_offered, "puts_received": e.puts_received,
                "rendezvous_done_early": e.rndv_done_early,
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
        return ("rendezvous", (size + self.ep.chunk_size - 1) // self.ep.chunk_size)

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
            look_for_post(ep, op.total)
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
            look_for_post(ep, op.total)
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

    def _withdraw_step(self):
        """Withdraw the receive _try_recv started without blocking (fabric.aio,
        tests): True once done (then as _cancel_recv), False while the peer
        may still write into the buffer or a read into it is landing (call
        again after progress; the engine bounds the wait by handshake_timeout)."""
        cdef int busy = 0
        if self.ep != NULL and not forked(self.w):
            with nogil:
                alock(self.w)
                if self.ep.posted.active:
                    busy = unpost(self.ep)
                    if busy and self.ep.state == EP_OPEN:
                        progress_ep(self.ep)
                        busy = unpost(self.ep) if self.ep.posted.active else 0
                ep_settle(self.ep)
                notify_loop(self.w)
                wunlock(self.w)
        if busy:
            return False
        self._drop_async_view()
        return True

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
        if self.ep.state == EP_HANDSHAKE or self.ep.state == EP_AUTH:
            return 0
        return 1 if self.ep.state == EP_OPEN else -1

    def _failure(self):
        """Why the handshake or the connection failed (fabric.aio)."""
        if self.ep == NULL:
            return "never connected"
        return self.ep.error.decode(errors="replace") or "closed"

    def _retryable(self):
        """fabric.aio: the connect failed before the listener answered at
        all (a busy listener drops connections it has not answered yet)."""
        return self.ep != NULL and self.ep.err == EAGAIN and not self.ep.opened

    def _connect_error(self, str what):
        """The exception for a connect that failed (fabric.aio): its class
        says why (authentication, protocol, the connection)."""
        cdef int err = self.ep.err if self.ep != NULL else ECONNRESET
        return connect_error(err, what, self._failure())

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
