# Part of fabric.protocol.engine (included by engine.pyx).
#
# Python layer: Listener (accept; handshakes run in the background).

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
    def refused(self):
        """Connections refused before they reached accept() because their
        peer failed authentication or did not speak fabric's preamble, or
        turned away at max_connections."""
        return self.l.refused if self.l != NULL else 0

    @property
    def connections(self):
        """Connections this listener admitted (authenticated) that are
        neither closed nor dead (at most max_connections; more are turned
        away)."""
        return self.l.nconnections if self.l != NULL else 0

    @property
    def evicted(self):
        """Pending handshakes dropped to make room for new connections
        (the table of max_pending_handshakes was full)."""
        return self.l.evicted if self.l != NULL else 0

    @property
    def last_refusal(self):
        """Who was refused last and why ("" if nobody was)."""
        cdef char text[200]
        if self.l == NULL or forked(self.l.w):
            return ""
        with nogil:
            alock(self.l.w)                 # the engine may be writing it
            memcpy(text, self.l.last_refusal, 200)
            wunlock(self.l.w)
        text[199] = 0
        return text.decode(errors="replace")

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
