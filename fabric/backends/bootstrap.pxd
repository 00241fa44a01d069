# The TCP bootstrap of the fabrics that need one (ucx, verbs): the exchange of
# one bootstrap message each way over a connected socket, the socket kept as
# the liveness monitor afterwards, and the listener that accepts such sockets.
# It also queues the sends the engine makes before the exchange is through.
# A backend embeds a fab_boot in its channel and keeps only what differs: the
# contents of its message and what it does with the peer's.
from libc.stdint cimport uint32_t, uint64_t
from fabric.backends.interface cimport fab_channel, fab_listener, fab_attach_fn

cdef enum:
    BOOT_HEAD_MAX = 64             # largest fixed header a backend may use

# Called once the peer's fixed header is in: validate it (fab_fail the channel
# and return -errno if it is bad) and return the length of the payload that
# follows (0: none). The backend bounds it.
ctypedef Py_ssize_t (*boot_header_fn)(fab_channel* ch, const char* head) noexcept nogil

# A send made before the channel is connected: the first member of the
# backend's own record, which boot_defer allocates and queues in order.
cdef struct boot_deferred:
    boot_deferred* next
    uint64_t ctx

cdef struct fab_boot:
    int sock                       # the bootstrap socket, then the liveness monitor; -1 once closed
    char* out                      # our message (boot_message)
    size_t out_len
    size_t out_done
    char head[BOOT_HEAD_MAX]       # the peer's fixed header
    size_t head_len
    size_t head_done
    int have_head                  # the header hook has run
    char* payload                  # the peer's payload (length set by the header hook)
    size_t payload_len
    size_t payload_done
    int peer_gone                  # the socket ended after the exchange: the peer went away
    int gone_errno                 # ... 0: it closed (EOF); else the socket's error (ETIMEDOUT: a silent host)
    uint32_t polls
    boot_deferred* deferred        # sends waiting for the connection, oldest first
    boot_deferred* deferred_tail

cdef void boot_init(fab_boot* b, fab_channel* ch, int sock, size_t head_len) noexcept nogil
cdef char* boot_message(fab_boot* b, fab_channel* ch, size_t length) noexcept nogil
cdef int boot_progress(fab_boot* b, fab_channel* ch, boot_header_fn on_header) noexcept nogil
cdef uint32_t boot_events(fab_boot* b) noexcept nogil
cdef void boot_release(fab_boot* b) noexcept nogil
cdef void boot_close(fab_boot* b, fab_channel* ch) noexcept nogil
cdef int boot_watch(fab_boot* b, fab_channel* ch, int connected) noexcept nogil
cdef int boot_fail_gone(fab_boot* b, fab_channel* ch) noexcept nogil
cdef void* boot_defer(fab_boot* b, size_t size, uint64_t ctx) noexcept nogil
cdef void* boot_next_deferred(fab_boot* b) noexcept nogil
cdef fab_listener* boot_listen(str host, int port, void* domain, int* refs, uint32_t depth,
                               fab_attach_fn make, void (*unref)(void* domain) noexcept nogil) except NULL
