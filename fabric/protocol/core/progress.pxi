# Part of fabric.protocol.engine (included by engine.pyx).
#
# Progress and waiting: the worker's lock, its registry of pollable nodes
# (endpoints, listeners, the backend's hub), the progress thread, and the
# adaptive wait (spin briefly, then block in epoll or on the condition).
# Invariants: one thread drives the engine at a time (the worker lock); an
# application thread waiting on its own operation progresses the engine
# itself, the progress thread only works while the application is away; a
# blocked waiter is always woken (worker_kick) when its predicate may change.

cdef inline void wlock(worker_t* w) noexcept nogil:
    pthread_mutex_lock(&w.lock)

cdef inline void wunlock(worker_t* w) noexcept nogil:
    pthread_mutex_unlock(&w.lock)

cdef inline void alock(worker_t* w) noexcept nogil:
    """Lock on behalf of the application: the progress thread stays away
    while the application itself is driving the engine."""
    pthread_mutex_lock(&w.lock)
    w.last_app = monotonic_now()


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
                elif ev[i].kind == FAB_EV_WRITE:
                    on_write_done(ep, <sendop_t*><size_t>(ev[i].ctx & ~<uint64_t>TAG_MASK), ev[i].status)
                elif ev[i].kind == FAB_EV_SERVED:
                    on_chunk_served(ep, <fab_mr*><size_t>ev[i].ctx)
                elif ev[i].kind == FAB_EV_FAILED:
                    ep_channel_failed(ep)
            if (n > 0 and ep.ch != NULL and ep.ch.ops.recycle != NULL
                    and (ep.state == EP_OPEN or ep.state == EP_HANDSHAKE)):
                # the receive buffers go back before their credits do (ep_flush)
                ep.ch.ops.recycle(ep.ch)
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
    cdef int before
    if ep.state == EP_AUTH:
        before = ep.state
        auth_progress(ep)
        if ep.state == EP_HANDSHAKE:
            progress_ep_own(ep)      # the channel's first bytes may be in already
        else:
            ep_settle(ep)
            if ep.state != before:
                touch(w, &ep.node)
                worker_kick(w)
            elif ep.state == EP_AUTH:
                q_add(&w.dirty, &ep.dirty)
        return
    if ep.ch != NULL and ep.ch.hub != NULL and (ep.state == EP_OPEN or ep.state == EP_HANDSHAKE):
        hub_run(w)
        if ep.hub_pass == w.hub_pass:
            return            # progressed by the hub just now
    progress_ep_own(ep)


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
        # the key goes with it: a close touches, then unregisters the node,
        # and the coroutines waiting on it must still be woken by that key
        node.touched_key = node.key
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

cdef void worker_kick(worker_t* w) noexcept nogil:
    """Wake every thread waiting in this worker so it re-checks its state."""
    cdef uint64_t one = 1
    if w.polling:
        write(w.wake_fd, &one, 8)
    pthread_cond_broadcast(&w.cond)
    notify_loop(w)

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
        if ep.state == EP_AUTH:
            events = auth_events(ep)
            if events != ep.armed:
                ev.events = events
                ev.data.u64 = ep.node.key
                epoll_ctl(w.epfd, EPOLL_CTL_MOD, ep.auth.fd, &ev)
                ep.armed = events
            continue
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
    timer_arm(w)
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
        elif evs[i].data.u64 == TIMER_KEY:
            timer_fired(w)
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
    cdef int ready = 0
    if not (w.loop_polling or w.loop_attached) or w.notify_fd < 0:
        return
    # What that progress left for the poller (the rest of a large write
    # waiting for socket space, a frame read into a channel's buffer) must
    # reach the loop's descriptor: arm it now. Left unarmed, it waited for
    # the progress thread's watch of a silent loop (a fabric.grpc.aio call
    # over fabric+tcp stalled for that long, one large call in ten).
    if w.loop_polling and w.dirty != NULL and not w.closed:
        ready = arm_all(w)
    # Also while the loop is not watching: a coroutine between its last check
    # and its next wait must still learn that something happened meanwhile.
    if w.touched != NULL or ready:
        write(w.notify_fd, &one, 8)

cdef void drain_wake(worker_t* w) noexcept nogil:
    cdef uint64_t junk
    read(w.wake_fd, &junk, 8)

cdef inline void bg_sleep_until(worker_t* w, double resume, double now) noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    ts.tv_nsec += <long>((resume - now) * 1e9) + 1000
    while ts.tv_nsec >= 1000000000:
        ts.tv_sec += 1
        ts.tv_nsec -= 1000000000
    pthread_cond_timedwait(&w.bg_cond, &w.lock, &ts)

cdef void* progress_thread_main(void* arg) noexcept nogil:
    """Background progress. A TCP peer's pull, a full socket, a rendezvous
    release or the peer's CLOSE must not wait until the application calls
    fabric again. The thread stays asleep while an application thread is in
    the engine or was there within BG_GRACE (so it does not compete with an
    active application for the CPU); after that it blocks in epoll and
    progresses what has events. An application thread that starts to block
    kicks it out of epoll (wake_fd) and takes over.

    While an event loop polls for the worker, the thread leaves events to it
    unless the loop is busy: it looks at the epoll set without taking what
    it finds (level-triggered: the loop still sees it), and an event the
    loop, silent for LOOP_BUSY, has not come for within LOOP_ANSWER (it runs
    the application's code, not its selector) is served here, and so is
    everything after it until the loop enters the engine again. A peer's
    pull then waits about LOOP_BUSY + LOOP_ANSWER, not for the application's
    computation to end."""
    cdef worker_t* w = <worker_t*>arg
    cdef epoll_event evs[64]
    cdef int n, ms
    cdef double now, resume
    cdef double event_at = -1.0      # when a look found an event for a silent loop
    cdef double serving_since = -1.0 # the loop is away: serve until it enters the engine
    cdef bint busy_loop = 0          # ... because it left an event waiting
    wlock(w)
    while not w.bg_stop:
        if w.polling:
            w.bg_state = BG_BEHIND_POLLER
            pthread_cond_wait(&w.bg_cond, &w.lock)
            continue
        now = monotonic_now()
        if w.loop_polling:
            if w.last_app > event_at:
                event_at = -1.0
            if w.last_app > serving_since:
                serving_since = -1.0
        else:
            event_at = serving_since = -1.0
        if serving_since < 0:
            busy_loop = 0
        if w.loop_polling and serving_since < 0:
            if now - w.last_app < LOOP_BUSY:
                # the loop entered the engine just now: it serves itself
                w.bg_state = BG_BEHIND_POLLER
                bg_sleep_until(w, w.last_app + LOOP_BUSY, now)
                continue
            if event_at < 0 and now - w.last_app < LOOP_SILENCE and w.large_sends == 0:
                # No large send in flight, so no peer waits on this side to
                # serve a pull or take writes: what comes can wait for the
                # loop (serving a busy loop's small messages from here only
                # competes with it for the CPU: 10-17% fewer concurrent gRPC
                # calls per second, measured).
                w.bg_state = BG_BEHIND_POLLER
                resume = w.last_app + LOOP_SILENCE
                if resume > now + LOOP_CHECK:
                    resume = now + LOOP_CHECK      # a large send may start meanwhile
                bg_sleep_until(w, resume, now)
                continue
            if event_at < 0 and now - w.last_app < LOOP_SILENCE:
                # Idle in its selector (it takes any event at once) or busy
                # running the application (it does not): look and see.
                w.bg_state = BG_LOOKING
                ms = <int>((w.last_app + LOOP_SILENCE - now) * 1000.0) + 1
                wunlock(w)
                n = epoll_wait(w.epfd, evs, 1, ms)
                wlock(w)
                if n > 0 and w.last_app < now:
                    event_at = monotonic_now()
                continue
            if event_at >= 0 and now < event_at + LOOP_ANSWER:
                w.bg_state = BG_BEHIND_POLLER
                bg_sleep_until(w, event_at + LOOP_ANSWER, now)
                continue
            # The loop left an event waiting LOOP_ANSWER (it is busy), or has
            # not entered the engine for LOOP_SILENCE (it may have missed
            # something: a frame a send read into a channel's buffer, which
            # no descriptor announces): serve, and notify it.
            serving_since = now
            busy_loop = event_at >= 0
            event_at = -1.0
        resume = w.last_app + BG_GRACE
        if now < resume:
            w.bg_state = BG_WATCHING
            bg_sleep_until(w, resume, now)
            continue
        w.bg_state = BG_POLLING
        w.polling = 1
        ms = 1000                  # (deadlines: the engine's timer wakes epoll)
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
        if n > 0:
            w.bg_rounds += 1
            if busy_loop:          # (set only while serving)
                w.bg_loop_rounds += 1
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
    cdef double until
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

# The thread that runs Python's signal handlers: the main thread (fabric may
# be imported from another one), in a forked child the thread that forked.
cdef pthread_t signal_thread = <pthread_t>__import__("threading").main_thread().ident

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
        if pthread_self() != signal_thread:
            # Python runs signal handlers only in its main thread. Another
            # thread must not ask for the GIL here: PyGILState_Ensure from a
            # daemon thread while the interpreter finalizes dereferences
            # freed interpreter state (SIGSEGV at exit, issue 9).
            continue
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
    return (<ep_t*>arg).state != EP_HANDSHAKE and (<ep_t*>arg).state != EP_AUTH

cdef int pred_no_reads(void* arg) noexcept nogil:
    cdef ep_t* ep = <ep_t*>arg
    if ep.state == EP_DEAD:
        return 1
    return ((ep.posted.msg == NULL or ep.posted.msg.reads == 0)
            and ep.post_state != POST_WITHDRAWING)

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
            and ep.zc_out == NULL and ep.put_out == NULL and ep.ctrl_ready_head == NULL
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
    global fork_generation, signal_thread
    fork_generation += 1
    signal_thread = pthread_self()     # the forking thread is the child's main thread

cdef extern from "<pthread.h>" nogil:
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)

pthread_atfork(NULL, NULL, after_fork_in_child)

cdef inline bint forked(worker_t* w) noexcept nogil:
    return w.fork_gen != fork_generation


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
