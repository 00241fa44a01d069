# Part of fabric.protocol.engine (included by engine.pyx).
#
# The engine's one timer. Owns: the worker's timerfd (in its epoll set, so
# every poller wakes for it: an application thread blocked in a wait, the
# progress thread, an asyncio loop watching fileno()) and the next deadline
# it is set to, the earliest of what must happen at a time rather than on an
# event: a listener's handshake deadlines and its re-arm time
# (next_handshake_deadline), and the fabric hub's next_deadline (the ucx
# shared-memory probe). Pollers set it in arm_all, right before they block;
# when it fires, handle_events runs what is due.
# Invariants: w.timer_at is what the timerfd is set to (0: disarmed); a
# deadline in the past fires at once.

cdef uint64_t TIMER_KEY = 0xFFFFFFFFFFFFFFFDU
# listener deadlines are compared with `>` (a handshake expires after its
# deadline): wake a little after, so one wake-up finds it expired
cdef double TIMER_SLACK = 0.001

cdef double next_deadline(worker_t* w) noexcept nogil:
    """The earliest deadline the engine must wake for (-1: none)."""
    cdef double best = next_handshake_deadline(w)
    cdef double hub_at
    if best >= 0:
        best += TIMER_SLACK
    if w.hub != NULL and w.hub.next_deadline > 0:
        hub_at = w.hub.next_deadline
        if best < 0 or hub_at < best:
            best = hub_at
    return best

cdef void timer_arm(worker_t* w) noexcept nogil:
    """Set the timerfd to next_deadline() if that changed."""
    cdef double at = next_deadline(w)
    cdef itimerspec its
    if w.timer_fd < 0:
        return
    if at < 0:
        at = 0
    if at == w.timer_at:
        return
    memset(&its, 0, sizeof(its))
    if at > 0:
        if at < 1e-6:
            at = 1e-6
        its.it_value.tv_sec = <long>at
        its.it_value.tv_nsec = <long>((at - <double>its.it_value.tv_sec) * 1e9)
        if its.it_value.tv_sec == 0 and its.it_value.tv_nsec == 0:
            its.it_value.tv_nsec = 1       # (all zero would disarm it)
    timerfd_settime(w.timer_fd, TFD_TIMER_ABSTIME, &its, NULL)
    w.timer_at = at

cdef void timer_fired(worker_t* w) noexcept nogil:
    """The timerfd is readable: run what is due (handshakes that expired,
    listeners to re-arm, the hub's deadline); the next arm_all sets it for
    what comes next."""
    cdef uint64_t count
    cdef double now
    read(w.timer_fd, &count, 8)
    w.timer_at = 0
    now = monotonic_now()
    if w.hub != NULL and w.hub.next_deadline > 0 and now >= w.hub.next_deadline:
        w.hub_pending = 1
    sweep_listeners(w)
