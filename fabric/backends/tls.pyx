# cython: language_level=3
"""TLS for the tcp fabric: OpenSSL sessions on the fabric's own sockets,
driven without the GIL by the tcp channel (fabric/backends/tls.pxd).

The application configures TLS the way it always does, with an
ssl.SSLContext (certificates, CA, verify mode, check_hostname, ciphers,
minimum version, mutual TLS); fabric takes the OpenSSL context inside it (the
same libssl Python's ssl module uses, checked at run time) and runs sessions
on it from the engine's threads. Contexts that would call back into Python
from those threads (sni_callback, keylog_filename, _msg_callback) are
refused: the engine never takes the GIL while it holds its lock.

Without kernel TLS (this machine's kernel has no `tls` ULP) every byte is
encrypted in user space: sends of up to 16 KiB are gathered into one TLS
record, larger ones go record by record from the caller's memory.
"""
from libc.stdint cimport uint64_t, uintptr_t, intptr_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy, strlen
from posix.uio cimport iovec
from cpython.pycapsule cimport PyCapsule_New

from fabric._posix cimport errno, EAGAIN, EINTR, EPROTO, ECONNRESET, EPIPE, snprintf

cdef extern from *:
    """
    #include <errno.h>
    static inline void fab_set_errno(int e) { errno = e; }
    """
    void set_errno "fab_set_errno"(int e) noexcept nogil

cdef extern from "<sys/socket.h>" nogil:
    ssize_t send(int fd, const void* buf, size_t n, int flags)
    ssize_t recv(int fd, void* buf, size_t n, int flags)
    enum:
        MSG_NOSIGNAL

cdef extern from "<openssl/bio.h>" nogil:
    ctypedef struct BIO:
        pass
    ctypedef struct BIO_METHOD:
        pass
    ctypedef int (*bio_write_fn)(BIO* b, const char* data, int n) noexcept nogil
    ctypedef int (*bio_read_fn)(BIO* b, char* out, int n) noexcept nogil
    ctypedef long (*bio_ctrl_fn)(BIO* b, int cmd, long num, void* ptr) noexcept nogil
    ctypedef int (*bio_create_fn)(BIO* b) noexcept nogil
    int BIO_get_new_index()
    BIO_METHOD* BIO_meth_new(int type, const char* name)
    int BIO_meth_set_write(BIO_METHOD* m, bio_write_fn f)
    int BIO_meth_set_read(BIO_METHOD* m, bio_read_fn f)
    int BIO_meth_set_ctrl(BIO_METHOD* m, bio_ctrl_fn f)
    int BIO_meth_set_create(BIO_METHOD* m, bio_create_fn f)
    int BIO_meth_set_destroy(BIO_METHOD* m, bio_create_fn f)
    BIO* BIO_new(const BIO_METHOD* m)
    void BIO_set_data(BIO* b, void* ptr)
    void* BIO_get_data(BIO* b)
    void BIO_set_init(BIO* b, int init)
    void BIO_clear_retry_flags(BIO* b)
    void BIO_set_retry_read(BIO* b)
    void BIO_set_retry_write(BIO* b)
    void BIO_set_flags(BIO* b, int flags)
    int BIO_test_flags(const BIO* b, int flags)
    void BIO_free(BIO* b)
    enum:
        BIO_TYPE_SOURCE_SINK
        BIO_TYPE_DESCRIPTOR
        BIO_CTRL_FLUSH
        BIO_CTRL_EOF
        BIO_FLAGS_IN_EOF

cdef extern from "<arpa/inet.h>" nogil:
    int inet_pton(int af, const char* src, void* dst)
    enum:
        AF_INET
        AF_INET6

cdef extern from "<openssl/ssl.h>" nogil:
    ctypedef struct SSL_CTX:
        pass
    ctypedef struct SSL:
        pass
    ctypedef struct X509_VERIFY_PARAM:
        pass
    SSL* SSL_new(SSL_CTX* ctx)
    void SSL_free(SSL* s)
    void SSL_set_bio(SSL* s, BIO* rbio, BIO* wbio)
    long SSL_set_mode(SSL* s, long mode)
    long SSL_clear_mode(SSL* s, long mode)
    uint64_t SSL_set_options(SSL* s, uint64_t op)
    uint64_t SSL_CTX_get_options(const SSL_CTX* ctx)
    int SSL_CTX_get_verify_mode(const SSL_CTX* ctx)
    int SSL_CTX_up_ref(SSL_CTX* ctx)
    void SSL_CTX_free(SSL_CTX* ctx)
    void SSL_set_connect_state(SSL* s)
    void SSL_set_accept_state(SSL* s)
    int SSL_do_handshake(SSL* s)
    int SSL_read(SSL* s, void* buf, int num)
    int SSL_write(SSL* s, const void* buf, int num)
    int SSL_get_error(const SSL* s, int ret)
    int SSL_pending(const SSL* s)
    void SSL_set_msg_callback(SSL* s, void* cb)
    void* SSL_CTX_get_keylog_callback(const SSL_CTX* ctx)
    ctypedef struct SSL_METHOD:
        pass
    const SSL_METHOD* SSL_CTX_get_ssl_method(const SSL_CTX* ctx)
    const SSL_METHOD* TLS_method()
    const SSL_METHOD* TLS_server_method()
    const SSL_METHOD* TLS_client_method()
    int SSL_shutdown(SSL* s)
    long SSL_get_verify_result(const SSL* s)
    long SSL_set_tlsext_host_name(SSL* s, const char* name)
    int SSL_set1_host(SSL* s, const char* hostname)
    void SSL_set_hostflags(SSL* s, unsigned int flags)
    X509_VERIFY_PARAM* SSL_get0_param(SSL* s)
    int X509_VERIFY_PARAM_set1_ip_asc(X509_VERIFY_PARAM* param, const char* ipasc)
    const char* X509_verify_cert_error_string(long n)
    const char* OpenSSL_version(int t)
    unsigned long OpenSSL_version_num()
    enum:
        SSL_ERROR_NONE
        SSL_ERROR_SSL
        SSL_ERROR_WANT_READ
        SSL_ERROR_WANT_WRITE
        SSL_ERROR_SYSCALL
        SSL_ERROR_ZERO_RETURN
        SSL_MODE_ENABLE_PARTIAL_WRITE
        SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER
        SSL_MODE_RELEASE_BUFFERS
        SSL_OP_IGNORE_UNEXPECTED_EOF
        X509_V_OK

cdef extern from "<openssl/x509v3.h>" nogil:
    enum:
        X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS
        X509_CHECK_FLAG_NEVER_CHECK_SUBJECT

cdef extern from "<openssl/err.h>" nogil:
    void ERR_clear_error()
    unsigned long ERR_get_error()
    unsigned long ERR_peek_error()
    int ERR_GET_REASON(unsigned long e)
    void ERR_error_string_n(unsigned long e, char* buf, size_t len)

# CPython's ssl.SSLContext object starts with its OpenSSL context (checked
# against the context's own options and verify mode before it is used).
cdef extern from *:
    """
    typedef struct { PyObject_HEAD SSL_CTX *ctx; } fab_pysslcontext;
    """
    ctypedef struct fab_pysslcontext:
        SSL_CTX* ctx

cdef enum:
    EKEYREJECTED_ = 129
    GATHER = 16384
    # OpenSSL's reasons for alerts that say the peer refused a certificate
    R_BAD_CERTIFICATE = 1042            # SSL_R_SSLV3_ALERT_BAD_CERTIFICATE
    R_CERTIFICATE_UNKNOWN = 1046        # SSL_R_SSLV3_ALERT_CERTIFICATE_UNKNOWN
    R_UNKNOWN_CA = 1048                 # SSL_R_TLSV1_ALERT_UNKNOWN_CA
    R_CERTIFICATE_REQUIRED = 1116       # SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED
    R_NO_CERTIFICATE_RETURNED = 199     # SSL_R_PEER_DID_NOT_RETURN_A_CERTIFICATE                 # one TLS record's worth of small pieces, sent as one


cdef struct tls_session:
    SSL* ssl
    int handshaken
    int want_write
    int failed                     # a fatal error: no close_notify (OpenSSL forbids it then)
    char* gather


cdef void describe(SSL* ssl, const char* what, char* error, size_t error_len) noexcept nogil:
    """The reason of the last OpenSSL failure, into error."""
    cdef char text[200]
    cdef unsigned long e = ERR_get_error()
    cdef long v = SSL_get_verify_result(ssl) if ssl != NULL else X509_V_OK
    if v != X509_V_OK:
        snprintf(error, error_len, "%s: certificate verify failed: %s", what, X509_verify_cert_error_string(v))
    elif e != 0:
        ERR_error_string_n(e, text, 200)
        snprintf(error, error_len, "%s: %s", what, text)
    else:
        snprintf(error, error_len, "%s failed", what)
    ERR_clear_error()


# The session's transport: the connection's socket, written with
# MSG_NOSIGNAL. OpenSSL's own socket BIO uses write(), which raises SIGPIPE on
# a connection the peer reset; Python ignores that signal, a program that
# embeds it need not, and the signal would kill it.
cdef int sock_write(BIO* b, const char* data, int n) noexcept nogil:
    cdef ssize_t r = send(<int><intptr_t>BIO_get_data(b), data, <size_t>n, MSG_NOSIGNAL)
    BIO_clear_retry_flags(b)
    if r < 0 and (errno == EAGAIN or errno == EINTR):
        BIO_set_retry_write(b)
    return <int>r

cdef int sock_read(BIO* b, char* out, int n) noexcept nogil:
    cdef ssize_t r = recv(<int><intptr_t>BIO_get_data(b), out, <size_t>n, 0)
    BIO_clear_retry_flags(b)
    if r < 0 and (errno == EAGAIN or errno == EINTR):
        BIO_set_retry_read(b)
    elif r == 0:
        BIO_set_flags(b, BIO_FLAGS_IN_EOF)     # a peer's end, not an error (BIO_CTRL_EOF)
    return <int>r

cdef long sock_ctrl(BIO* b, int cmd, long num, void* ptr) noexcept nogil:
    if cmd == BIO_CTRL_FLUSH:
        return 1                                 # nothing is buffered here
    if cmd == BIO_CTRL_EOF:
        return 1 if BIO_test_flags(b, BIO_FLAGS_IN_EOF) else 0
    return 0

cdef int sock_create(BIO* b) noexcept nogil:
    BIO_set_init(b, 1)
    return 1

cdef int sock_destroy(BIO* b) noexcept nogil:
    return 1                   # the channel owns (and closes) the socket

cdef BIO_METHOD* socket_method():
    cdef BIO_METHOD* m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK | BIO_TYPE_DESCRIPTOR,
                                      b"fabric socket")
    if m != NULL:
        BIO_meth_set_write(m, sock_write)
        BIO_meth_set_read(m, sock_read)
        BIO_meth_set_ctrl(m, sock_ctrl)
        BIO_meth_set_create(m, sock_create)
        BIO_meth_set_destroy(m, sock_destroy)
    return m

cdef BIO_METHOD* SOCKET_METHOD = socket_method()


cdef void* tls_start(void* ssl_ctx, int fd, int server, const char* host, int check_hostname,
                     char* error, size_t error_len) noexcept nogil:
    cdef tls_session* t = <tls_session*>calloc(1, sizeof(tls_session))
    cdef unsigned char addr[16]
    cdef int is_ip = 0
    cdef BIO* bio
    if t == NULL:
        snprintf(error, error_len, "TLS: out of memory")
        return NULL
    ERR_clear_error()
    if SSL_CTX_get_keylog_callback(<SSL_CTX*>ssl_ctx) != NULL:
        # set on the SSLContext after the Fabric took it: it would call Python from our threads
        snprintf(error, error_len, "TLS: the SSLContext gained a keylog_filename after the Fabric took it")
        free(t)
        return NULL
    t.gather = <char*>malloc(GATHER)
    t.ssl = SSL_new(<SSL_CTX*>ssl_ctx)
    bio = BIO_new(SOCKET_METHOD) if SOCKET_METHOD != NULL and t.ssl != NULL else NULL
    if t.gather == NULL or bio == NULL:
        describe(t.ssl, "TLS set-up", error, error_len)
        if bio != NULL:
            BIO_free(bio)
        tls_free(t)
        return NULL
    BIO_set_data(bio, <void*><intptr_t>fd)
    SSL_set_bio(t.ssl, bio, bio)           # the session owns the BIO now
    SSL_set_mode(t.ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER)
    # Python's contexts release a session's buffers whenever they empty: a
    # malloc and a free per 16 KiB record of a large message (6% of a TLS
    # receiver's time). A session keeps them: about 34 KiB per connection.
    # (Reading ahead, 64 KiB per recv(), gained nothing measurable here.)
    SSL_clear_mode(t.ssl, SSL_MODE_RELEASE_BUFFERS)
    SSL_set_msg_callback(t.ssl, NULL)      # a _msg_callback set later on the context calls Python
    # a peer that dies without close_notify is a closed connection, not an error
    SSL_set_options(t.ssl, SSL_OP_IGNORE_UNEXPECTED_EOF)
    if server:
        SSL_set_accept_state(t.ssl)
        return t
    SSL_set_connect_state(t.ssl)
    if host != NULL and host[0] != 0:
        is_ip = inet_pton(AF_INET, host, addr) == 1 or inet_pton(AF_INET6, host, addr) == 1
        if not is_ip:
            SSL_set_tlsext_host_name(t.ssl, host)           # SNI is for names only
        if check_hostname:
            SSL_set_hostflags(t.ssl, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS | X509_CHECK_FLAG_NEVER_CHECK_SUBJECT)
            if (X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(t.ssl), host) if is_ip
                    else SSL_set1_host(t.ssl, host)) != 1:
                describe(t.ssl, "TLS host name check", error, error_len)
                tls_free(t)
                return NULL
    elif check_hostname:
        snprintf(error, error_len, "TLS: the context checks host names, and there is none to check")
        tls_free(t)
        return NULL
    return t


cdef int failure(tls_session* t, int ret, const char* what, char* error, size_t error_len) noexcept nogil:
    """Classify a non-positive OpenSSL result: 0 (wait; errno EAGAIN),
    1 (the peer ended the session), -1 (failed; errno and error set)."""
    cdef int e = SSL_get_error(t.ssl, ret)
    cdef int verified, reason, err
    if e == SSL_ERROR_WANT_READ:
        t.want_write = 0
        set_errno(EAGAIN)
        return 0
    if e == SSL_ERROR_WANT_WRITE:
        t.want_write = 1
        set_errno(EAGAIN)
        return 0
    if e == SSL_ERROR_ZERO_RETURN:
        return 1
    t.failed = 1
    if e == SSL_ERROR_SYSCALL and ERR_peek_error() == 0:
        if errno == 0:
            return 1
        err = errno                          # a reset or a broken pipe stays one (ConnectionLost)
        snprintf(error, error_len, "%s: the connection failed (errno %d)", what, err)
        set_errno(err)
        return -1
    verified = SSL_get_verify_result(t.ssl) == X509_V_OK
    reason = ERR_GET_REASON(ERR_peek_error())
    describe(t.ssl, what, error, error_len)
    # a certificate refused, ours by the peer or the peer's by us: an
    # authentication failure (AuthenticationError)
    set_errno(EKEYREJECTED_ if not verified or reason in (R_BAD_CERTIFICATE, R_CERTIFICATE_UNKNOWN, R_UNKNOWN_CA,
                                                                    R_CERTIFICATE_REQUIRED, R_NO_CERTIFICATE_RETURNED) else EPROTO)
    return -1


cdef int handshake(tls_session* t, char* error, size_t error_len) noexcept nogil:
    """1 once the handshake is through, 0 to wait (errno EAGAIN), -1 failed."""
    cdef int r, f
    if t.handshaken:
        return 1
    ERR_clear_error()
    r = SSL_do_handshake(t.ssl)
    if r == 1:
        t.handshaken = 1
        t.want_write = 0
        return 1
    f = failure(t, r, "TLS handshake", error, error_len)
    if f == 1:
        snprintf(error, error_len, "TLS handshake: the peer closed the connection (does it speak TLS?)")
        set_errno(ECONNRESET)
        return -1
    return f


cdef Py_ssize_t tls_sendv(void* tp, iovec* iov, int iovcnt, char* error, size_t error_len) noexcept nogil:
    cdef tls_session* t = <tls_session*>tp
    cdef size_t total = 0, done = 0, n
    cdef int i, r
    r = handshake(t, error, error_len)
    if r <= 0:
        return -1
    for i in range(iovcnt):
        total += iov[i].iov_len
    ERR_clear_error()
    if total <= GATHER:
        # small pieces (a header and its frames) make one record, not several
        for i in range(iovcnt):
            memcpy(t.gather + done, iov[i].iov_base, iov[i].iov_len)
            done += iov[i].iov_len
        if total == 0:
            return 0
        r = SSL_write(t.ssl, t.gather, <int>total)
        if r > 0:
            t.want_write = 0
            return r
        return wait_or_fail(t, r, 0, error, error_len)
    # A large send goes record by record (OpenSSL writes one per call in
    # partial-write mode), straight from the caller's memory. (MSG_MORE on
    # all but the last record, for larger segments, cost the sender 35% more
    # CPU per byte on loopback.)
    r = write_records(t, iov, iovcnt, total, &done, error, error_len)
    return r if r < 0 else <Py_ssize_t>done


cdef int write_records(tls_session* t, iovec* iov, int iovcnt, size_t total, size_t* done,
                       char* error, size_t error_len) noexcept nogil:
    """Write iov from its start as records; done counts the bytes taken.
    0 when all went or the socket filled after some; -1 (errno) otherwise."""
    cdef size_t n, off, took = 0
    cdef int i = 0, r
    if iov[0].iov_len < GATHER:
        # a frame header before its payload: both open one full record
        while i < iovcnt and took < GATHER:
            n = iov[i].iov_len if iov[i].iov_len < GATHER - took else GATHER - took
            memcpy(t.gather + took, iov[i].iov_base, n)
            took += n
            if n < iov[i].iov_len:
                break
            i += 1
        r = SSL_write(t.ssl, t.gather, <int>took)
        if r <= 0:
            return wait_or_fail(t, r, 0, error, error_len)
        t.want_write = 0
        done[0] = <size_t>r          # the whole gather: partial writes are per record
    while done[0] < total:
        # the iov entry and offset of byte done[0]
        off = done[0]
        i = 0
        while off >= iov[i].iov_len:
            off -= iov[i].iov_len
            i += 1
        n = iov[i].iov_len - off
        if n > 0x40000000:
            n = 0x40000000
        r = SSL_write(t.ssl, <char*>iov[i].iov_base + off, <int>n)
        if r <= 0:
            return wait_or_fail(t, r, done[0], error, error_len)
        t.want_write = 0
        done[0] += <size_t>r
    return 0


cdef int wait_or_fail(tls_session* t, int r, size_t done, char* error, size_t error_len) noexcept nogil:
    """A failed SSL_write: 0 when some bytes went and the socket is full, else -1."""
    cdef int f = failure(t, r, "TLS send", error, error_len)
    if f == 0 and done > 0:
        return 0
    if f == 1:
        set_errno(EPIPE)
    return -1


cdef Py_ssize_t tls_recv(void* tp, char* buf, size_t n, char* error, size_t error_len) noexcept nogil:
    cdef tls_session* t = <tls_session*>tp
    cdef int r, f
    r = handshake(t, error, error_len)
    if r <= 0:
        return -1
    ERR_clear_error()
    r = SSL_read(t.ssl, buf, <int>(n if n < 0x40000000 else 0x40000000))
    if r > 0:
        t.want_write = 0
        return r
    f = failure(t, r, "TLS receive", error, error_len)
    if f == 1:
        return 0
    return -1


cdef int tls_pending(void* tp) noexcept nogil:
    cdef tls_session* t = <tls_session*>tp
    return t.handshaken and SSL_pending(t.ssl) > 0


cdef int tls_want_write(void* tp) noexcept nogil:
    return (<tls_session*>tp).want_write


cdef int tls_handshaken(void* tp) noexcept nogil:
    return (<tls_session*>tp).handshaken


cdef void tls_free(void* tp) noexcept nogil:
    cdef tls_session* t = <tls_session*>tp
    if t == NULL:
        return
    if t.ssl != NULL:
        if t.handshaken and not t.failed:
            ERR_clear_error()
            SSL_shutdown(t.ssl)          # close_notify, best effort (non-blocking)
        SSL_free(t.ssl)
    ERR_clear_error()
    free(t.gather)
    free(t)


cdef void tls_ctx_free(void* ssl_ctx) noexcept nogil:
    SSL_CTX_free(<SSL_CTX*>ssl_ctx)


cdef fab_tls_ops OPS
OPS.start = tls_start
OPS.sendv = tls_sendv
OPS.recv = tls_recv
OPS.pending = tls_pending
OPS.want_write = tls_want_write
OPS.handshaken = tls_handshaken
OPS.free = tls_free
OPS.ctx_free = tls_ctx_free


def ops():
    """The session functions, for the tcp backend (a capsule)."""
    return PyCapsule_New(&OPS, b"fabric.backends.tls.ops", NULL)


def context(ctx):
    """(pointer, server, client, check_hostname) for an ssl.SSLContext: its
    OpenSSL context with a reference taken (tls_ctx_free releases it), the
    roles it can play. ValueError if fabric cannot run it from its threads."""
    import ssl
    if not isinstance(ctx, ssl.SSLContext):
        raise TypeError(f"ssl= takes ssl.SSLContext objects, not {type(ctx).__name__}")
    if ssl.OPENSSL_VERSION_NUMBER != OpenSSL_version_num():
        raise ValueError(f"Python's ssl module runs {ssl.OPENSSL_VERSION}, fabric was built against "
                         f"{OpenSSL_version(0).decode()}: their contexts cannot be shared")
    for attribute, why in (("sni_callback", "sni_callback"), ("keylog_filename", "keylog_filename"),
                           ("_msg_callback", "_msg_callback")):
        if getattr(ctx, attribute, None) is not None:
            raise ValueError(f"this SSLContext sets {why}, which would call into Python from fabric's "
                             f"own threads; use a context without it")
    cdef SSL_CTX* raw = (<fab_pysslcontext*><void*>ctx).ctx
    cdef const SSL_METHOD* method = SSL_CTX_get_ssl_method(raw) if raw != NULL else NULL
    if method != TLS_method() and method != TLS_server_method() and method != TLS_client_method():
        raise ValueError("this Python's ssl module runs another copy of OpenSSL than the one fabric "
                         "was built against (a statically linked Python?): TLS on the tcp fabric "
                         "cannot share its contexts")
    if raw == NULL or SSL_CTX_get_options(raw) != <uint64_t>int(ctx.options) \
            or SSL_CTX_get_verify_mode(raw) != {ssl.CERT_NONE: 0, ssl.CERT_OPTIONAL: 1,
                                                 ssl.CERT_REQUIRED: 3}[ctx.verify_mode]:
        raise ValueError("this Python's ssl.SSLContext is laid out differently from what fabric "
                         "expects; TLS on the tcp fabric is unavailable with it")
    SSL_CTX_up_ref(raw)
    server = ctx.protocol in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS)
    client = ctx.protocol in (ssl.PROTOCOL_TLS_CLIENT, ssl.PROTOCOL_TLS)
    return <uintptr_t>raw, server, client, bool(ctx.check_hostname)
