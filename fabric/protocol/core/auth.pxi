# Part of fabric.protocol.engine (included by engine.pyx).
#
# Peer authentication on a connection's raw socket, before the backend builds
# anything on it: no channel, memory registration, remote key, UCX worker
# address or QP number exists for a peer until it passed. Owns the endpoint
# state EP_AUTH and its auth_t record.
#
# The connecting end sends its preamble at once; the listener answers with its
# own once the connector's is in (it never speaks first: a port scan learns
# nothing). With a shared key (Fabric(auth_key=...)) both then prove they
# hold it:
#
#   preamble, 48 bytes: "FBAU" | u8 version 1 | u8 role (0 connector,
#       1 acceptor) | u8 flags (1: has a key; 2, acceptor only: at its
#       max_connections, turning this one away) | u8 0 | char[8] fabric
#       name | 32-byte nonce (getrandom)
#   MAC, 32 bytes: HMAC-SHA256(key, "fabric-auth/1" | u8 role of the sender |
#       connector's preamble | acceptor's preamble)
#
# The connector sends its MAC first; the acceptor answers with its own only
# once the connector's checked out, so a stranger never obtains a MAC from a
# listener. Fresh nonces on both ends defeat replay; the sender's role inside
# the MAC defeats reflection (an acceptor's MAC is no connector's MAC).
# MACs are compared in constant time. Without keys on both ends only the
# preambles run: they still catch a key on one end only, another fabric and
# another version, each with a clear error (the listener answers a full
# preamble even when it refuses it, so the connector can say why). A refusal
# closes the socket and tells the peer nothing more.
#
# A listener at its max_connections says so in its preamble and closes; only
# authenticated connections take a place (lifecycle.pxi), so strangers cannot
# fill it. A listener whose table of pending handshakes is full drops the oldest
# connections that have not delivered their preamble yet (lifecycle.pxi); a
# connector that loses its connection before any answer retries it (the
# listener was busy, or a slow client lost its place), within its timeout.
#
# Invariants: each side reads exactly the bytes of the stage it is in (what
# follows belongs to the channel); the acceptor's last byte is out before its
# channel sends anything; the record is wiped and freed when it ends.

cdef extern from "hmac_sha256.h" nogil:
    ctypedef struct fab_hmac_sha256:
        pass
    void fab_hmac_init(fab_hmac_sha256* m, const void* key, size_t key_len)
    void fab_hmac_update(fab_hmac_sha256* m, const void* data, size_t n)
    void fab_hmac_final(fab_hmac_sha256* m, uint8_t* out)
    int fab_equal_ct(const void* a, const void* b, size_t n)
    void fab_wipe(void* p, size_t n)

cdef enum:
    AUTH_PREAMBLE = 48
    AUTH_MAC = 32
    AUTH_VERSION = 1
    AUTH_HAS_KEY = 1
    AUTH_FULL = 2
    ROLE_CONNECTOR = 0
    ROLE_ACCEPTOR = 1
    AS_PREAMBLE = 1         # exchanging preambles
    AS_PEER_MAC = 2         # waiting for the peer's MAC
    AS_FLUSH = 3            # our last bytes go out, then the channel

cdef const char* AUTH_MAGIC = b"FBAU"
cdef const char* AUTH_LABEL = b"fabric-auth/1"


cdef ep_t* ep_create_gated(worker_t* w, int fd, int role, fab_attach* attach, lst_t* listener) noexcept nogil:
    """A new endpoint in state EP_AUTH on a connected socket (owns fd: closed
    on failure); sends our preamble. How it builds its channel afterwards:
    attach (a connector) or its listener (an acceptor)."""
    cdef ep_t* ep = ep_alloc(w)
    cdef auth_t* a
    if ep == NULL:
        close(fd)
        return NULL
    a = <auth_t*>calloc(1, sizeof(auth_t))
    if a == NULL or node_register(w, &ep.node, fd, EPOLLIN) == 0:
        free(a)
        free(ep)
        close(fd)
        return NULL
    a.started = monotonic_now()
    ep.auth = a
    ep.state = EP_AUTH
    ep.listener = listener
    ep.hs_deadline = a.started + w.opts.handshake_timeout
    ep.armed = EPOLLIN
    a.fd = fd
    a.role = role
    a.stage = AS_PREAMBLE
    if attach != NULL:
        a.attach = attach[0]
    format_peer(fd, ep.peer_name)
    memcpy(a.ours, AUTH_MAGIC, 4)
    a.ours[4] = AUTH_VERSION
    a.ours[5] = <uint8_t>role
    a.ours[6] = AUTH_HAS_KEY if w.auth_key != NULL else 0
    memcpy(a.ours + 8, w.backend_name, 8)
    if getrandom(a.ours + 16, 32, 0) != 32:
        ep_fail(ep, ENOMEM, "cannot draw a nonce for the connection preamble (getrandom failed)")
        return ep
    if role == ROLE_CONNECTOR:
        auth_queue(a, a.ours, AUTH_PREAMBLE)
    q_add(&w.dirty, &ep.dirty)
    auth_progress(ep)
    return ep

cdef void format_peer(int fd, char* out) noexcept nogil:
    cdef char local[64]
    local_and_peer_names(fd, local, out, 64)

cdef void auth_mac(worker_t* w, auth_t* a, int sender, uint8_t* out) noexcept nogil:
    cdef fab_hmac_sha256 m
    cdef uint8_t role = <uint8_t>sender
    fab_hmac_init(&m, w.auth_key, w.auth_key_len)
    fab_hmac_update(&m, AUTH_LABEL, 13)
    fab_hmac_update(&m, &role, 1)
    if a.role == ROLE_CONNECTOR:
        fab_hmac_update(&m, a.ours, AUTH_PREAMBLE)
        fab_hmac_update(&m, a.theirs, AUTH_PREAMBLE)
    else:
        fab_hmac_update(&m, a.theirs, AUTH_PREAMBLE)
        fab_hmac_update(&m, a.ours, AUTH_PREAMBLE)
    fab_hmac_final(&m, out)
    fab_wipe(&m, sizeof(m))

cdef void auth_queue(auth_t* a, const uint8_t* data, uint32_t n) noexcept nogil:
    memcpy(a.out + a.out_len, data, n)
    a.out_len += n

cdef void auth_queue_mac(worker_t* w, auth_t* a) noexcept nogil:
    auth_mac(w, a, a.role, a.out + a.out_len)
    a.out_len += AUTH_MAC

cdef int auth_check_preamble(ep_t* ep, auth_t* a) noexcept nogil:
    """0 if the peer's preamble is acceptable, else the endpoint failed."""
    cdef worker_t* w = ep.w
    cdef char why[200]
    cdef char theirs_name[9]
    cdef char ours_name[9]
    cdef int peer_has_key = a.theirs[6] & AUTH_HAS_KEY
    if a.ours[6] & AUTH_FULL:
        snprintf(why, 200, "turned away: this listener is at its connection limit (max_connections=%u)",
                 w.opts.max_connections)
        ep_fail(ep, ECONNREFUSED_, why)
        return -1
    if a.role == ROLE_CONNECTOR and a.theirs[6] & AUTH_FULL:
        ep_fail(ep, ECONNREFUSED_, "the listener turned the connection away: it is at its connection "
                                   "limit (its max_connections)")
        return -1
    if a.theirs[4] != AUTH_VERSION:
        snprintf(why, 200, "the peer speaks connection preamble version %d, this fabric version %d",
                 <int>a.theirs[4], <int>AUTH_VERSION)
        ep_fail(ep, EPROTO, why)
        return -1
    memcpy(theirs_name, a.theirs + 8, 8)
    memcpy(ours_name, a.ours + 8, 8)
    theirs_name[8] = ours_name[8] = 0
    if memcmp(theirs_name, ours_name, 8) != 0:
        snprintf(why, 200, "the peer runs the %s fabric, this end %s (both ends must use the same one)",
                 theirs_name, ours_name)
        ep_fail(ep, EPROTO, why)
        return -1
    if a.theirs[5] == a.role or fab_equal_ct(a.theirs + 16, a.ours + 16, 32):
        ep_fail(ep, EKEYREJECTED_, "authentication refused: the peer sent back our own role or "
                                   "nonce (a reflected handshake)")
        return -1
    if peer_has_key and w.auth_key == NULL:
        ep_fail(ep, EKEYREJECTED_, "authentication refused: the peer requires authentication and this "
                                   "Fabric has no key (Fabric(auth_key=...), FABRIC_AUTH_KEY or "
                                   "FABRIC_AUTH_KEY_FILE)")
        return -1
    if not peer_has_key and w.auth_key != NULL:
        ep_fail(ep, EKEYREJECTED_, "authentication refused: the peer has no key and this Fabric "
                                   "requires authentication (auth_key)")
        return -1
    return 0

cdef int auth_io(ep_t* ep, auth_t* a) noexcept nogil:
    """Move bytes as far as the socket allows: 1 if the stage's input is
    complete, 0 to wait, -1 if the endpoint failed."""
    cdef ssize_t r
    cdef uint8_t* dst
    cdef uint32_t want
    while a.out_done < a.out_len:
        r = send(a.fd, a.out + a.out_done, a.out_len - a.out_done, MSG_DONTWAIT | MSG_NOSIGNAL)
        if r < 0:
            if errno == EAGAIN or errno == EINTR:
                break
            ep_fail(ep, ECONNRESET, "the peer closed the connection during authentication")
            return -1
        a.out_done += <uint32_t>r
    if a.stage == AS_FLUSH:
        return 1 if a.out_done == a.out_len else 0
    if a.stage == AS_PREAMBLE:
        dst = a.theirs
        want = AUTH_PREAMBLE
    else:
        dst = a.mac
        want = AUTH_MAC
    while a.in_done < want:
        # only this stage's bytes: what follows belongs to the channel
        r = recv(a.fd, dst + a.in_done, want - a.in_done, MSG_DONTWAIT)
        if r < 0 and (errno == EAGAIN or errno == EINTR):
            return 0
        if r <= 0:
            if a.role == ROLE_CONNECTOR and a.stage == AS_PREAMBLE and a.in_done == 0:
                # no answer at all: a busy listener dropped us (connect retries)
                ep_fail(ep, EAGAIN, "the listener closed the connection before answering (busy, "
                                    "or not a fabric listener)")
            elif a.stage == AS_PEER_MAC and a.role == ROLE_CONNECTOR and r == 0:
                ep_fail(ep, EKEYREJECTED_, "authentication refused or dropped by the peer (it holds a "
                                           "different key, or gave up waiting for ours)")
            elif r == 0:
                ep_fail(ep, ECONNRESET, "the peer closed the connection during authentication")
            else:
                ep_fail(ep, ECONNRESET, "the connection failed during authentication")
            return -1
        a.heard += <int>r
        a.in_done += <uint32_t>r
        if a.stage == AS_PREAMBLE and a.in_done >= 4 and memcmp(a.theirs, AUTH_MAGIC, 4) != 0:
            ep_fail(ep, EPROTO, "the peer did not open with fabric's connection preamble (not a fabric "
                                "peer, or a fabric without authentication support)")
            return -1
    return 1

cdef void auth_progress(ep_t* ep) noexcept nogil:
    """Advance the authentication; once it passed, build the channel."""
    cdef auth_t* a = ep.auth
    cdef worker_t* w = ep.w
    cdef uint8_t expected[32]
    cdef int ok, rc
    while ep.state == EP_AUTH:
        rc = auth_io(ep, a)
        if rc <= 0:
            return
        if a.stage == AS_PREAMBLE:
            if a.role == ROLE_ACCEPTOR:
                listener_check_room(ep)
                # answer even a preamble we refuse: the connector then says why
                auth_queue(a, a.ours, AUTH_PREAMBLE)
                a.answered = monotonic_now()
                if auth_check_preamble(ep, a) < 0:
                    send(a.fd, a.out, a.out_len, MSG_DONTWAIT | MSG_NOSIGNAL)
                    return
            elif auth_check_preamble(ep, a) < 0:
                return
            if w.auth_key == NULL:
                a.stage = AS_FLUSH  # our preamble must be out before the channel speaks
                continue
            a.stage = AS_PEER_MAC
            a.in_done = 0
            if a.role == ROLE_CONNECTOR:
                auth_queue_mac(w, a)
        elif a.stage == AS_PEER_MAC:
            auth_mac(w, a, 1 - a.role, expected)
            ok = fab_equal_ct(expected, a.mac, AUTH_MAC)
            fab_wipe(expected, AUTH_MAC)
            if not ok:
                ep_fail(ep, EKEYREJECTED_, "authentication refused: the peer does not hold this Fabric's key")
                return
            if a.role == ROLE_CONNECTOR:
                auth_pass(ep)
                return
            a.stage = AS_FLUSH
            auth_queue_mac(w, a)
        else:
            auth_pass(ep)
            return

cdef void auth_pass(ep_t* ep) noexcept nogil:
    """Authenticated: the backend builds its channel on the socket."""
    cdef auth_t* a = ep.auth
    cdef worker_t* w = ep.w
    cdef fab_channel* ch
    cdef int fd = a.fd
    if listener_take_place(ep) < 0:
        return
    epoll_ctl(w.epfd, EPOLL_CTL_DEL, fd, NULL)
    a.fd = -1
    if ep.listener != NULL:
        ch = ep.listener.fl.attach(ep.listener.fl, fd, our_max_recv(w))
    else:
        ch = a.attach.attach(a.attach.domain, fd, our_max_recv(w), a.attach.recv_depth, a.attach.host)
    auth_free(ep)
    if ch == NULL:
        ep_fail(ep, ENOMEM, "cannot set up the channel (out of memory or descriptors)")
        return
    ep_bind_channel(ep, ch)

cdef void auth_free(ep_t* ep) noexcept nogil:
    """End the authentication (either way): close a socket still ours, wipe."""
    cdef auth_t* a = ep.auth
    if a == NULL:
        return
    if a.fd >= 0:
        epoll_ctl(ep.w.epfd, EPOLL_CTL_DEL, a.fd, NULL)
        close(a.fd)
    fab_wipe(a, sizeof(auth_t))
    free(a)
    ep.auth = NULL

cdef uint32_t auth_events(ep_t* ep) noexcept nogil:
    return EPOLLIN | (EPOLLOUT if ep.auth.out_done < ep.auth.out_len else 0)
