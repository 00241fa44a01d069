# TLS for the tcp fabric (fabric/backends/tls.pyx), reached through a table of
# function pointers so that the tcp backend builds and runs where OpenSSL's
# headers are absent (only Fabric("tcp", ssl=...) then says TLS is missing).
from posix.uio cimport iovec

cdef struct fab_tls_ops:
    # A TLS session on a connected socket: the client verifies `host` when
    # its context checks host names (NULL: accepted, the server side).
    # NULL with `error` filled when it cannot be set up.
    void* (*start)(void* ssl_ctx, int fd, int server, const char* host, int check_hostname,
                   char* error, size_t error_len) noexcept nogil
    # sendmsg's and recv's counterparts on the session (the handshake runs
    # first, within them): bytes moved, 0 at the peer's end (recv), or -1
    # with errno EAGAIN (wait: want_write() says for which event) or another
    # errno, with the reason in `error`.
    Py_ssize_t (*sendv)(void* tls, iovec* iov, int iovcnt, char* error, size_t error_len) noexcept nogil
    Py_ssize_t (*recv)(void* tls, char* buf, size_t n, char* error, size_t error_len) noexcept nogil
    # Decrypted bytes are buffered: poll now, the socket will not say so.
    int (*pending)(void* tls) noexcept nogil
    # The handshake is through: queued data can go (until then only the
    # session's own wants count).
    int (*handshaken)(void* tls) noexcept nogil
    # The session waits for the socket to be writable (a handshake or a
    # record in flight), whichever direction the caller wanted.
    int (*want_write)(void* tls) noexcept nogil
    void (*free)(void* tls) noexcept nogil
    void (*ctx_free)(void* ssl_ctx) noexcept nogil
