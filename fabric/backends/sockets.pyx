# cython: language_level=3
"""Socket helpers shared by the TCP-based backends and bootstraps."""
from libc.string cimport memset, strcmp, strncmp
from fabric._posix cimport *


cdef void format_name(sockaddr* sa, socklen_t salen, char* out, size_t n) noexcept nogil:
    cdef char host[NI_MAXHOST]
    cdef char serv[NI_MAXSERV]
    if getnameinfo(sa, salen, host, NI_MAXHOST, serv, NI_MAXSERV, NI_NUMERICHOST | NI_NUMERICSERV) != 0:
        snprintf(out, n, "?")
    elif sa.sa_family == AF_INET6:
        snprintf(out, n, "[%s]:%s", host, serv)
    else:
        snprintf(out, n, "%s:%s", host, serv)


cdef int set_int_opt(int fd, int level, int name, int value) noexcept nogil:
    return setsockopt(fd, level, name, &value, sizeof(int))


cdef int tune_socket(int fd, int user_timeout_ms, int keepalive_s) noexcept nogil:
    set_int_opt(fd, IPPROTO_TCP, TCP_NODELAY, 1)
    if keepalive_s > 0:
        # A peer host that vanishes without a FIN/RST must still fail the
        # connection: keepalive probes plus a bound on unacknowledged data.
        set_int_opt(fd, SOL_SOCKET, SO_KEEPALIVE, 1)
        set_int_opt(fd, IPPROTO_TCP, TCP_KEEPIDLE, keepalive_s)
        set_int_opt(fd, IPPROTO_TCP, TCP_KEEPINTVL, keepalive_s)
        set_int_opt(fd, IPPROTO_TCP, TCP_KEEPCNT, 3)
    if user_timeout_ms > 0:
        set_int_opt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, user_timeout_ms)
    return 0


cdef void local_and_peer_names(int fd, char* local, char* peer, size_t n) noexcept nogil:
    cdef sockaddr_storage ss
    cdef socklen_t sl = sizeof(ss)
    if getsockname(fd, <sockaddr*>&ss, &sl) == 0:
        format_name(<sockaddr*>&ss, sl, local, n)
    sl = sizeof(ss)
    if getpeername(fd, <sockaddr*>&ss, &sl) == 0:
        format_name(<sockaddr*>&ss, sl, peer, n)


cdef int numeric_host(sockaddr* sa, socklen_t salen, char* out) noexcept nogil:
    return getnameinfo(sa, salen, out, NI_MAXHOST, NULL, 0, NI_NUMERICHOST)


cdef int peer_on_this_host(int fd) noexcept nogil:
    """1 if the connected socket's peer is on this host: a loopback address,
    or the very address of our end. Unlike anything the peer says about
    itself, a remote host cannot fake this on an established TCP connection
    (its packets must come from, and its answers reach, the address)."""
    cdef sockaddr_storage ss
    cdef socklen_t sl = sizeof(ss)
    cdef char local[NI_MAXHOST]
    cdef char peer[NI_MAXHOST]
    if getpeername(fd, <sockaddr*>&ss, &sl) != 0 or numeric_host(<sockaddr*>&ss, sl, peer) != 0:
        return 0
    if strncmp(peer, "127.", 4) == 0 or strcmp(peer, "::1") == 0 or strncmp(peer, "::ffff:127.", 11) == 0:
        return 1
    sl = sizeof(ss)
    if getsockname(fd, <sockaddr*>&ss, &sl) != 0 or numeric_host(<sockaddr*>&ss, sl, local) != 0:
        return 0
    return strcmp(local, peer) == 0


cdef int accept_socket(int lfd) noexcept nogil:
    """A non-blocking accepted socket, or -EAGAIN / -errno."""
    cdef int fd
    while True:
        fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)
        if fd >= 0 or errno != EINTR:
            break
    if fd < 0:
        if errno == EAGAIN or errno == ECONNABORTED:
            return -EAGAIN
        return -errno
    return fd


cdef int listen_socket(str host, int port, char* address, size_t address_len) except -1:
    """A listening, non-blocking socket; its bound name goes to address."""
    cdef addrinfo hints
    cdef addrinfo* res = NULL
    cdef addrinfo* ai
    cdef int fd = -1, rc, err = 0
    cdef sockaddr_storage ss
    cdef socklen_t sl
    cdef bytes bhost = (host or "").encode()
    cdef bytes bport = str(port).encode()
    cdef const char* node = NULL
    cdef const char* service = bport
    memset(&hints, 0, sizeof(hints))
    hints.ai_family = AF_UNSPEC
    hints.ai_socktype = SOCK_STREAM
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV
    if bhost:
        node = bhost
    with nogil:
        rc = getaddrinfo(node, service, &hints, &res)
    if rc != 0:
        raise OSError(f"cannot resolve {host!r}: {gai_strerror(rc).decode()}")
    try:
        ai = res
        while ai != NULL:
            fd = socket(ai.ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)
            if fd >= 0:
                set_int_opt(fd, SOL_SOCKET, SO_REUSEADDR, 1)
                if ai.ai_family == AF_INET6 and not bhost:
                    set_int_opt(fd, IPPROTO_IPV6, IPV6_V6ONLY, 0)
                if bind(fd, ai.ai_addr, ai.ai_addrlen) == 0 and listen(fd, SOMAXCONN) == 0:
                    break
                err = errno
                close(fd)
                fd = -1
            else:
                err = errno
            ai = ai.ai_next
    finally:
        freeaddrinfo(res)
    if fd < 0:
        raise OSError(err, f"cannot listen on {host}:{port}: {strerror(err).decode()}")
    sl = sizeof(ss)
    getsockname(fd, <sockaddr*>&ss, &sl)
    format_name(<sockaddr*>&ss, sl, address, address_len)
    return fd


cdef int connect_socket(str host, int port, double timeout) except -1:
    """A connected non-blocking socket (timeout < 0: none); raises
    TimeoutError or ConnectionRefusedError/OSError."""
    cdef addrinfo hints
    cdef addrinfo* res = NULL
    cdef addrinfo* ai
    cdef int fd = -1, rc, err = ETIMEDOUT, soerr
    cdef socklen_t sl
    cdef pollfd pfd
    cdef int ms
    cdef double deadline = monotonic_now() + timeout if timeout >= 0 else -1.0
    cdef bytes bhost = host.encode()
    cdef bytes bport = str(port).encode()
    cdef const char* node = bhost
    cdef const char* service = bport
    memset(&hints, 0, sizeof(hints))
    hints.ai_family = AF_UNSPEC
    hints.ai_socktype = SOCK_STREAM
    hints.ai_flags = AI_NUMERICSERV
    with nogil:
        rc = getaddrinfo(node, service, &hints, &res)
    if rc != 0:
        raise OSError(f"cannot resolve {host!r}: {gai_strerror(rc).decode()}")
    try:
        with nogil:
            ai = res
            while ai != NULL:
                fd = socket(ai.ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0)
                if fd < 0:
                    err = errno
                    ai = ai.ai_next
                    continue
                rc = connect(fd, ai.ai_addr, ai.ai_addrlen)
                if rc != 0 and errno == EINPROGRESS:
                    pfd.fd = fd
                    pfd.events = POLLOUT
                    while True:
                        ms = -1 if deadline < 0 else <int>((deadline - monotonic_now()) * 1000)
                        if deadline >= 0 and ms < 0:
                            ms = 0
                        rc = poll(&pfd, 1, ms)
                        if rc >= 0 or errno != EINTR:
                            break
                    if rc == 0:
                        err = ETIMEDOUT
                        rc = -1
                    elif rc > 0:
                        soerr = 0
                        sl = sizeof(int)
                        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl)
                        err = soerr
                        rc = 0 if soerr == 0 else -1
                    else:
                        err = errno
                elif rc != 0:
                    err = errno
                if rc == 0:
                    break
                close(fd)
                fd = -1
                if err == ETIMEDOUT:
                    break
                ai = ai.ai_next
    finally:
        freeaddrinfo(res)
    if fd < 0:
        if err == ETIMEDOUT:
            raise TimeoutError(f"connect to {host}:{port} timed out")
        raise ConnectionRefusedError(err, f"cannot connect to {host}:{port}: {strerror(err).decode()}")
    return fd


def _peer_on_this_host(int fd):
    """peer_on_this_host() for tests: is the connected socket's peer on this host?"""
    return bool(peer_on_this_host(fd))
