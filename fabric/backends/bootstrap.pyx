# cython: language_level=3
"""The TCP bootstrap shared by the fabrics that need one (ucx, verbs).

Owns what both do alike on the socket a connection starts with: sending our
bootstrap message and receiving the peer's (a fixed header, then the payload
the header announces) without blocking; afterwards, watching the socket as
the liveness monitor (EOF or an error: the peer went away; a byte: a protocol
error); the queue of sends made before the connection is through; and the
listener that accepts such sockets. What a message says and
what a backend does with it stays in the backend (see bootstrap.pxd).

The bootstrap runs once per connection, so the backends call these functions
through this module's C-API table; nothing here is on a hot path.
"""
from libc.stdlib cimport malloc, calloc, free

from fabric._posix cimport *
from fabric.backends.interface cimport *
from fabric.backends.sockets cimport (accept_socket, listen_socket,
                                     local_and_peer_names, tune_socket)

cdef enum:
    LIVENESS_EVERY = 256           # polls between checks of an idle socket


cdef void boot_init(fab_boot* b, fab_channel* ch, int sock, size_t head_len) noexcept nogil:
    """Take the connected socket (the channel's descriptor from now on) and
    expect a fixed header of head_len (<= BOOT_HEAD_MAX) bytes."""
    b.sock = sock
    ch.fd = sock
    b.head_len = head_len
    local_and_peer_names(sock, ch.local_name, ch.peer_name, 64)


cdef char* boot_message(fab_boot* b, fab_channel* ch, size_t length) noexcept nogil:
    """The buffer for our message of length bytes, for the backend to fill;
    NULL (the channel failed) if there is no memory."""
    b.out = <char*>malloc(length)
    if b.out == NULL:
        fab_fail(ch, ENOMEM, "bootstrap")
        return NULL
    b.out_len = length
    return b.out


cdef int boot_progress(fab_boot* b, fab_channel* ch, boot_header_fn on_header) noexcept nogil:
    """Move both messages as far as the socket allows: 1 once ours is out and
    the peer's is in, 0 to wait for the socket, -errno if the channel failed.
    on_header (NULL: no payload) runs once, as soon as the peer's header is in."""
    cdef ssize_t r
    cdef Py_ssize_t n
    cdef char* dst
    cdef size_t want
    while b.out_done < b.out_len:
        r = send(b.sock, b.out + b.out_done, b.out_len - b.out_done, MSG_DONTWAIT | MSG_NOSIGNAL)
        if r < 0:
            if errno == EAGAIN or errno == EINTR:
                break
            return fab_fail(ch, errno, "bootstrap send")
        b.out_done += <size_t>r
    while b.head_done < b.head_len or b.payload_done < b.payload_len:
        # read exactly the message: a byte past it is the liveness monitor's
        if b.head_done < b.head_len:
            dst = b.head + b.head_done
            want = b.head_len - b.head_done
        else:
            dst = b.payload + b.payload_done
            want = b.payload_len - b.payload_done
        r = recv(b.sock, dst, want, MSG_DONTWAIT)
        if r == 0:
            return fab_fail(ch, ECONNRESET, "peer closed the bootstrap connection")
        if r < 0:
            if errno == EAGAIN or errno == EINTR:
                return 0
            return fab_fail(ch, errno, "bootstrap recv")
        if b.head_done < b.head_len:
            b.head_done += <size_t>r
        else:
            b.payload_done += <size_t>r
        if b.head_done == b.head_len and not b.have_head:
            b.have_head = 1
            n = on_header(ch, b.head) if on_header != NULL else 0
            if n < 0:
                return <int>n
            if n > 0:
                b.payload = <char*>malloc(<size_t>n)
                if b.payload == NULL:
                    return fab_fail(ch, ENOMEM, "bootstrap")
                b.payload_len = <size_t>n
    if b.out_done < b.out_len:
        return 0
    return 1


cdef uint32_t boot_events(fab_boot* b) noexcept nogil:
    """What to wait for: readable for the peer's message (or, later, its going
    away), writable while ours is still out."""
    return EPOLLIN | (EPOLLOUT if b.out_done < b.out_len else 0)


cdef void boot_release(fab_boot* b) noexcept nogil:
    """The exchange is over: free both messages (the socket stays)."""
    free(b.out)
    free(b.payload)
    b.out = b.payload = NULL
    b.out_len = b.out_done = b.payload_len = b.payload_done = 0


cdef void boot_close(fab_boot* b, fab_channel* ch) noexcept nogil:
    """The channel closes: free what is left, sends never posted included."""
    boot_release(b)
    while b.deferred != NULL:
        free(boot_next_deferred(b))
    if b.sock >= 0:
        close(b.sock)
    b.sock = -1
    ch.fd = -1


cdef int boot_watch(fab_boot* b, fab_channel* ch, int connected) noexcept nogil:
    """Once per poll: on a connected channel, check the socket when epoll
    reported it and every LIVENESS_EVERY polls. Sets peer_gone when the peer
    process went away (the socket ends with it); -EPROTO (the channel failed)
    if the peer wrote to it, else 0."""
    cdef char c
    cdef ssize_t r
    b.polls += 1
    if not connected or b.peer_gone or not (ch.revents or b.polls % LIVENESS_EVERY == 0):
        return 0
    r = recv(b.sock, &c, 1, MSG_DONTWAIT)
    if r == 0 or (r < 0 and errno != EAGAIN and errno != EINTR):
        b.peer_gone = 1
        b.gone_errno = 0 if r == 0 else errno
    elif r > 0:
        return fab_fail(ch, EPROTO, "unexpected bytes on the bootstrap connection")
    return 0


cdef int boot_fail_gone(fab_boot* b, fab_channel* ch) noexcept nogil:
    """Fail ch for a peer that went away, saying how: it closed the
    connection, or its host stopped answering (the socket's user timeout or
    keepalive ran out: a host that vanished without a word)."""
    if b.gone_errno == ETIMEDOUT:
        return fab_fail(ch, ETIMEDOUT, "the peer's host stopped answering (tcp_user_timeout_ms / keepalive)")
    if b.gone_errno != 0 and b.gone_errno != ECONNRESET:
        return fab_fail(ch, b.gone_errno, "the connection to the peer failed")
    return fab_fail(ch, ECONNRESET, "peer closed the connection")


cdef void* boot_defer(fab_boot* b, size_t size, uint64_t ctx) noexcept nogil:
    """A record of size bytes (a boot_deferred first), queued last; NULL if
    there is no memory."""
    cdef boot_deferred* dq = <boot_deferred*>malloc(size)
    if dq == NULL:
        return NULL
    dq.next = NULL
    dq.ctx = ctx
    if b.deferred_tail == NULL:
        b.deferred = dq
    else:
        b.deferred_tail.next = dq
    b.deferred_tail = dq
    return dq


cdef void* boot_next_deferred(fab_boot* b) noexcept nogil:
    """The oldest queued send, unlinked (the caller frees it), or NULL."""
    cdef boot_deferred* dq = b.deferred
    if dq != NULL:
        b.deferred = dq.next
        if b.deferred == NULL:
            b.deferred_tail = NULL
    return dq


# ------------------------------------------------------------- listener

cdef struct boot_listener:
    fab_listener base
    void* domain
    uint32_t depth
    fab_attach_fn make                       # the backend's channel on an accepted socket
    void (*unref)(void* domain) noexcept nogil


cdef int boot_accept(fab_listener* lst) noexcept nogil:
    cdef int fd = accept_socket(lst.fd)
    if fd >= 0:
        tune_socket(fd, 30000, 10)
    return fd


cdef fab_channel* boot_accepted(fab_listener* lst, int fd, size_t max_recv) noexcept nogil:
    cdef boot_listener* l = <boot_listener*>lst
    return l.make(l.domain, fd, max_recv, l.depth, NULL)     # closes fd if it fails


cdef void boot_close_listener(fab_listener* lst) noexcept nogil:
    cdef boot_listener* l = <boot_listener*>lst
    if lst.fd >= 0:
        close(lst.fd)
    l.unref(l.domain)
    free(lst)


cdef fab_listener* boot_listen(str host, int port, void* domain, int* refs, uint32_t depth,
                               fab_attach_fn make, void (*unref)(void* domain) noexcept nogil) except NULL:
    """A listener whose accepted sockets become make(domain, fd, max_recv,
    depth) channels; it holds a reference on the domain (refs) until closed."""
    cdef boot_listener* l = <boot_listener*>calloc(1, sizeof(boot_listener))
    if l == NULL:
        raise MemoryError()
    try:
        l.base.fd = listen_socket(host, port, l.base.address, 96)
    except BaseException:
        free(l)
        raise
    l.base.accept = boot_accept
    l.base.attach = boot_accepted
    l.base.close = boot_close_listener
    l.domain = domain
    l.depth = depth
    l.make = make
    l.unref = unref
    domain_ref(refs)
    return &l.base
