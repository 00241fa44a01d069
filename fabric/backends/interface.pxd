# The fabric interface: the whole contract between the protocol engine and a
# backend. The engine calls these function pointers with the GIL released; it
# never imports a concrete backend. A backend provides:
#
#   * Backend (cdef class): a Python-visible description (name, capability
#     flags, default thresholds, availability) and the slow-path factories
#     listen() / connect(), called with the GIL held.
#   * fab_channel: one connection. Two-sided send of a scatter list; receives
#     into buffers the backend keeps posted (recv_depth of max_recv bytes; the
#     engine's credits guarantee the peer never sends more than are posted),
#     delivered by poll(); memory registration with a remote key the peer can
#     use; one-sided read (and write, where native) of a peer's registered
#     region; non-blocking progress (poll) and a file descriptor to block on.
#   * fab_listener: accepts channels.
#
# Lifetime rules, which every backend must honour:
#   * Memory given to send() stays untouched by the engine until send() returned
#     FAB_DONE or a FAB_EV_SEND completion with the same ctx was polled.
#   * Data of a FAB_EV_RECV completion is valid until the next poll() call,
#     or until recycle() (where the backend has it): the engine calls it once
#     it is done with everything that poll() returned, before it returns the
#     credits of those messages, so a backend that reposts receive buffers has
#     them posted again before the peer may use the credits.
#   * close() releases every resource of the channel, including every region
#     registered on it; after close() returns the backend touches no memory the
#     engine gave it (no read still landing in a receive buffer).
#   * close() never blocks: a fabric that cannot cancel an operation at once
#     keeps what it needs itself (never the engine's memory) until the fabric
#     completes it or the domain goes.
#
# Waiting. Every channel is progressed by poll() and can be waited on through
# the engine's epoll set:
#   * fd: the channel's own descriptor (a TCP socket, a bootstrap socket), or
#     -1. The engine watches it with the events arm() asks for and sets
#     `revents` before poll() when epoll reported it.
#   * hub: channels whose fabric progresses many channels at once (one UCX
#     worker, one verbs completion channel per Fabric) share a fab_hub. Its
#     fd joins the engine's epoll set once per Fabric; progress() drives the
#     shared engine and marks the channels that have completions queued
#     (hub_mark_ready), which the engine then polls. One descriptor per
#     Fabric, not per channel: nested epoll sets that share a descriptor hit
#     the kernel's wake-up path limits (EINVAL past ~50 channels).
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from posix.uio cimport iovec

# Capability flags (fab_channel.caps / Backend.caps).
cdef enum:
    FAB_CAP_NATIVE_READ = 1        # read() needs no CPU at the peer (RDMA READ)
    FAB_CAP_NATIVE_WRITE = 2       # a one-sided write exists
    FAB_CAP_SEND_ANY_MEMORY = 4    # send() accepts unregistered memory
    FAB_CAP_READ_ANY_MEMORY = 8    # read()'s destination need not be registered
    FAB_CAP_SEND_COPIES = 16       # FAB_DONE from send() means the data was copied out
    FAB_CAP_NATIVE_LARGE = 32      # send_large/recv_large: the fabric's own rendezvous
    FAB_CAP_ORDERED_CLOSE = 64     # the peer sees close() only after everything sent before it
                                   # (one stream); else a graceful close waits for the peer's CLOSE
    FAB_CAP_LARGE_NATIVE_ONLY = 128  # every rendezvous goes by send_large/recv_large: this
                                     # channel's read() is emulated by the peer's library in a
                                     # way that cannot fail safely (UCX's software GET over tcp)
    FAB_CAP_READS_SERVED = 256     # the peer's reads of our regions are served by this side's
                                   # backend writing the bytes (the tcp fabric): it reports
                                   # FAB_EV_SERVED once every byte of a region is written
    FAB_CAP_ORDERED_WRITE = 512    # write() exists, and a send posted after a write reaches the
                                   # peer only once the write's bytes are in place (one stream,
                                   # an RC queue pair): the engine's receiver-posted buffers

# Results of send() / read() / reg(); negative values are -errno and mean the
# channel has failed (its error text says why).
cdef enum:
    FAB_DONE = 0                   # completed during the call
    FAB_PENDING = 1                # a completion with the same ctx will be polled

# Completion kinds returned by poll().
cdef enum:
    FAB_EV_SEND = 1                # a FAB_PENDING send finished (ctx)
    FAB_EV_READ = 2                # a read finished; status 0 or -errno (ctx)
    FAB_EV_RECV = 3                # a fabric message arrived (data, length)
    FAB_EV_FAILED = 4              # the channel failed; status -errno, see error
    FAB_EV_WRITE = 6               # a FAB_PENDING write finished (ctx); status 0 or -errno
    FAB_EV_SERVED = 5              # (FAB_CAP_READS_SERVED) every byte of a region registered
                                   # with remote=1 has been written toward the peer; ctx: the
                                   # fab_mr* given to reg(). Reported once per registration and
                                   # only while it is live; the engine may dereg it from then on

# reg()'s `remote`: what the peer may do with the region through its key.
# A region the peer may read is never writable by it, and the reverse.
cdef enum:
    FAB_REG_LOCAL = 0              # only this side's own sends, reads and writes use it
    FAB_REG_READ = 1               # the peer reads it (a rendezvous chunk being pulled)
    FAB_REG_WRITE = 2              # the peer writes into it (a receive buffer posted to it)

cdef enum:
    FAB_MAX_RKEY = 256             # largest remote key any backend packs
    FAB_ERROR_TEXT = 160

cdef struct fab_completion:
    int kind
    int status
    uint64_t ctx
    char* data
    size_t length

cdef struct fab_mr:
    void* handle                   # backend's local handle
    uint64_t addr                  # address the peer names in read()
    size_t length
    uint32_t rkey_len
    uint8_t rkey[FAB_MAX_RKEY]     # opaque remote key, sent to the peer

cdef struct fab_channel
cdef struct fab_hub

cdef struct fab_hub:
    int fd                         # pollable: readable when progress() may find work
    # Drive the shared engine; completions go to their channels' queues, and
    # those channels are marked ready. Returns > 0 if anything moved.
    int (*progress)(fab_hub* hub) noexcept nogil
    # Before blocking on fd: 0, or 1 if work is pending now (do not block).
    int (*arm)(fab_hub* hub) noexcept nogil
    fab_channel* ready             # channels with completions queued (hub_mark_ready)
    uint64_t activity
    # Monotonic seconds by which progress() must run even if fd stays quiet
    # (0: none); the engine's one timer honours it (core/timers.pxi).
    double next_deadline

cdef struct fab_channel_ops:
    # mrs: NULL, or for each iov entry the registered region holding it (from
    # reg() on this channel); backends without FAB_CAP_SEND_ANY_MEMORY get one.
    int (*send)(fab_channel* ch, iovec* iov, fab_mr** mrs, int iovcnt, uint64_t ctx) noexcept nogil
    # remote: FAB_REG_READ, the peer will read the region through mr.rkey (a
    # rendezvous chunk); FAB_REG_WRITE, the peer will write into it (a posted
    # receive buffer); FAB_REG_LOCAL, only this side's own operations use it,
    # and a backend whose registrations grant remote access must not grant it.
    int (*reg)(fab_channel* ch, void* addr, size_t length, fab_mr* mr, int remote) noexcept nogil
    void (*dereg)(fab_channel* ch, fab_mr* mr) noexcept nogil
    int (*read)(fab_channel* ch, void* dst, fab_mr* dst_mr, size_t length, uint64_t raddr,
                uint8_t* rkey, uint32_t rkey_len, uint64_t ctx) noexcept nogil
    # One-sided write into a peer's region registered with FAB_REG_WRITE; NULL
    # where the fabric has none. src_mr: the region holding src (reg() with
    # FAB_REG_LOCAL), or NULL on a fabric with FAB_CAP_SEND_ANY_MEMORY.
    # FAB_DONE, or FAB_PENDING and later FAB_EV_WRITE with ctx; src stays
    # untouched until then.
    int (*write)(fab_channel* ch, void* src, fab_mr* src_mr, size_t length, uint64_t raddr,
                 uint8_t* rkey, uint32_t rkey_len, uint64_t ctx) noexcept nogil
    # The fabric's own rendezvous for one chunk (FAB_CAP_NATIVE_LARGE, else
    # NULL): the sender hands src over under a tag (completion FAB_EV_SEND with
    # ctx once src is no longer needed); the receiver names the destination
    # for that tag when it is ready (completion FAB_EV_READ with ctx). Tags are
    # unique per channel while in flight; lengths must match.
    int (*send_large)(fab_channel* ch, void* src, size_t length, uint64_t tag, uint64_t ctx) noexcept nogil
    int (*recv_large)(fab_channel* ch, void* dst, size_t length, uint64_t tag, uint64_t ctx) noexcept nogil
    # Stop a pending read from touching dst. Returns 0 if no byte will land in
    # dst any more (no completion will follow), 1 if the read must be waited
    # for (a completion will follow).
    int (*cancel_read)(fab_channel* ch, uint64_t ctx) noexcept nogil
    int (*poll)(fab_channel* ch, fab_completion* out, int max_events) noexcept nogil
    # epoll events to wait for before blocking (and arm notification, where
    # the fabric needs it). Returns 0 with *events set, or 1 if progress is
    # possible right now (do not block).
    int (*arm)(fab_channel* ch, uint32_t* events) noexcept nogil
    void (*close)(fab_channel* ch) noexcept nogil
    # The engine is done with the data of every completion the last poll()
    # returned (NULL where receive buffers need no recycling).
    void (*recycle)(fab_channel* ch) noexcept nogil

cdef struct fab_channel:
    fab_channel_ops* ops
    int fd                         # pollable: readable when poll() may progress, or -1
    uint32_t revents               # set by the engine: epoll reported fd since the last poll()
    fab_hub* hub                   # shared progress (see above), or NULL
    fab_channel* ready_prev        # hub's ready list (backend: hub_mark_ready / hub_unready)
    fab_channel* ready_next
    int is_ready
    void* owner                    # the engine's endpoint; backends never touch it
    uint32_t caps                  # final once the channel delivers its first message: a
                                   # backend may change them until then (ucx settles its mode)
    size_t max_recv                # largest fabric message the engine accepts
    uint32_t recv_depth            # receive buffers to keep posted, for fabrics that post
                                   # receives: recv_depth_for(options); a stream ignores it
    int send_depth                 # pending sends after which the engine holds (and coalesces)
    int failed
    uint64_t activity              # bumped whenever bytes move; waits keep spinning while it changes
    int64_t live_regions           # registrations not yet deregistered (leak checks)
    char error[FAB_ERROR_TEXT]
    char local_name[64]
    char peer_name[64]

cdef struct fab_listener:
    int fd                         # readable when accept() may return a socket
    # A connected socket, tuned like a dialled one (>= 0), or -EAGAIN, or
    # -errno. The engine authenticates the peer on it before anything of the
    # backend exists, then calls attach().
    int (*accept)(fab_listener* lst) noexcept nogil
    # The channel on an accepted socket (owns fd: closes it on failure), or
    # NULL; runs under the engine lock, like fab_attach.attach.
    fab_channel* (*attach)(fab_listener* lst, int fd, size_t max_recv) noexcept nogil
    void (*close)(fab_listener* lst) noexcept nogil
    char address[96]

cdef struct fab_regnode:
    # A backend's list of live registrations, so close() can release them all.
    fab_regnode* prev
    fab_regnode* next
    void* handle                   # the fabric's registration (ucp_mem_h, struct ibv_mr*)

cdef inline void hub_mark_ready(fab_hub* hub, fab_channel* ch) noexcept nogil:
    """The channel has completions queued: the engine polls it soon."""
    if ch.is_ready or hub == NULL:
        return
    ch.is_ready = 1
    ch.ready_prev = NULL
    ch.ready_next = hub.ready
    if hub.ready != NULL:
        hub.ready.ready_prev = ch
    hub.ready = ch

cdef inline void hub_unready(fab_hub* hub, fab_channel* ch) noexcept nogil:
    if not ch.is_ready or hub == NULL:
        return
    if ch.ready_prev != NULL:
        ch.ready_prev.ready_next = ch.ready_next
    else:
        hub.ready = ch.ready_next
    if ch.ready_next != NULL:
        ch.ready_next.ready_prev = ch.ready_prev
    ch.ready_prev = ch.ready_next = NULL
    ch.is_ready = 0

cdef inline fab_channel* hub_pop_ready(fab_hub* hub) noexcept nogil:
    cdef fab_channel* ch = hub.ready
    if ch != NULL:
        hub_unready(hub, ch)
    return ch


cdef inline void reglist_push(fab_regnode** head, fab_regnode* node) noexcept nogil:
    node.prev = NULL
    node.next = head[0]
    if head[0] != NULL:
        head[0].prev = node
    head[0] = node

cdef inline void reglist_unlink(fab_regnode** head, fab_regnode* node) noexcept nogil:
    if node.prev != NULL:
        node.prev.next = node.next
    else:
        head[0] = node.next
    if node.next != NULL:
        node.next.prev = node.prev


# Domain reference counts are taken and dropped by threads that do not share
# a lock (listen() runs without the engine lock), hence atomic.
cdef extern from *:
    """
    static inline void fab_domain_ref(int *refs) { __atomic_add_fetch(refs, 1, __ATOMIC_SEQ_CST); }
    static inline int fab_domain_unref_last(int *refs) { return __atomic_sub_fetch(refs, 1, __ATOMIC_SEQ_CST) == 0; }
    """
    void domain_ref "fab_domain_ref"(int* refs) noexcept nogil
    bint domain_unref_last "fab_domain_unref_last"(int* refs) noexcept nogil


cdef inline uint32_t recv_depth_for(dict options):
    """Receive buffers a channel must keep posted: the credits the engine
    offers its peer, plus the HELLO that arrives before any credit exists."""
    return <uint32_t>int(options["credits"]) + 1


# What attach needs, prepared with the GIL (prepare_attach), used without it.
# host: the name the application connected to (for TLS host name checks), or
# NULL on an accepted socket.
ctypedef fab_channel* (*fab_attach_fn)(void* domain, int fd, size_t max_recv,
                                       uint32_t recv_depth, const char* host) noexcept nogil

cdef struct fab_attach:
    fab_attach_fn attach           # builds the channel on a connected fd (owns fd: closes it on failure)
    void* domain                   # the backend's C domain, or NULL
    uint32_t recv_depth
    char host[256]                 # the name connected to (filled in by the engine)


cdef class Backend:
    cdef readonly str name
    cdef readonly uint32_t caps
    # `domain` is what open_domain() returned for this Fabric (per-Fabric
    # backend state, such as a UCX context and worker), or None.
    # Channels and listeners of one domain are created, progressed and closed
    # by different threads. The engine never holds its lock while it takes
    # the GIL (a thread blocked on the GIL at interpreter exit would hold it
    # forever), so everything that runs under the lock is nogil C:
    # prepare_attach() runs with the GIL and without the lock and fills in a
    # fab_attach; its attach function then runs under the engine lock
    # without the GIL, so it may touch state the domain shares with live
    # channels (channel tables, a UCX worker); it must not block.
    # listen() may resolve a name and runs without the engine lock: it may
    # only take a domain reference (domain_ref(), atomic).
    cdef fab_listener* listen(self, object domain, str host, int port, dict options) except NULL
    # Connecting takes two steps so that waiting for the peer holds no lock.
    # dial(): a connected bootstrap socket, bounded by timeout seconds (<0:
    # none), GIL released while waiting, engine lock NOT held; the base class
    # does it for every socket-bootstrapped backend.
    cdef int dial(self, object domain, str host, int port, double timeout, dict options) except -1
    cdef int prepare_attach(self, object domain, dict options, fab_attach* out) except -1
    # The hub this domain's channels share, or NULL (called with the GIL).
    cdef fab_hub* hub(self, object domain) except? NULL

from fabric._posix cimport snprintf, strerror, EPROTO


cdef inline int fab_fail_saying(fab_channel* ch, int err, const char* reason) noexcept nogil:
    """fab_fail with `reason` as the whole explanation, whatever err is (a
    TLS library's own text, say)."""
    if not ch.failed:
        ch.failed = err
        snprintf(ch.error, FAB_ERROR_TEXT, "%s", reason)
    return -err

cdef inline int fab_fail(fab_channel* ch, int err, const char* what) noexcept nogil:
    """Mark a channel failed (first reason wins) and return -err.

    err is a positive errno; for protocol violations pass EPROTO and a full
    sentence in `what`."""
    if not ch.failed:
        if err == EPROTO:  # `what` is the whole explanation
            return fab_fail_saying(ch, err, what)
        ch.failed = err
        snprintf(ch.error, FAB_ERROR_TEXT, "%s: %s", what, strerror(err))
    return -err

