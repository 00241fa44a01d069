# Part of fabric.protocol.engine (included by engine.pyx).
#
# Python layer: errors, options, and Worker (one per Fabric).
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
    if err == EKEYREJECTED_:
        return _errors.AuthenticationError(text)
    return _errors.ConnectionLost(text)


cdef object connect_error(int err, str what, str why):
    """A failed connect's exception: AuthenticationError when a key was
    missing or refused, else ConnectionLost with the reason."""
    if err == EKEYREJECTED_:
        return _errors.AuthenticationError(f"{what}: {why}")
    return _errors.ConnectionLost(f"{what} failed: {why}")


cdef inline double deadline_of(timeout) except? -2.0:
    if timeout is None:
        return -1.0
    t = float(timeout)
    if t < 0 or t != t:
        raise ValueError("timeout must be >= 0 or None")
    return monotonic_now() + t


cdef int opts_from(dict options, opts_t* o) except -1:
    """The engine's knobs from resolved options (fabric.options.resolve)."""
    o.eager_limit = int(options["eager_limit"])
    o.chunk_size = int(options["chunk_size"])
    o.chunks_in_flight = int(options["chunks_in_flight"])
    # adapt: fabric.api says which thresholds the user left free (_adapt_mask)
    o.adapt = int(options.get("_adapt_mask", 0)) if int(options.get("adapt", 0)) else 0
    o.adapt_max_chunk = max(o.chunk_size, int(options.get("adapt_max_chunk", o.chunk_size)))
    o.window_cap = o.chunks_in_flight
    if o.adapt & ADAPT_WINDOW:
        o.window_cap = max(o.chunks_in_flight, int(options.get("adapt_max_window", o.chunks_in_flight)))
    o.max_rendezvous = int(options.get("max_rendezvous", 64))
    o.coalesce_limit = int(options["coalesce_limit"])
    o.credits = int(options["credits"])
    o.recv_budget = int(options["recv_budget"])
    o.total_recv_budget = int(options.get("total_recv_budget", 1 << 30))
    o.send_buffers = int(options["send_buffers"])
    o.max_message = int(options["max_message"])
    o.spin = float(options["spin_us"]) * 1e-6
    o.spin_max = float(options.get("spin_max_us", 0)) * 1e-6
    o.handshake_timeout = float(options["handshake_timeout"])
    o.max_pending = max_pending_for(int(options.get("max_pending_handshakes", 1024)))
    o.max_connections = int(options.get("max_connections", 4096))
    o.close_linger = float(options["close_linger"])
    o.progress_thread = int(options.get("progress_thread", 1))
    o.native_min = int(options.get("native_min", 0))
    o.coalesce = int(options.get("coalesce", 1))
    o.posted_receives = int(options.get("posted_receives", 1))
    return 0

cdef uint32_t max_pending_for(int wanted):
    """Pending handshakes hold a descriptor each: never more than a quarter
    of what this process may open, so a flood of connections cannot take
    the descriptors the application needs."""
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY:
        wanted = min(wanted, max(8, soft // 4))
    return <uint32_t>max(1, wanted)


cdef int parse_fault(str text, opts_t* o) except -1:
    """FABRIC_FAULT_INJECT (tests only): bad_key, bad_range, flood,
    foreign_key, stale_key, bad_write, stale_post, or
    <die|garbage>@<hello|rndv|pull|chunk_done|batch|close|put>[:<n>]."""
    o.fault = o.fault_action = o.fault_stage = 0
    o.fault_count = 1
    if not text:
        return 0
    faults = {"bad_key": FAULT_BAD_KEY, "bad_range": FAULT_BAD_RANGE, "flood": FAULT_FLOOD,
              "foreign_key": FAULT_FOREIGN_KEY, "stale_key": FAULT_STALE_KEY,
              "bad_write": FAULT_BAD_WRITE, "stale_post": FAULT_STALE_POST}
    if text in faults:
        o.fault = faults[text]
        return 0
    action, at, rest = text.partition("@")
    stage, colon, count = rest.partition(":")
    if not at or action not in FAULT_ACTIONS or stage not in FAULT_STAGES or (colon and not count.isdigit()):
        raise ValueError(f"FABRIC_FAULT_INJECT={text!r}: use {', '.join(faults)}, or "
                         f"<{'|'.join(FAULT_ACTIONS)}>@<{'|'.join(FAULT_STAGES)}>[:<n>]")
    o.fault_action = FAULT_ACTIONS[action]
    o.fault_stage = FAULT_STAGES[stage]
    o.fault_count = int(count) if colon else 1
    if o.fault_count < 1:
        raise ValueError("FABRIC_FAULT_INJECT: the occurrence must be >= 1")
    return 0


cdef dict posted_state(ep_t* ep):
    """The posted receive, for _debug_state."""
    cdef posted_t* p = &ep.posted
    cdef inmsg_t* m = p.msg
    out = {"active": p.active, "done": p.done, "withdrawing": p.withdrawing, "into": p.dst != NULL,
           "cap": p.cap, "err": p.err}
    if m != NULL:
        out["msg"] = {"id": m.msg_id, "total": m.total, "received": m.received, "reads": m.reads,
                      "into_dst": m.data == p.dst and p.dst != NULL, "failed": m.failed}
    return out


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

    def __cinit__(self, Backend backend not None, dict options not None, auth_key=None, ssl=None):
        cdef pthread_condattr_t ca
        cdef epoll_event ev
        cdef const unsigned char[::1] key
        self.backend = backend
        self.options = dict(options)
        self.w = <worker_t*>calloc(1, sizeof(worker_t))
        if self.w == NULL:
            raise MemoryError()
        self.w.fork_gen = fork_generation
        self.w.epfd = self.w.wake_fd = self.w.notify_fd = self.w.timer_fd = -1
        name = backend.name.encode()[:8]
        memcpy(self.w.backend_name, <char*>name, len(name))
        if auth_key is not None:
            key = memoryview(auth_key).cast("B")
            if key.shape[0] < 16:
                raise ValueError("auth_key must hold at least 16 bytes")
            self.w.auth_key = <uint8_t*>malloc(key.shape[0])
            if self.w.auth_key == NULL:
                raise MemoryError()
            memcpy(self.w.auth_key, &key[0], key.shape[0])
            self.w.auth_key_len = key.shape[0]
        pthread_mutex_init(&self.w.lock, NULL)
        pthread_condattr_init(&ca)
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC)
        pthread_cond_init(&self.w.cond, &ca)
        pthread_cond_init(&self.w.bg_cond, &ca)
        cdef opts_t* o = &self.w.opts
        opts_from(options, o)
        # Test-only: make this Fabric announce forged keys or ranges, like a
        # broken peer would (tests/test_endpoint.py). Never set in production.
        fault = __import__("os").environ.get("FABRIC_FAULT_INJECT", "")
        parse_fault(fault, o)
        self.w.epfd = epoll_create1(EPOLL_CLOEXEC)
        self.w.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        self.w.notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)
        self.w.timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if self.w.epfd < 0 or self.w.wake_fd < 0 or self.w.notify_fd < 0 or self.w.timer_fd < 0:
            raise OSError(errno, f"cannot create the Fabric's descriptors: {strerror(errno).decode()}")
        ev.events = EPOLLIN
        ev.data.u64 = WAKE_KEY
        epoll_ctl(self.w.epfd, EPOLL_CTL_ADD, self.w.wake_fd, &ev)
        ev.events = EPOLLIN
        ev.data.u64 = TIMER_KEY
        epoll_ctl(self.w.epfd, EPOLL_CTL_ADD, self.w.timer_fd, &ev)
        self.domain = backend.open_domain(self.options) if ssl is None else backend.open_domain_tls(self.options, ssl)
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
        if self.w.auth_key != NULL:
            fab_wipe(self.w.auth_key, self.w.auth_key_len)
            free(self.w.auth_key)
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
    def buffered_bytes(self):
        """Bytes of received messages the application has not taken yet,
        over every endpoint (held within total_recv_budget)."""
        return self.w.inbuf_total if self.w != NULL else 0

    @property
    def progress_stats(self):
        """What the progress thread did: `background_rounds` of progress for
        an application away from fabric, `busy_loop_rounds` of them for an
        event loop that polls but was running the application's code when an
        event came (a peer's pull, room in a socket)."""
        if self.w == NULL:
            return {"background_rounds": 0, "busy_loop_rounds": 0}
        return {"background_rounds": self.w.bg_rounds, "busy_loop_rounds": self.w.bg_loop_rounds}

    @property
    def authenticates(self):
        """True if connections must prove the shared key (auth_key)."""
        return self.w != NULL and self.w.auth_key != NULL

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
        if self.w.timer_fd >= 0:
            close(self.w.timer_fd)
        self.w.epfd = self.w.wake_fd = self.w.notify_fd = self.w.timer_fd = -1

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
                                "put_out": ep.put_out != NULL or (ep.sendq_head != NULL and ep.sendq_head.put),
                                "post": ep.post_state,
                                "posted": (ep.posted.active, ep.posted.done), "receive": posted_state(ep), "buffered": ep.inbuf_bytes,
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
                    keys[nkeys] = node.touched_key
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

    cdef ep_t* _attach_fd(self, int fd, int* why, bint authenticate=True, str host=None) except? NULL:
        """An endpoint on a connected socket: authenticating the peer (its
        channel is built once that passed), or (authenticate=False, the
        in-memory fabric) in HANDSHAKE state with HELLO sent. NULL with
        *why = ESHUTDOWN_ (closed) or ENOMEM. Owns fd."""
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
        if host:
            name = host.encode()[:255]
            memcpy(a.host, <char*>name, len(name))
        with nogil:
            alock(self.w)
            if self.w.closed:
                close(fd)
                why[0] = ESHUTDOWN_
            else:
                # the channel is built under the engine lock: another thread
                # may be accepting on this Fabric and touching the same domain
                if authenticate:
                    ep = ep_create_gated(self.w, fd, ROLE_CONNECTOR, &a, NULL)
                else:
                    ch = a.attach(a.domain, fd, max_recv, a.recv_depth, a.host)
                    if ch != NULL:
                        ep = ep_create(self.w, ch)
                why[0] = ENOMEM
            wunlock(self.w)
        return ep

    def connect(self, str host, int port, timeout=None):
        cdef double deadline = deadline_of(timeout)
        # a busy listener may drop a connection before answering it: try
        # again within the timeout (else within the handshake timeout)
        cdef double retry_until = deadline if deadline >= 0 else monotonic_now() + self.w.opts.handshake_timeout
        backoff = 0.01
        while True:
            ep = self._connect_once(host, port, deadline)
            if ep is not None:
                return ep
            if monotonic_now() + backoff >= retry_until:
                raise _errors.ConnectionLost(f"connect to {host}:{port} failed: the listener closed every "
                                             f"attempt before answering (busy, or not a fabric listener)")
            _time.sleep(backoff)
            backoff = min(backoff * 2, 0.25)

    cdef object _connect_once(self, str host, int port, double deadline):
        """One attempt: the Endpoint, or None if the listener dropped the
        connection before answering (another attempt may succeed)."""
        cdef double hs_deadline
        cdef ep_t* ep
        cdef int rc = 0, why = 0, ok = 0
        cdef int fd
        cdef char error[200]
        cdef int err = 0
        self._check()
        remaining = -1.0 if deadline < 0 else max(0.0, deadline - monotonic_now())
        try:
            fd = self.backend.dial(self.domain, host, port, remaining, self.options)
        except TimeoutError as e:
            raise _errors.Timeout(str(e)) from None
        except OSError as e:
            raise _errors.ConnectionLost(f"cannot connect to {host}:{port}: {e.strerror or e}") from None
        ep = self._attach_fd(fd, &why, True, host)
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
                err = ep.err
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
            if err == EAGAIN:
                return None
            raise connect_error(err, f"connect to {host}:{port}", error.decode(errors="replace"))
        return make_endpoint(self, ep)

    def _attach_connected(self, int fd, bint authenticate=True, str host=None):
        """fabric.aio: an Endpoint, still in its handshake, on a socket the
        event loop connected (owns fd). authenticate=False: the in-memory
        test fabric, whose "socket" is an eventfd."""
        cdef int why = 0
        cdef ep_t* ep
        self._check()
        self.backend._tune(fd, self.options)
        ep = self._attach_fd(fd, &why, authenticate, host)
        if ep == NULL:
            if why == ESHUTDOWN_:
                raise _errors.ConnectionClosed("the Fabric is closed")
            raise _errors.ResourceLimit(f"cannot set up a {self.backend.name} channel "
                                        f"(out of memory or descriptors)")
        return make_endpoint(self, ep)
