# cython: language_level=3
"""The UCX fabric: UCP bound directly (see ucx_shim.h for the few wrappers).

Per Fabric, one UCP context and worker (the "domain"). Connections are set up
by the TCP bootstrap (bootstrap.pyx) that exchanges worker addresses and
channel keys; the bootstrap socket stays open as a liveness monitor (UCX's
own peer-failure detection covers the rest). Fabric messages travel as UCP
active messages (always eager, whole, kept by UCX until the next poll: no
copy); the engine's rendezvous pulls run on ucp_get_nbx from regions mapped
with ucp_mem_map, whose packed rkeys travel in the engine's RNDV frames.

Waiting: the domain is the channels' hub (interface.pxd). Its fd is the UCX
worker's event fd (ucp_worker_arm), watched once per Fabric; driving the
worker routes each active message and completion to its channel's queue and
marks that channel ready. A channel's own fd is its bootstrap socket
(readable when the peer goes away), so an idle endpoint costs no CPU and a
thousand of them cost a thousand sockets, not a thousand epoll sets.

A shared-memory peer that dies while writing into this worker's receive
queue wedges it for good: UCX's FIFO is shared by every local sender, each
reserves a slot and then fills it, and the reader takes slots in order, so
a slot reserved and never filled blocks every later message from any peer.
Whenever a shared-memory connection ends, the domain sends a probe message
through that queue from a second worker of its own; a probe that does not
arrive within PROBE_WAIT, twice, means the queue is wedged. The domain then
fails every shared-memory connection on that worker (nothing they send can
arrive any more) and takes a fresh worker for new ones; connections over
UCX's network transports keep the old worker until they close. The probe
tests the queue of the transport its own endpoint takes (posix or sysv);
peers with the same UCX and UCX_TLS take the same one. The hub's fd is then
an epoll set of the workers' event fds, and the probe's deadlines go to the
engine's one timer as hub.next_deadline; a domain that cannot use
shared memory (UCX_TLS without it) has one worker for good, and its hub's fd
is that worker's own, one epoll level fewer.

Closing never waits for UCX: requests a forced ucp_ep_close cannot cancel
at once (shared memory cannot report a dead peer, so its rendezvous sends
stay pending) keep the channel as a zombie of the domain until they complete
or the domain goes.

Bootstrap message, each way, little-endian:
    "FUCX" | u16 version 3 | u16 flags | u64 channel key | u32 address length
    | 32-byte host identity | address
flags bit 0: this side can use UCX's peer-failure error handling; bit 1: it
offers mode NONE to a peer of the same host identity (shared memory). Both
endpoints of a connection must use the same error-handling mode (UCX refuses
"asymmetric endpoint configuration"), so each side takes PEER only if both
offer it; a side whose transports cannot (shared memory only) offers NONE.
"""
import os

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcmp, memcpy, memset
from posix.uio cimport iovec
from posix.unistd cimport getpid as c_getpid

from fabric._posix cimport *
from fabric._bytes cimport wr16, wr32, wr64, rd16, rd32, rd64
from fabric.backends.interface cimport *
from fabric.backends.bootstrap cimport *
from fabric.backends.sockets cimport peer_on_this_host

cdef extern from "ucx_shim.h" nogil:
    ctypedef int ucs_status_t
    ctypedef void* ucs_status_ptr_t
    ctypedef struct ucp_context:
        pass
    ctypedef struct ucp_worker:
        pass
    ctypedef struct ucp_ep:
        pass
    ctypedef struct ucp_mem:
        pass
    ctypedef struct ucp_rkey:
        pass
    ctypedef struct ucp_address_t:
        pass
    ctypedef ucp_context* ucp_context_h
    ctypedef ucp_worker* ucp_worker_h
    ctypedef ucp_ep* ucp_ep_h
    ctypedef ucp_mem* ucp_mem_h
    ctypedef ucp_rkey* ucp_rkey_h
    ctypedef struct ucp_dt_iov_t:
        void* buffer
        size_t length
    ctypedef struct ucp_am_recv_param_t:
        uint64_t recv_attr
    ctypedef ucs_status_t (*ucp_am_recv_callback_t)(void* arg, const void* header, size_t header_length,
                                                    void* data, size_t length,
                                                    const ucp_am_recv_param_t* param) noexcept nogil
    ctypedef void (*ucp_send_nbx_callback_t)(void* request, ucs_status_t status, void* user_data) noexcept nogil
    ctypedef void (*ucp_err_handler_cb_t)(void* arg, ucp_ep_h ep, ucs_status_t status) noexcept nogil
    ctypedef void (*ucp_am_recv_data_nbx_callback_t)(void* request, ucs_status_t status, size_t length,
                                                     void* user_data) noexcept nogil
    enum:
        UCS_OK
        UCS_INPROGRESS
        UCS_ERR_BUSY
        UCP_AM_RECV_ATTR_FLAG_DATA
        UCP_AM_RECV_ATTR_FLAG_RNDV

    unsigned fab_ucx_api_version()
    unsigned fab_ucx_runtime_version()
    ucs_status_t fab_ucx_init(ucp_context_h* context)
    ucs_status_t fab_ucx_worker_create(ucp_context_h context, ucp_worker_h* worker)
    ucs_status_t fab_ucx_set_am_handler(ucp_worker_h worker, ucp_am_recv_callback_t cb, void* arg)
    ucs_status_t fab_ucx_ep_create(ucp_worker_h worker, const ucp_address_t* address, int peer_errors,
                                   ucp_err_handler_cb_t on_error, void* arg, ucp_ep_h* ep)
    ucs_status_ptr_t fab_ucx_ep_close(ucp_ep_h ep, int force)
    ucs_status_ptr_t fab_ucx_am_send(ucp_ep_h ep, const void* header, size_t header_length,
                                     const ucp_dt_iov_t* iov, size_t iovcnt,
                                     ucp_send_nbx_callback_t cb, void* user_data)
    ucs_status_ptr_t fab_ucx_am_send_large(ucp_ep_h ep, const void* header, size_t header_length,
                                           void* buffer, size_t length, ucp_send_nbx_callback_t cb,
                                           void* user_data)
    ucs_status_ptr_t fab_ucx_am_recv_data(ucp_worker_h worker, void* desc, void* buffer, size_t length,
                                          ucp_am_recv_data_nbx_callback_t cb, void* user_data)
    ucs_status_ptr_t fab_ucx_get(ucp_ep_h ep, void* dst, size_t length, uint64_t raddr,
                                 ucp_rkey_h rkey, ucp_send_nbx_callback_t cb, void* user_data)
    ucs_status_ptr_t fab_ucx_put(ucp_ep_h ep, const void* src, size_t length, uint64_t raddr,
                                 ucp_rkey_h rkey, ucp_send_nbx_callback_t cb, void* user_data)
    ucs_status_t fab_ucx_mem_map(ucp_context_h context, void* address, size_t length, ucp_mem_h* memh)
    int fab_ucx_is_ptr(ucs_status_ptr_t p)
    int fab_ucx_is_err(ucs_status_ptr_t p)
    ucs_status_t fab_ucx_status(ucs_status_ptr_t p)

    unsigned ucp_worker_progress(ucp_worker_h worker)
    ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int* fd)
    ucs_status_t ucp_worker_arm(ucp_worker_h worker)
    ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t** address, size_t* length)
    void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t* address)
    void ucp_worker_destroy(ucp_worker_h worker)
    void ucp_cleanup(ucp_context_h context)
    void ucp_request_free(void* request)
    ucs_status_t ucp_request_check_status(void* request)
    ucs_status_t ucp_rkey_pack(ucp_context_h context, ucp_mem_h memh, void** rkey_buffer, size_t* size)
    void ucp_rkey_buffer_release(void* rkey_buffer)
    ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void* rkey_buffer, ucp_rkey_h* rkey)
    void ucp_rkey_destroy(ucp_rkey_h rkey)
    ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh)
    void ucp_am_data_release(ucp_worker_h worker, void* data)
    const char* ucs_status_string(ucs_status_t status)

cdef double CLOSE_GRACE = 0.02    # seconds close() lets a live peer's cancellations complete
cdef double ZOMBIE_GRACE = 0.5    # seconds a closing domain lets UCX complete what it still holds
# How long a probe of the shared-memory receive queue may take, each of two
# tries (a live sender fills its slot within microseconds once it runs, but
# a loaded 2-core host can deschedule it mid-write for a while).
cdef double PROBE_WAIT = 1.0
# A probe goes this long after a shared-memory connection ended, so that the
# ends of many connections (a pool closing, a storm) share one.
cdef double PROBE_BATCH = 0.05
# A second probe this long after the last shared-memory connection ended:
# its peer may die while still sending after our side closed.
cdef double PROBE_AGAIN = 1.0
cdef const char* WEDGED = (b"UCX shared-memory receive queue blocked for good: a local peer died mid-send "
                           b"(a UCX limitation); reconnect (the Fabric uses a fresh queue)")

cdef enum:
    BOOT_MAGIC = 0x58435546      # "FUCX"
    BOOT_VERSION = 3
    BOOT_HOST = 20               # offset of the host identity (HOST_ID bytes)
    HOST_ID = 32
    BOOT_FIXED = BOOT_HOST + HOST_ID
    BOOT_PEER_ERRORS = 1         # bootstrap flag: PEER error handling offered
    BOOT_LOCAL_NONE = 2          # flag: offers error mode NONE to a peer on this host
    BOOT_SOCKET_LOCAL = 4        # flag: its socket says the peer is on this host
    MAX_ADDRESS = 65536
    ST_BOOT = 1
    ST_READY = 2
    R_SEND = 1
    R_GET = 2
    R_PUT = 3
    R_LARGE_SEND = 4
    R_LARGE_RECV = 5
    EIO_ = 5
    ECONNREFUSED_ = 111

# The version this module was compiled against; refuse a different runtime
# (libucp.so.0 is the soname of both the wheel and Debian's UCX).
BUILT_API = fab_ucx_api_version()


cdef struct ucx_event:
    int kind
    int status
    uint64_t ctx
    char* data
    size_t length
    int am_data          # data is UCX's (release with ucp_am_data_release), else NULL

cdef struct ucx_large:
    # a native large chunk: arrived (desc set) and/or awaited (dst set)
    ucx_large* next
    uint64_t tag
    void* desc                 # UCX's rendezvous descriptor, or its persistent data
    int is_data                # desc is data (UCX chose eager), not a rendezvous descriptor
    size_t length
    char* dst
    size_t dst_length
    uint64_t ctx
    int waiting

cdef struct ucx_deferred:
    boot_deferred link   # first: queued by the bootstrap until the endpoint exists
    int iovcnt
    ucp_dt_iov_t iov[1]  # iovcnt entries

cdef struct ucx_wk:
    # a UCP worker of the domain: the current one, or one found wedged whose
    # channels over network transports still run on it
    ucp_worker_h worker
    int efd
    int users            # channels made on it, plus one while it is the domain's current worker
    int wedged           # its shared-memory receive queue is blocked for good
    ucx_wk* next

cdef struct ucx_domain:
    fab_hub hub          # first: the engine's view of the domain (fd, progress, arm)
    ucp_context_h context
    ucx_wk* cur          # the worker new channels use (NULL: none could be made)
    ucx_wk* workers      # all of them, cur included
    int epfd             # the hub's fd: the workers' event fds and the timer (-1: not sm_possible)
    int sm_possible      # connections may use shared memory (and can wedge the queue)
    # the probe of cur's shared-memory receive queue (see the module doc)
    ucp_worker_h probe_worker
    ucp_ep_h probe_ep
    void* probe_req
    char probe_key[8]    # channel key 0: no channel has it
    uint64_t probe_seq   # the last probe sent (and how many were)
    uint64_t probe_seen  # the last probe that arrived
    double probe_deadline  # 0: none outstanding
    int probe_tries      # deadlines the outstanding probe has missed
    double probe_at      # send one at (or once none is outstanding after) this time; 0: none wanted
    double probe_again_at  # 0: no follow-up planned
    ucp_dt_iov_t probe_iov
    char probe_buf[8]    # the probe's sequence number
    double timer_at      # when the probe needs the hub progressed (hub.next_deadline; 0: not set)
    uint64_t wedges      # workers found wedged
    int peer_errors      # can ask UCX for peer-failure reports (not on shared memory only)
    int local_none       # offers error mode NONE (shared memory) to peers on this host
    char host_id[HOST_ID]  # equal on both sides: same boot, namespaces and user
    int refs
    ucx_chan** chans     # channel table, for routing active messages
    uint32_t* gens
    uint32_t nchans
    ucx_chan* zombies    # closed channels whose requests UCX still holds
    int closing          # the Fabric closes it: stop at nothing
    uint64_t eps_open    # UCP endpoints created and not yet handed back (leak checks)
    uint64_t ep_close_errors  # ucp_ep_close_nbx refusals (each leaves an endpoint behind)

cdef struct ucx_chan:
    fab_channel base
    ucx_domain* dom
    ucx_wk* wk                 # the worker its endpoint lives on
    int probe_noted            # its end has asked for a probe of the receive queue
    uint64_t key
    uint64_t peer_key
    ucp_ep_h ep
    int state
    fab_boot boot              # the bootstrap socket, then the liveness monitor
    int ep_failed
    int ep_peer_mode           # the UCP endpoint was made with error mode PEER
    # completions
    ucx_event* q
    uint32_t qcap
    uint32_t qhead
    uint32_t qcount
    ucx_event* handed          # RECV data handed out by the last poll, released at the next
    uint32_t nhanded
    uint32_t handed_cap
    ucx_req* reqs              # UCX requests that still reference this channel
    int closed                 # closed by the engine; freed once reqs is empty
    void* close_req            # the ucp_ep_close, while UCX completes it
    ucx_chan* zombie_next
    ucx_chan* zombie_prev
    int is_zombie
    int released               # ucx_close released everything but what UCX may still name
    fab_regnode* mrs
    ucx_large* large           # native chunks arrived or awaited

cdef struct ucx_req:
    ucx_chan* ch
    ucx_req* prev              # the channel's in-flight list
    ucx_req* next
    void* sp                   # UCX's request handle
    int kind
    uint64_t ctx
    ucp_rkey_h rkey
    char header[16]            # lives until completion (UCX < 1.14 reads it late)
    int iovcnt
    ucp_dt_iov_t iov[1]

cdef fab_channel_ops UCX_OPS
UCX_OPS.send = ucx_send
UCX_OPS.reg = ucx_reg
UCX_OPS.dereg = ucx_dereg
UCX_OPS.read = ucx_read
UCX_OPS.write = NULL
UCX_OPS.send_large = ucx_send_large
UCX_OPS.recv_large = ucx_recv_large
UCX_OPS.cancel_read = ucx_cancel_read
UCX_OPS.poll = ucx_poll
UCX_OPS.arm = ucx_arm
UCX_OPS.close = ucx_close
UCX_OPS.recycle = NULL


# ------------------------------------------------------------------ domain

cdef void domain_unref(ucx_domain* d) noexcept nogil:
    cdef ucx_wk* wk
    if domain_unref_last(&d.refs):
        probe_close(d)
        while d.workers != NULL:
            wk = d.workers
            d.workers = wk.next
            ucp_worker_destroy(wk.worker)
            free(wk)
        if d.context != NULL:
            ucp_cleanup(d.context)
        if d.epfd >= 0:
            close(d.epfd)
        free(d.chans)
        free(d.gens)
        free(d)

cdef ucx_wk* wk_open(ucx_domain* d) noexcept nogil:
    """A new worker for the domain, watched by its hub; NULL if UCX refuses."""
    cdef ucx_wk* wk = <ucx_wk*>calloc(1, sizeof(ucx_wk))
    cdef epoll_event ev
    if wk == NULL:
        return NULL
    if fab_ucx_worker_create(d.context, &wk.worker) != UCS_OK:
        free(wk)
        return NULL
    memset(&ev, 0, sizeof(ev))
    ev.events = EPOLLIN
    if (ucp_worker_get_efd(wk.worker, &wk.efd) != UCS_OK
            or fab_ucx_set_am_handler(wk.worker, on_am, d) != UCS_OK
            or (d.epfd >= 0 and epoll_ctl(d.epfd, EPOLL_CTL_ADD, wk.efd, &ev) < 0)):
        ucp_worker_destroy(wk.worker)
        free(wk)
        return NULL
    wk.users = 1
    wk.next = d.workers
    d.workers = wk
    return wk

cdef void reap_workers(ucx_domain* d) noexcept nogil:
    """Destroy the wedged workers no channel uses any more (never from inside
    their own progress, where a channel may be freed)."""
    cdef ucx_wk** p = &d.workers
    cdef ucx_wk* wk
    while p[0] != NULL:
        wk = p[0]
        if wk.users == 0:
            p[0] = wk.next
            epoll_ctl(d.epfd, EPOLL_CTL_DEL, wk.efd, NULL)
            ucp_worker_destroy(wk.worker)
            free(wk)
        else:
            p = &wk.next

cdef uint64_t domain_add(ucx_domain* d, ucx_chan* ch) noexcept nogil:
    cdef uint32_t i, n
    cdef ucx_chan** grown
    cdef uint32_t* ggens
    for i in range(d.nchans):
        if d.chans[i] == NULL:
            break
    else:
        n = d.nchans * 2 if d.nchans else 16
        grown = <ucx_chan**>realloc(d.chans, n * sizeof(ucx_chan*))
        if grown == NULL:
            return 0
        d.chans = grown
        ggens = <uint32_t*>realloc(d.gens, n * sizeof(uint32_t))
        if ggens == NULL:
            return 0
        d.gens = ggens
        for i in range(d.nchans, n):
            d.chans[i] = NULL
            d.gens[i] = 0
        i = d.nchans
        d.nchans = n
    d.gens[i] += 1
    d.chans[i] = ch
    return (<uint64_t>d.gens[i] << 32) | i

cdef ucx_chan* domain_find(ucx_domain* d, uint64_t key) noexcept nogil:
    cdef uint32_t slot = <uint32_t>(key & 0xFFFFFFFFU)
    if slot >= d.nchans or d.chans[slot] == NULL or d.chans[slot].key != key:
        return NULL
    return d.chans[slot]


# ------------------------------------------------ the receive-queue probe

cdef void timer_set(ucx_domain* d, double at) noexcept nogil:
    """Have the hub progressed at `at` (monotonic seconds) unless it already
    will be by then: the engine's one timer honours hub.next_deadline."""
    cdef double now
    if d.timer_at != 0 and d.timer_at <= at:
        return
    now = monotonic_now()
    if at <= now:
        at = now
    d.timer_at = at
    d.hub.next_deadline = at

cdef void probe_after_end(ucx_chan* ch) noexcept nogil:
    """The channel ended (its peer went away, or it closes): if it may have
    used shared memory, probe the receive queue soon, and once more a little
    later (a local peer may have died mid-write)."""
    cdef ucx_domain* d = ch.dom
    cdef double now
    if ch.probe_noted or ch.ep_peer_mode:
        return
    ch.probe_noted = 1
    if not d.sm_possible or d.closing or d.cur == NULL:
        return
    now = monotonic_now()
    if d.probe_at == 0:
        d.probe_at = now + PROBE_BATCH
        timer_set(d, d.probe_at)
    d.probe_again_at = now + PROBE_AGAIN

cdef void on_probe_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) noexcept nogil:
    pass

cdef void on_probe_sent(void* request, ucs_status_t status, void* user_data) noexcept nogil:
    cdef ucx_domain* d = <ucx_domain*>user_data
    if d.probe_req == request:
        d.probe_req = NULL
    ucp_request_free(request)

cdef void probe_close(ucx_domain* d) noexcept nogil:
    cdef void* req = d.probe_req
    d.probe_req = NULL
    if req != NULL:
        ucp_request_free(req)           # no callback follows
    if d.probe_worker != NULL:
        ucp_worker_destroy(d.probe_worker)   # and its endpoint
    d.probe_worker = NULL
    d.probe_ep = NULL

cdef int probe_open(ucx_domain* d) noexcept nogil:
    """The probe's own worker and its endpoint to the current worker: the
    same transports a local peer's endpoint takes (error mode NONE)."""
    cdef ucp_address_t* address
    cdef size_t alen
    cdef ucs_status_t st
    if fab_ucx_worker_create(d.context, &d.probe_worker) != UCS_OK:
        d.probe_worker = NULL
        return -1
    if ucp_worker_get_address(d.cur.worker, &address, &alen) != UCS_OK:
        probe_close(d)
        return -1
    st = fab_ucx_ep_create(d.probe_worker, address, 0, on_probe_ep_error, d, &d.probe_ep)
    ucp_worker_release_address(d.cur.worker, address)
    if st != UCS_OK:
        d.probe_ep = NULL
        probe_close(d)
        return -1
    return 0

cdef void probe_send(ucx_domain* d, double now) noexcept nogil:
    cdef ucs_status_ptr_t sp
    d.probe_at = 0
    if d.probe_worker == NULL and probe_open(d) < 0:
        return                          # cannot probe: no worse than before
    if d.probe_req != NULL:
        # the last probe arrived before UCX reported its send complete
        ucp_request_free(d.probe_req)   # no callback follows
        d.probe_req = NULL
    d.probe_seq += 1
    wr64(d.probe_buf, d.probe_seq)
    d.probe_iov.buffer = d.probe_buf
    d.probe_iov.length = 8
    sp = fab_ucx_am_send(d.probe_ep, d.probe_key, 8, &d.probe_iov, 1, on_probe_sent, d)
    if fab_ucx_is_err(sp):
        d.probe_seq -= 1
        probe_close(d)
        return
    if sp != NULL:
        d.probe_req = sp
    d.probe_deadline = now + PROBE_WAIT
    d.probe_tries = 0

cdef void probe_arrived(ucx_domain* d, const void* data, size_t length) noexcept nogil:
    cdef uint64_t seq
    if length == 8:
        seq = rd64(<const char*>data)
        if seq > d.probe_seen and seq <= d.probe_seq:
            d.probe_seen = seq

cdef void queue_wedged(ucx_domain* d) noexcept nogil:
    """The current worker's shared-memory receive queue is blocked for good:
    fail the channels that depend on it and take a fresh worker."""
    cdef ucx_wk* old = d.cur
    cdef ucx_chan* ch
    cdef uint32_t i
    d.wedges += 1
    old.wedged = 1
    probe_close(d)
    d.probe_deadline = 0
    d.probe_at = 0
    d.probe_again_at = 0
    d.cur = wk_open(d)                  # NULL: new channels are refused until one can be made
    old.users -= 1
    for i in range(d.nchans):
        ch = d.chans[i]
        if (ch != NULL and ch.wk == old and ch.state == ST_READY and not ch.ep_peer_mode
                and not ch.closed and not ch.base.failed):
            fail_ready(ch, ECONNRESET, WEDGED)

cdef void probe_tick(ucx_domain* d) noexcept nogil:
    """Run from the hub's progress: see whether the outstanding probe
    arrived, declare the queue wedged if it missed its deadline twice, send
    the next probe when one is wanted, and set the timer for what is next."""
    cdef double now, at
    cdef int i
    cdef unsigned moved
    if d.timer_at == 0 and d.probe_deadline == 0 and d.probe_at == 0 and d.probe_again_at == 0:
        return
    now = monotonic_now()
    if d.timer_at != 0 and now >= d.timer_at:
        d.timer_at = 0                  # due: what is next sets it again below
        d.hub.next_deadline = 0
    if d.probe_deadline == 0 and d.probe_at == 0 and d.probe_again_at == 0:
        return
    if d.probe_worker != NULL:
        ucp_worker_progress(d.probe_worker)
    if d.probe_deadline != 0 and d.probe_seen < d.probe_seq and now >= d.probe_deadline:
        # take in what the queue holds before calling it late
        for i in range(4096):
            moved = ucp_worker_progress(d.cur.worker)
            if d.probe_worker != NULL:
                moved += ucp_worker_progress(d.probe_worker)
            if d.probe_seen >= d.probe_seq or moved == 0:
                break
        if d.probe_seen < d.probe_seq:
            d.probe_tries += 1
            if d.probe_tries >= 2:
                queue_wedged(d)
                return
            d.probe_deadline = now + PROBE_WAIT
    if d.probe_deadline != 0 and d.probe_seen >= d.probe_seq:
        d.probe_deadline = 0
    if d.probe_deadline == 0:
        if d.probe_again_at != 0 and now >= d.probe_again_at:
            d.probe_again_at = 0
            if d.probe_at == 0:
                d.probe_at = now
        if d.probe_at != 0 and now >= d.probe_at:
            probe_send(d, now)
    if d.probe_deadline != 0:
        at = d.probe_deadline           # the others wait for its verdict
    else:
        at = d.probe_at
        if at == 0 or (d.probe_again_at != 0 and d.probe_again_at < at):
            at = d.probe_again_at
    if at != 0:
        timer_set(d, at)


cdef class UcxDomain:
    """One UCP context and its workers, kept alive by its Fabric."""
    cdef ucx_domain* d
    cdef int pid

    def __dealloc__(self):
        self.close()

    def close(self):
        """The Fabric is closing (its channels and listeners are closed):
        give up on requests zombie channels still wait for and release the
        context once nothing else holds it. Idempotent. In a forked child it
        only forgets the parent's context (UCX cannot run there)."""
        cdef ucx_domain* d = self.d
        if d == NULL:
            return
        if self.pid != c_getpid():
            self.d = NULL
            return
        self.d = NULL
        with nogil:
            d.closing = 1
            destroy_zombies(d)
            domain_unref(d)

    @property
    def refs(self):
        """References held on the domain: its Fabric's, one per live channel
        and listener (leak and race checks)."""
        return self.d.refs if self.d != NULL else 0

    @property
    def queue_probes(self):
        """(probes of the shared-memory receive queue sent, workers found
        wedged and replaced) since the Fabric opened."""
        if self.d == NULL:
            return (0, 0)
        return (self.d.probe_seq, self.d.wedges)

    @property
    def endpoints(self):
        """(UCP endpoints open, ucp_ep_close refusals so far): leak checks."""
        if self.d == NULL:
            return (0, 0)
        return (self.d.eps_open, self.d.ep_close_errors)


# ------------------------------------------------------------ completions

cdef int push_event(ucx_chan* ch, int kind, int status, uint64_t ctx, char* data, size_t length,
                    int am_data) noexcept nogil:
    cdef ucx_event* grown
    cdef uint32_t n, i
    if ch.qcount == ch.qcap:
        n = ch.qcap * 2 if ch.qcap else 64
        grown = <ucx_event*>malloc(n * sizeof(ucx_event))
        if grown == NULL:
            fail_ready(ch, ENOMEM, "completion queue")
            return -1
        for i in range(ch.qcount):
            grown[i] = ch.q[(ch.qhead + i) % ch.qcap]
        free(ch.q)
        ch.q = grown
        ch.qcap = n
        ch.qhead = 0
    i = (ch.qhead + ch.qcount) % ch.qcap
    ch.q[i].kind = kind
    ch.q[i].status = status
    ch.q[i].ctx = ctx
    ch.q[i].data = data
    ch.q[i].length = length
    ch.q[i].am_data = am_data
    ch.qcount += 1
    if not ch.closed:
        hub_mark_ready(&ch.dom.hub, &ch.base)
    return 0

cdef void release_data(ucx_chan* ch, ucx_event* ev) noexcept nogil:
    if ev.data != NULL:
        if ev.am_data:
            ucp_am_data_release(ch.wk.worker, ev.data)
        else:
            free(ev.data)
        ev.data = NULL

cdef void req_track(ucx_chan* ch, ucx_req* r, void* sp) noexcept nogil:
    r.sp = sp
    r.prev = NULL
    r.next = ch.reqs
    if ch.reqs != NULL:
        ch.reqs.prev = r
    ch.reqs = r

cdef void req_untrack(ucx_chan* ch, ucx_req* r) noexcept nogil:
    if r.prev != NULL:
        r.prev.next = r.next
    else:
        ch.reqs = r.next
    if r.next != NULL:
        r.next.prev = r.prev
    r.prev = r.next = NULL

cdef int fail_ready(ucx_chan* ch, int err, const char* what) noexcept nogil:
    """fab_fail, and make the engine poll the channel to learn of it."""
    cdef int rc = fab_fail(&ch.base, err, what)
    if not ch.closed:
        hub_mark_ready(&ch.dom.hub, &ch.base)
    return rc

cdef int close_pending(ucx_chan* ch) noexcept nogil:
    """1 while UCX still completes the channel's forced ucp_ep_close."""
    if ch.close_req == NULL:
        return 0
    if ucp_request_check_status(ch.close_req) == UCS_INPROGRESS:
        return 1
    ucp_request_free(ch.close_req)
    ch.close_req = NULL
    return 0

cdef void close_endpoint(ucx_chan* ch) noexcept nogil:
    """Hand the UCP endpoint back to UCX. PEER mode: forced, which cancels
    what is outstanding. NONE mode cannot be forced (UCX refuses with
    INVALID_PARAM and the endpoint would live until the worker goes): it is
    flushed locally."""
    cdef ucs_status_ptr_t sp
    if ch.ep == NULL:
        return
    sp = fab_ucx_ep_close(ch.ep, 1 if ch.ep_peer_mode else 0)
    if fab_ucx_is_ptr(sp):
        ch.close_req = sp
    elif fab_ucx_status(sp) != UCS_OK:
        ch.dom.ep_close_errors += 1
    ch.dom.eps_open -= 1
    ch.ep = NULL

cdef void maybe_free_channel(ucx_chan* ch) noexcept nogil:
    """A closed channel goes once UCX no longer holds requests naming it."""
    cdef uint32_t i
    cdef ucx_domain* d = ch.dom
    if not ch.closed or not ch.released or ch.reqs != NULL or close_pending(ch):
        return
    if ch.is_zombie:
        if ch.zombie_prev != NULL:
            ch.zombie_prev.zombie_next = ch.zombie_next
        else:
            d.zombies = ch.zombie_next
        if ch.zombie_next != NULL:
            ch.zombie_next.zombie_prev = ch.zombie_prev
    for i in range(ch.qcount):
        release_data(ch, &ch.q[(ch.qhead + i) % ch.qcap])
    free(ch.q)
    free(ch.handed)
    ch.wk.users -= 1              # a wedged worker goes once unused (reap_workers)
    free(ch)
    domain_unref(d)

cdef void sweep_zombies(ucx_domain* d) noexcept nogil:
    cdef ucx_chan* ch = d.zombies
    cdef ucx_chan* nxt
    while ch != NULL:
        nxt = ch.zombie_next
        maybe_free_channel(ch)
        ch = nxt

cdef void destroy_zombies(ucx_domain* d) noexcept nogil:
    """The domain goes: let UCX complete what the zombies' forced closes
    cancelled (a few progress rounds, ZOMBIE_GRACE at most), then hand every
    request still held back to UCX (no callback follows) and free the
    channels. Destroying a worker under cancelled rendezvous sends it had
    not yet completed corrupted the heap (UCX 1.22, tcp: their registration
    cache regions outlived them), in a third of the runs of a rank that
    closed right after a peer gave up on its sends."""
    cdef ucx_chan* ch
    cdef ucx_req* r
    cdef ucx_wk* wk
    cdef double deadline = monotonic_now() + ZOMBIE_GRACE
    while d.zombies != NULL and monotonic_now() < deadline:
        wk = d.workers
        while wk != NULL:
            ucp_worker_progress(wk.worker)
            wk = wk.next
        sweep_zombies(d)
    while d.zombies != NULL:
        ch = d.zombies
        while ch.reqs != NULL:
            r = ch.reqs
            req_untrack(ch, r)
            if r.rkey != NULL:
                ucp_rkey_destroy(r.rkey)
            ucp_request_free(r.sp)
            free(r)
        if ch.close_req != NULL:
            ucp_request_free(ch.close_req)
            ch.close_req = NULL
        maybe_free_channel(ch)

cdef int ucx_hub_progress(fab_hub* hub) noexcept nogil:
    cdef ucx_domain* d = <ucx_domain*>hub
    cdef int rounds = 0, r
    cdef ucx_wk* wk = d.workers
    while wk != NULL:
        r = 0
        while r < 64 and ucp_worker_progress(wk.worker) != 0:
            r += 1
        rounds += r
        wk = wk.next
    if rounds:
        hub.activity += 1
    if d.zombies != NULL:
        sweep_zombies(d)
    if d.sm_possible:
        probe_tick(d)
        if d.wedges:
            reap_workers(d)
    return rounds

cdef int ucx_hub_arm(fab_hub* hub) noexcept nogil:
    cdef ucx_domain* d = <ucx_domain*>hub
    cdef ucx_wk* wk = d.workers
    cdef int busy = 0
    while wk != NULL:
        if ucp_worker_arm(wk.worker) == UCS_ERR_BUSY:
            busy = 1
        wk = wk.next
    return busy

cdef void on_request_done(void* request, ucs_status_t status, void* user_data) noexcept nogil:
    """Completion of a send or a get (runs inside ucp_worker_progress)."""
    cdef ucx_req* r = <ucx_req*>user_data
    cdef ucx_chan* ch = r.ch
    if r.rkey != NULL:
        ucp_rkey_destroy(r.rkey)
    req_untrack(ch, r)
    if not ch.closed:
        if r.kind == R_SEND or r.kind == R_LARGE_SEND:
            if status != UCS_OK:
                fail_ready(ch, ECONNRESET, ucs_status_string(status))
            push_event(ch, FAB_EV_SEND, 0, r.ctx, NULL, 0, 0)
        else:
            push_event(ch, FAB_EV_READ, 0 if status == UCS_OK else -13, r.ctx, NULL, 0, 0)
    if request != NULL:
        ucp_request_free(request)
    free(r)
    maybe_free_channel(ch)

cdef void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) noexcept nogil:
    cdef ucx_chan* ch = <ucx_chan*>arg
    ch.ep_failed = 1
    if not ch.closed:
        fail_ready(ch, ECONNRESET, ucs_status_string(status))

cdef ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data,
                        size_t length, const ucp_am_recv_param_t* param) noexcept nogil:
    """An arriving fabric message: route it by the channel key in its header
    and keep UCX's buffer until the engine has consumed it."""
    cdef ucx_domain* d = <ucx_domain*>arg
    cdef ucx_chan* ch
    cdef char* copy
    if header_length != 8 and header_length != 16:
        return UCS_OK
    if header_length == 8 and rd64(<const char*>header) == 0:
        probe_arrived(d, data, length)  # the domain's own probe (no channel has key 0)
        return UCS_OK
    ch = domain_find(d, rd64(<const char*>header))
    if ch == NULL or ch.closed or ch.base.failed:
        return UCS_OK           # a message for a channel that is gone
    if header_length == 16:
        return large_arrived(ch, rd64(<const char*>header + 8), data, length, param.recv_attr)
    if length > ch.base.max_recv:
        fail_ready(ch, EPROTO, "peer sent a fabric message larger than this endpoint accepts")
        return UCS_OK
    if param.recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA:
        if push_event(ch, FAB_EV_RECV, 0, 0, <char*>data, length, 1) < 0:
            return UCS_OK
        return UCS_INPROGRESS
    copy = <char*>malloc(length if length else 1)
    if copy == NULL:
        fail_ready(ch, ENOMEM, "receive")
        return UCS_OK
    memcpy(copy, data, length)
    push_event(ch, FAB_EV_RECV, 0, 0, copy, length, 0)
    return UCS_OK


# --------------------------------------------------------------- bootstrap

cdef int post_am(ucx_chan* ch, ucp_dt_iov_t* iov, int iovcnt, uint64_t ctx, int deferred) noexcept nogil:
    cdef ucx_req* r = <ucx_req*>malloc(sizeof(ucx_req) + iovcnt * sizeof(ucp_dt_iov_t))
    cdef ucs_status_ptr_t sp
    if r == NULL:
        return fail_ready(ch, ENOMEM, "send")
    r.ch = ch
    r.kind = R_SEND
    r.ctx = ctx
    r.rkey = NULL
    r.iovcnt = iovcnt
    memcpy(r.iov, iov, iovcnt * sizeof(ucp_dt_iov_t))
    sp = fab_ucx_am_send(ch.ep, &ch.peer_key, 8, r.iov, iovcnt, on_request_done, r)
    if sp == NULL:
        free(r)
        if deferred:        # the engine was told FAB_PENDING: report completion
            push_event(ch, FAB_EV_SEND, 0, ctx, NULL, 0, 0)
        return FAB_DONE
    if fab_ucx_is_err(sp):
        free(r)
        return fail_ready(ch, ECONNRESET, ucs_status_string(fab_ucx_status(sp)))
    req_track(ch, r, sp)
    return FAB_PENDING

cdef int boot_make(ucx_chan* ch) noexcept nogil:
    cdef ucp_address_t* address
    cdef size_t alen
    cdef char* out
    if ucp_worker_get_address(ch.wk.worker, &address, &alen) != UCS_OK:
        return fail_ready(ch, EIO_, "ucp_worker_get_address failed")
    out = boot_message(&ch.boot, &ch.base, BOOT_FIXED + alen)
    if out == NULL:
        ucp_worker_release_address(ch.wk.worker, address)
        return fail_ready(ch, ENOMEM, "bootstrap")
    wr32(out, BOOT_MAGIC)
    wr16(out + 4, BOOT_VERSION)
    wr16(out + 6, (BOOT_PEER_ERRORS if ch.dom.peer_errors else 0)
                  | (BOOT_LOCAL_NONE if ch.dom.local_none else 0)
                  | (BOOT_SOCKET_LOCAL if peer_on_this_host(ch.boot.sock) else 0))
    wr64(out + 8, ch.key)
    wr32(out + 16, <uint32_t>alen)
    memcpy(out + BOOT_HOST, ch.dom.host_id, HOST_ID)
    memcpy(out + BOOT_FIXED, address, alen)
    ucp_worker_release_address(ch.wk.worker, address)
    return 0

cdef Py_ssize_t boot_header(fab_channel* fch, const char* head) noexcept nogil:
    """The peer's fixed header: its version and flags, and the length of the
    worker address that follows."""
    cdef uint32_t alen = rd32(head + 16)
    if rd32(head) != BOOT_MAGIC or rd16(head + 4) != BOOT_VERSION:
        return fab_fail(fch, EPROTO, "peer is not a fabric ucx endpoint of this version (bad bootstrap)")
    if rd16(head + 6) & ~(BOOT_PEER_ERRORS | BOOT_LOCAL_NONE | BOOT_SOCKET_LOCAL):
        return fab_fail(fch, EPROTO, "peer sent unknown bootstrap flags")
    if alen == 0 or alen > MAX_ADDRESS:
        return fab_fail(fch, EPROTO, "peer sent an implausible UCX worker address")
    return alen

cdef int boot_step(ucx_chan* ch) noexcept nogil:
    """Exchange bootstrap messages without blocking; create the UCP endpoint
    once the peer's address is in. 0, or -errno."""
    cdef const char* head = ch.boot.head
    cdef ucx_deferred* dq
    cdef int rc
    cdef ucs_status_t st
    cdef int peer_errors
    rc = boot_progress(&ch.boot, &ch.base, boot_header)
    if rc < 0 and not ch.closed:
        hub_mark_ready(&ch.dom.hub, &ch.base)       # the engine learns of it by polling
    if rc <= 0:
        return rc
    ch.peer_key = rd64(head + 8)
    # Both sides derive the same mode from the two offers. PEER mode makes
    # UCX drop its shared-memory transports (they cannot report a failed
    # peer); two processes of one host that both offer NONE use them, and
    # learn of a dead peer from the bootstrap socket, as with UCX_TLS=sm.
    peer_errors = ch.dom.peer_errors and (rd16(head + 6) & BOOT_PEER_ERRORS)
    # The host identity is what the peer says (it can echo ours); that its
    # socket comes from this host it cannot fake. Both ends must see that
    # (address translation could show it to one end only), so each says what
    # its socket showed and both require both: a lying peer can only make
    # the connection take the network path.
    if (peer_errors and ch.dom.local_none and (rd16(head + 6) & BOOT_LOCAL_NONE)
            and memcmp(head + BOOT_HOST, ch.dom.host_id, HOST_ID) == 0
            and peer_on_this_host(ch.boot.sock) and (rd16(head + 6) & BOOT_SOCKET_LOCAL)):
        peer_errors = 0
        # shared memory's GET (cma) is real: the engine may pull again (its
        # pulls fail cleanly with the peer, UCX's rendezvous sends would not)
        ch.base.caps &= ~FAB_CAP_LARGE_NATIVE_ONLY
        if ch.wk.wedged:                # it sent the address of a queue found wedged since
            return fail_ready(ch, ECONNRESET, WEDGED)
    st = fab_ucx_ep_create(ch.wk.worker, <ucp_address_t*>ch.boot.payload, peer_errors,
                           on_ep_error, ch, &ch.ep)
    if st != UCS_OK:
        return fail_ready(ch, ECONNREFUSED_, "cannot reach the peer's UCX worker (check UCX_TLS on both sides)")
    ch.ep_peer_mode = peer_errors
    ch.dom.eps_open += 1
    ch.state = ST_READY
    boot_release(&ch.boot)      # the socket now only tells us if the peer goes away
    dq = <ucx_deferred*>boot_next_deferred(&ch.boot)
    while dq != NULL:
        rc = post_am(ch, dq.iov, dq.iovcnt, dq.link.ctx, 1)
        free(dq)
        if rc < 0:
            return rc
        dq = <ucx_deferred*>boot_next_deferred(&ch.boot)
    return 0


# ------------------------------------------------------ native large chunks

cdef ucx_large* large_find(ucx_chan* ch, uint64_t tag) noexcept nogil:
    cdef ucx_large* e = ch.large
    while e != NULL and e.tag != tag:
        e = e.next
    return e

cdef void large_unlink(ucx_chan* ch, ucx_large* e) noexcept nogil:
    cdef ucx_large** p = &ch.large
    while p[0] != NULL and p[0] != e:
        p = &p[0].next
    if p[0] != NULL:
        p[0] = e.next

cdef void on_large_received(void* request, ucs_status_t status, size_t length, void* user_data) noexcept nogil:
    cdef ucx_req* r = <ucx_req*>user_data
    cdef ucx_chan* ch = r.ch
    req_untrack(ch, r)
    if not ch.closed:
        push_event(ch, FAB_EV_READ, 0 if status == UCS_OK else -13, r.ctx, NULL, 0, 0)
    if request != NULL:
        ucp_request_free(request)
    free(r)
    maybe_free_channel(ch)

cdef int large_start(ucx_chan* ch, ucx_large* e, int in_callback) noexcept nogil:
    """Both sides are known: fetch the chunk into its destination. Inside the
    active-message callback a descriptor is consumed without being released
    (the callback then returns UCS_OK); outside, data UCX kept is released."""
    cdef ucx_req* r
    cdef ucs_status_ptr_t sp
    large_unlink(ch, e)
    if e.length != e.dst_length or e.is_data:
        if e.length == e.dst_length:
            memcpy(e.dst, e.desc, e.length)
        push_event(ch, FAB_EV_READ, 0 if e.length == e.dst_length else -13, e.ctx, NULL, 0, 0)
        if e.is_data == 2:
            free(e.desc)
        elif not in_callback:
            ucp_am_data_release(ch.wk.worker, e.desc)    # persistent data, or a refused descriptor
        free(e)
        return 0
    r = <ucx_req*>malloc(sizeof(ucx_req))
    if r == NULL:
        free(e)
        return fail_ready(ch, ENOMEM, "receive")
    r.ch = ch
    r.kind = R_LARGE_RECV
    r.ctx = e.ctx
    r.rkey = NULL
    sp = fab_ucx_am_recv_data(ch.wk.worker, e.desc, e.dst, e.length, on_large_received, r)
    free(e)
    if sp == NULL:
        push_event(ch, FAB_EV_READ, 0, r.ctx, NULL, 0, 0)
        free(r)
    elif fab_ucx_is_err(sp):
        push_event(ch, FAB_EV_READ, -13, r.ctx, NULL, 0, 0)
        free(r)
    else:
        req_track(ch, r, sp)
    return 0

cdef ucs_status_t large_arrived(ucx_chan* ch, uint64_t tag, void* data, size_t length,
                                uint64_t attr) noexcept nogil:
    """A native chunk arrived (a rendezvous descriptor, or data if UCX sent
    it eagerly). Fetch it now if its destination is known, else keep it."""
    cdef ucx_large* e = large_find(ch, tag)
    cdef int rndv = (attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0
    if e == NULL:
        e = <ucx_large*>calloc(1, sizeof(ucx_large))
        if e == NULL:
            fail_ready(ch, ENOMEM, "receive")
            return UCS_OK
        e.tag = tag
        e.next = ch.large
        ch.large = e
    elif e.desc != NULL:
        fail_ready(ch, EPROTO, "peer sent two native chunks with one tag")
        return UCS_OK
    e.desc = data
    e.length = length
    e.is_data = not rndv
    if e.waiting:
        large_start(ch, e, 1)
        return UCS_OK
    if not rndv and not (attr & UCP_AM_RECV_ATTR_FLAG_DATA):
        e.desc = malloc(length if length else 1)      # UCX will not keep it: copy
        if e.desc == NULL:
            fail_ready(ch, ENOMEM, "receive")
            return UCS_OK
        memcpy(e.desc, data, length)
        e.is_data = 2
        return UCS_OK
    return UCS_INPROGRESS

cdef int ucx_send_large(fab_channel* fch, void* src, size_t length, uint64_t tag, uint64_t ctx) noexcept nogil:
    cdef ucx_chan* ch = <ucx_chan*>fch
    cdef ucx_req* r
    cdef ucs_status_ptr_t sp
    if fch.failed:
        return -fch.failed
    if ch.state != ST_READY:
        return -EINVAL
    r = <ucx_req*>malloc(sizeof(ucx_req))
    if r == NULL:
        return fab_fail(fch, ENOMEM, "send")
    r.ch = ch
    r.kind = R_LARGE_SEND
    r.ctx = ctx
    r.rkey = NULL
    wr64(r.header, ch.peer_key)
    wr64(r.header + 8, tag)
    sp = fab_ucx_am_send_large(ch.ep, r.header, 16, src, length, on_request_done, r)
    if sp == NULL:
        free(r)
        return FAB_DONE
    if fab_ucx_is_err(sp):
        free(r)
        return fab_fail(fch, ECONNRESET, ucs_status_string(fab_ucx_status(sp)))
    req_track(ch, r, sp)
    return FAB_PENDING

cdef int ucx_recv_large(fab_channel* fch, void* dst, size_t length, uint64_t tag, uint64_t ctx) noexcept nogil:
    cdef ucx_chan* ch = <ucx_chan*>fch
    cdef ucx_large* e
    if fch.failed:
        return -fch.failed
    e = large_find(ch, tag)
    if e == NULL:
        e = <ucx_large*>calloc(1, sizeof(ucx_large))
        if e == NULL:
            return fab_fail(fch, ENOMEM, "receive")
        e.tag = tag
        e.next = ch.large
        ch.large = e
    e.dst = <char*>dst
    e.dst_length = length
    e.ctx = ctx
    e.waiting = 1
    if e.desc != NULL:
        large_start(ch, e, 0)
    return FAB_PENDING


# ------------------------------------------------------------- operations

cdef int ucx_send(fab_channel* fch, iovec* iov, fab_mr** mrs, int iovcnt, uint64_t ctx) noexcept nogil:
    cdef ucx_chan* ch = <ucx_chan*>fch
    cdef ucp_dt_iov_t v[64]
    cdef ucx_deferred* dq
    cdef int i
    if fch.failed:
        return -fch.failed
    if iovcnt > 64:
        return -EINVAL
    for i in range(iovcnt):
        v[i].buffer = iov[i].iov_base
        v[i].length = iov[i].iov_len
    if ch.state != ST_READY:
        dq = <ucx_deferred*>boot_defer(&ch.boot, sizeof(ucx_deferred) + iovcnt * sizeof(ucp_dt_iov_t), ctx)
        if dq == NULL:
            return fab_fail(fch, ENOMEM, "send")
        dq.iovcnt = iovcnt
        memcpy(dq.iov, v, iovcnt * sizeof(ucp_dt_iov_t))
        return FAB_PENDING
    return post_am(ch, v, iovcnt, ctx, 0)

cdef int ucx_reg(fab_channel* fch, void* addr, size_t length, fab_mr* mr, int remote) noexcept nogil:
    cdef ucx_chan* ch = <ucx_chan*>fch
    cdef fab_regnode* node
    cdef void* packed
    cdef size_t size
    cdef ucs_status_t st
    node = <fab_regnode*>calloc(1, sizeof(fab_regnode))
    if node == NULL:
        return -ENOMEM
    st = fab_ucx_mem_map(ch.dom.context, addr, length, <ucp_mem_h*>&node.handle)
    if st != UCS_OK:
        free(node)
        return -ENOMEM
    st = ucp_rkey_pack(ch.dom.context, <ucp_mem_h>node.handle, &packed, &size)
    if st != UCS_OK or size > FAB_MAX_RKEY:
        if st == UCS_OK:
            ucp_rkey_buffer_release(packed)
        ucp_mem_unmap(ch.dom.context, <ucp_mem_h>node.handle)
        free(node)
        return -EMSGSIZE
    memcpy(mr.rkey, packed, size)
    mr.rkey_len = <uint32_t>size
    ucp_rkey_buffer_release(packed)
    mr.handle = node
    mr.addr = <uint64_t><size_t>addr
    mr.length = length
    reglist_push(&ch.mrs, node)
    fch.live_regions += 1
    return FAB_DONE

cdef void ucx_dereg(fab_channel* fch, fab_mr* mr) noexcept nogil:
    cdef ucx_chan* ch = <ucx_chan*>fch
    cdef fab_regnode* node = <fab_regnode*>mr.handle
    if node == NULL:
        return
    reglist_unlink(&ch.mrs, node)
    ucp_mem_unmap(ch.dom.context, <ucp_mem_h>node.handle)
    free(node)
    mr.handle = NULL
    fch.live_regions -= 1

cdef int ucx_read(fab_channel* fch, void* dst, fab_mr* dst_mr, size_t length, uint64_t raddr,
                  uint8_t* rkey, uint32_t rkey_len, uint64_t ctx) noexcept nogil:
    cdef ucx_chan* ch = <ucx_chan*>fch
    cdef ucx_req* r
    cdef ucp_rkey_h rk
    cdef ucs_status_ptr_t sp
    if fch.failed:
        return -fch.failed
    if ch.state != ST_READY:
        return -EINVAL
    if ucp_ep_rkey_unpack(ch.ep, rkey, &rk) != UCS_OK:
        return -EINVAL                # the peer offered a key we cannot use
    r = <ucx_req*>malloc(sizeof(ucx_req))
    if r == NULL:
        ucp_rkey_destroy(rk)
        return fab_fail(fch, ENOMEM, "read")
    r.ch = ch
    r.kind = R_GET
    r.ctx = ctx
    r.rkey = rk
    sp = fab_ucx_get(ch.ep, dst, length, raddr, rk, on_request_done, r)
    if sp == NULL:
        ucp_rkey_destroy(rk)
        free(r)
        push_event(ch, FAB_EV_READ, 0, ctx, NULL, 0, 0)
        return FAB_PENDING
    if fab_ucx_is_err(sp):
        ucp_rkey_destroy(rk)
        free(r)
        push_event(ch, FAB_EV_READ, -13, ctx, NULL, 0, 0)
        return FAB_PENDING
    req_track(ch, r, sp)
    return FAB_PENDING

cdef int ucx_cancel_read(fab_channel* fch, uint64_t ctx) noexcept nogil:
    return 1        # a UCP get cannot be withdrawn: wait for its completion

cdef int ucx_poll(fab_channel* fch, fab_completion* out, int max_events) noexcept nogil:
    """Deliver what the hub queued for this channel (the hub drives the UCX
    worker); progress the bootstrap; watch the bootstrap socket."""
    cdef ucx_chan* ch = <ucx_chan*>fch
    cdef int n = 0
    cdef uint32_t i
    cdef ucx_event* ev
    cdef ucx_event* grown
    # data handed out by the previous poll is consumed now
    for i in range(ch.nhanded):
        release_data(ch, &ch.handed[i])
    ch.nhanded = 0
    if not fch.failed and ch.state == ST_BOOT:
        boot_step(ch)
    if boot_watch(&ch.boot, fch, ch.state == ST_READY) < 0:
        hub_mark_ready(&ch.dom.hub, fch)
    while ch.qcount > 0 and n < max_events:
        ev = &ch.q[ch.qhead]
        out[n].kind = ev.kind
        out[n].status = ev.status
        out[n].ctx = ev.ctx
        out[n].data = ev.data
        out[n].length = ev.length
        n += 1
        if ev.kind == FAB_EV_RECV:
            if ch.nhanded == ch.handed_cap:
                grown = <ucx_event*>realloc(ch.handed, (ch.handed_cap * 2 + 16) * sizeof(ucx_event))
                if grown == NULL:
                    fab_fail(fch, ENOMEM, "receive")
                    break
                ch.handed = grown
                ch.handed_cap = ch.handed_cap * 2 + 16
            ch.handed[ch.nhanded] = ev[0]
            ch.nhanded += 1
        ch.qhead = (ch.qhead + 1) % ch.qcap
        ch.qcount -= 1
    if ch.boot.peer_gone:
        probe_after_end(ch)
    if ch.boot.peer_gone and ch.qcount == 0 and not fch.failed:
        # everything the peer sent before leaving has been delivered above
        boot_fail_gone(&ch.boot, fch)
    if fch.failed and ch.qcount == 0 and n < max_events:
        out[n].kind = FAB_EV_FAILED
        out[n].status = -fch.failed
        out[n].ctx = 0
        out[n].data = NULL
        out[n].length = 0
        n += 1
    return n

cdef int ucx_arm(fab_channel* fch, uint32_t* events) noexcept nogil:
    """The socket's events (the hub arms the UCX worker itself)."""
    cdef ucx_chan* ch = <ucx_chan*>fch
    if fch.failed or ch.qcount > 0 or ch.boot.peer_gone:
        return 1
    events[0] = boot_events(&ch.boot)  # the bootstrap, then the peer going away
    return 0

cdef void ucx_close(fab_channel* fch) noexcept nogil:
    """Close the UCP endpoint (see close_endpoint) and release every mapping,
    without waiting for UCX: what it cannot cancel at once keeps the channel
    as a zombie of the domain (see the module doc)."""
    cdef ucx_chan* ch = <ucx_chan*>fch
    cdef double deadline
    cdef fab_regnode* node
    cdef ucx_large* lg
    cdef uint32_t i
    cdef ucx_domain* d = ch.dom
    if ch.closed:
        return
    ch.closed = 1             # from here on callbacks queue nothing for it
    hub_unready(&d.hub, fch)
    if (ch.key & 0xFFFFFFFFU) < d.nchans and d.chans[ch.key & 0xFFFFFFFFU] == ch:
        d.chans[ch.key & 0xFFFFFFFFU] = NULL
    for i in range(ch.nhanded):
        release_data(ch, &ch.handed[i])
    ch.nhanded = 0
    while ch.large != NULL:
        lg = ch.large
        ch.large = lg.next
        if lg.desc != NULL:
            if lg.is_data == 2:
                free(lg.desc)
            elif lg.is_data:
                ucp_am_data_release(ch.wk.worker, lg.desc)
            # A rendezvous descriptor nobody fetched is not released: that
            # sends the sender its acknowledgement, and with the sender's
            # endpoint closing too (both ends in one process at exit) UCX
            # wrote it through a torn-down lane (SIGSEGV in
            # ucp_am_rndv_send_ats). The sender's request fails with the
            # connection instead; the worker reclaims the descriptor.
        free(lg)
    close_endpoint(ch)
    # Cancelled requests of a live peer complete within a few progress
    # rounds; a peer that is gone may never let them: do not wait for it.
    if not (ch.boot.peer_gone or ch.ep_failed or d.closing):
        deadline = monotonic_now() + CLOSE_GRACE
        while (ch.reqs != NULL or close_pending(ch)) and monotonic_now() < deadline:
            ucp_worker_progress(ch.wk.worker)
    while ch.mrs != NULL:
        node = ch.mrs
        ch.mrs = node.next
        ucp_mem_unmap(d.context, <ucp_mem_h>node.handle)
        free(node)
    boot_close(&ch.boot, fch)
    probe_after_end(ch)
    ch.released = 1
    if ch.reqs != NULL or close_pending(ch):
        ch.is_zombie = 1
        ch.zombie_prev = NULL
        ch.zombie_next = d.zombies
        if d.zombies != NULL:
            d.zombies.zombie_prev = ch
        d.zombies = ch
    else:
        maybe_free_channel(ch)


# ------------------------------------------------------------- set-up

cdef fab_channel* new_channel(void* domain, int sock, size_t max_recv, uint32_t recv_depth,
                              const char* host) noexcept nogil:
    """A channel in bootstrap on a connected socket (it attaches dialled ones
    and the listener's); NULL, sock closed, if none can be made."""
    cdef ucx_domain* d = <ucx_domain*>domain
    cdef ucx_chan* ch = <ucx_chan*>calloc(1, sizeof(ucx_chan))
    if ch == NULL:
        close(sock)
        return NULL
    ch.base.ops = &UCX_OPS
    ch.base.caps = (FAB_CAP_NATIVE_READ | FAB_CAP_SEND_ANY_MEMORY | FAB_CAP_READ_ANY_MEMORY
                    | FAB_CAP_NATIVE_LARGE)
    if d.peer_errors:
        # Network transports: over tcp, UCX emulates ucp_get in software and
        # aborts the whole process (ucs_fatal in ucp_request_try_send via
        # ucp_get_req_handler, UCX 1.22 and its master) when the reply to a
        # peer's GET fails because that peer just died. Its own rendezvous
        # reports such failures on the request instead.
        ch.base.caps |= FAB_CAP_LARGE_NATIVE_ONLY
    ch.base.max_recv = max_recv
    ch.base.send_depth = 64
    ch.base.hub = &d.hub
    ch.dom = d
    ch.state = ST_BOOT
    if d.cur == NULL and not d.closing:
        d.cur = wk_open(d)              # none could be made when the last one wedged
    if not d.closing and d.cur != NULL:
        ch.key = domain_add(d, ch)
    if ch.key == 0:
        free(ch)
        close(sock)
        return NULL
    domain_ref(&d.refs)
    ch.wk = d.cur
    ch.wk.users += 1
    boot_init(&ch.boot, &ch.base, sock, BOOT_FIXED)
    if boot_make(ch) < 0:
        return &ch.base           # failed: the engine reports it and closes
    boot_step(ch)
    return &ch.base


cdef void unref_domain(void* d) noexcept nogil:
    domain_unref(<ucx_domain*>d)


# The process that initialised UCX (0: none yet). UCX keeps process-wide
# helper threads (its async progress) that a forked child does not inherit.
_initialised_in = 0

SHARED_MEMORY_TLS = {"sm", "shm", "sysv", "posix", "cma", "knem", "xpmem", "self", "mm"}


def shared_memory_only(tls):
    """True if UCX_TLS names only shared-memory transports, which cannot
    report a failed peer (fabric then relies on its bootstrap socket)."""
    names = [t.strip().lstrip("^") for t in tls.split(",") if t.strip()]
    return bool(names) and not tls.strip().startswith("^") and all(n in SHARED_MEMORY_TLS for n in names)


def init_failure(str what):
    """Why ucp_init failed, in terms of what the user set."""
    tls = os.environ.get("UCX_TLS")
    if tls is not None and not tls.strip():
        return ("UCX cannot start: UCX_TLS is set but empty, which leaves UCX no transport "
                f"({what}); unset it to let UCX choose, or name transports, e.g. UCX_TLS=sm or UCX_TLS=tcp")
    if tls:
        return (f"UCX cannot start with UCX_TLS={tls!r} ({what}): none of the transports it names is "
                "usable here; `python -m fabric info` lists the transports UCX sees")
    return f"UCX initialisation failed: {what}"


def host_identity():
    """HOST_ID bytes that two processes share exactly when UCX's shared-memory
    transports can join them: one boot of one kernel, the same IPC, mount and
    PID namespaces (posix/sysv segments, /dev/shm, cma's process ids) and the
    same user (cma needs ptrace rights)."""
    import hashlib
    parts = []
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            parts.append(f.read().strip())
        for ns in ("ipc", "mnt", "pid"):
            parts.append(os.readlink(f"/proc/self/ns/{ns}").encode())
    except OSError:
        parts = [os.urandom(16)]      # cannot tell: never equal to a peer's
    parts.append(str(os.geteuid()).encode())
    return hashlib.sha256(b"\0".join(parts)).digest()


def runtime_version():
    """(compiled API version, loaded library version) as (major, minor) pairs."""
    cdef unsigned built = fab_ucx_api_version(), loaded = fab_ucx_runtime_version()
    return (built >> 24, (built >> 16) & 0xFF), (loaded >> 24, (loaded >> 16) & 0xFF)


cdef class UcxBackend(Backend):
    """UCX through UCP: active messages for eager frames, ucp_get for pulls."""

    def __init__(self):
        self.name = "ucx"
        self.caps = (FAB_CAP_NATIVE_READ | FAB_CAP_SEND_ANY_MEMORY | FAB_CAP_READ_ANY_MEMORY
                     | FAB_CAP_NATIVE_LARGE)

    def default_options(self):
        # Measured on shared memory (bench/RESULTS.md): UCX's eager active
        # messages stream at ~1.1 GB/s whatever the size, while ucp_get pulls
        # reach 4 GB/s at 16 KiB and 8 GB/s at 64 KiB; eager wins latency only.
        # From 2 MiB up UCX's own rendezvous (whole message) beat the
        # engine's ucp_get pulls in round trip in every run, and matched or
        # beat them in bandwidth; from 128 KiB to 1 MiB the two traded places
        # run to run (bench/ucx_protocols.py, RESULTS.md).
        return {"eager_limit": 8192, "chunk_size": 1 << 20, "chunks_in_flight": 8,
                "coalesce_limit": 16384 + 1024, "credits": 64, "native_min": 1 << 20}

    @staticmethod
    def available():
        built, loaded = runtime_version()
        if built != loaded:
            return False, (f"fabric was built against UCX {built[0]}.{built[1]} but loaded UCX "
                           f"{loaded[0]}.{loaded[1]} (both use libucp.so.0): install the one it was built "
                           f"against (pip install 'fabric-transport[ucx]' for the libucx wheel) or rebuild "
                           f"against the loaded one (FABRIC_UCX=system); docs: guides/backends, 'ucx'")
        return True, f"UCX {loaded[0]}.{loaded[1]}"

    def open_domain(self, dict options):
        global _initialised_in
        cdef UcxDomain dom
        cdef ucx_domain* d
        cdef ucs_status_t st
        cdef epoll_event ev
        if _initialised_in not in (0, os.getpid()):
            from fabric.errors import BackendUnavailable
            raise BackendUnavailable(
                "UCX was initialised in a parent of this forked process; its helper threads did not "
                "survive the fork, so UCX cannot be used here (connections hang). Start this process "
                "with the 'spawn' or 'forkserver' method of multiprocessing, or create the parent's "
                "ucx Fabric after forking.")
        _initialised_in = os.getpid()
        dom = UcxDomain.__new__(UcxDomain)
        d = <ucx_domain*>calloc(1, sizeof(ucx_domain))
        if d == NULL:
            raise MemoryError()
        d.epfd = -1
        with nogil:
            st = fab_ucx_init(&d.context)
        if st != UCS_OK:
            free(d)
            from fabric.errors import BackendUnavailable
            raise BackendUnavailable(init_failure(ucs_status_string(st).decode()))
        d.refs = 1
        d.peer_errors = not shared_memory_only(os.environ.get("UCX_TLS", ""))
        # Only when the user left the transports to UCX: an explicit UCX_TLS
        # (tcp, say) is honoured as given.
        d.local_none = d.peer_errors and not os.environ.get("UCX_TLS", "").strip()
        ident = host_identity()
        memcpy(d.host_id, <const char*>ident, HOST_ID)
        d.sm_possible = d.local_none or not d.peer_errors
        dom.d = d
        dom.pid = os.getpid()
        if d.sm_possible:               # room for a second worker (the probe's deadlines: hub.next_deadline)
            d.epfd = epoll_create1(EPOLL_CLOEXEC)
            if d.epfd < 0:
                raise OSError(errno, "UCX domain: epoll")
        with nogil:
            d.cur = wk_open(d)
        if d.cur == NULL:
            raise OSError("UCX could not create a worker (or its event fd, or its active-message handler)")
        d.hub.fd = d.epfd if d.sm_possible else d.cur.efd
        d.hub.progress = ucx_hub_progress
        d.hub.arm = ucx_hub_arm
        return dom

    cdef fab_hub* hub(self, object domain) except? NULL:
        return &(<UcxDomain?>domain).d.hub

    cdef fab_listener* listen(self, object domain, str host, int port, dict options) except NULL:
        cdef ucx_domain* d = (<UcxDomain?>domain).d
        return boot_listen(host, port, d, &d.refs, 0, new_channel, unref_domain)

    cdef int prepare_attach(self, object domain, dict options, fab_attach* out) except -1:
        out.attach = new_channel
        out.domain = (<UcxDomain?>domain).d
        out.recv_depth = recv_depth_for(options)
        return 0

