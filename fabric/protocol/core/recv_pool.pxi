# Part of fabric.protocol.engine (included by engine.pyx).
#
# Memory of received messages (msg_alloc / msg_free).
# Owns: the memory a received message lands in, and the freed blocks kept
# for the next large message.
# Invariants: neither tier keeps more free bytes than its bound; the malloc
# tier is entered with a try-lock and skipped (plain malloc/free) when busy.
#
# Two tiers. Messages of FAB_RM_MIN (1 MiB) or more land in ready memory
# (ready_memory.h): blocks we map in huge pages, populate in one call and keep
# when freed, so a recv() loop reuses pages already faulted in. Smaller blocks
# of RECV_POOL_MIN bytes or more are ordinary malloc blocks, of which a few
# freed ones are kept too (at most RECV_POOL_SLOTS, RECV_POOL_LIMIT bytes).
# msg_free() tells the two apart (ready blocks are 2 MiB aligned and tracked);
# a block of either tier is only ever released by msg_free().

cdef extern from "ready_memory.h" nogil:
    ctypedef struct fab_rm_stats_t:
        uint64_t mapped, reused, unmapped, populate_failed, huge_refused
        size_t pooled_bytes, live_bytes, pooled_blocks, live_blocks, limit
    size_t FAB_RM_MIN
    char* fab_rm_alloc(size_t n)
    int fab_rm_free(char* p)
    int fab_rm_prepare(size_t size, int count)
    size_t fab_rm_trim()
    void fab_rm_set_limit(size_t limit)
    fab_rm_stats_t fab_rm_stats()

cdef extern from "<malloc.h>" nogil:
    size_t malloc_usable_size(void* ptr)

cdef enum:
    RECV_POOL_SLOTS = 16
cdef size_t RECV_POOL_MIN = 256 << 10
cdef size_t RECV_POOL_LIMIT = 16 << 20     # the malloc tier (blocks under FAB_RM_MIN)
cdef char* recv_pool_ptr[RECV_POOL_SLOTS]
cdef size_t recv_pool_cap[RECV_POOL_SLOTS]
cdef int recv_pool_n = 0
cdef size_t recv_pool_bytes = 0
cdef uint64_t recv_pool_hits = 0

cdef extern from *:
    """
    static int fab_recv_pool_busy = 0;
    static inline int fab_recv_pool_enter(void) {
        return __atomic_exchange_n(&fab_recv_pool_busy, 1, __ATOMIC_ACQUIRE) == 0;
    }
    static inline void fab_recv_pool_leave(void) {
        __atomic_store_n(&fab_recv_pool_busy, 0, __ATOMIC_RELEASE);
    }
    """
    bint recv_pool_enter "fab_recv_pool_enter"() noexcept nogil
    void recv_pool_leave "fab_recv_pool_leave"() noexcept nogil

cdef char* msg_alloc(size_t n) noexcept nogil:
    """malloc(n), from the pool when a kept block fits."""
    cdef int i, best = -1
    cdef char* p
    global recv_pool_n, recv_pool_bytes, recv_pool_hits
    if n >= FAB_RM_MIN:
        p = fab_rm_alloc(n)
        if p != NULL:
            return p
        return <char*>malloc(n)
    if n >= RECV_POOL_MIN and recv_pool_n > 0 and recv_pool_enter():
        for i in range(recv_pool_n):
            if recv_pool_cap[i] >= n and recv_pool_cap[i] - n <= n // 2 and (
                    best < 0 or recv_pool_cap[i] < recv_pool_cap[best]):
                best = i
        if best >= 0:
            p = recv_pool_ptr[best]
            recv_pool_bytes -= recv_pool_cap[best]
            recv_pool_n -= 1
            recv_pool_ptr[best] = recv_pool_ptr[recv_pool_n]
            recv_pool_cap[best] = recv_pool_cap[recv_pool_n]
            recv_pool_hits += 1
            recv_pool_leave()
            return p
        recv_pool_leave()
    return <char*>malloc(n if n else 1)

cdef void msg_free(char* p) noexcept nogil:
    """free(p), or keep p for the next large message."""
    cdef size_t cap
    global recv_pool_n, recv_pool_bytes
    if p == NULL or fab_rm_free(p):
        return
    cap = malloc_usable_size(p)
    if cap >= RECV_POOL_MIN and cap < FAB_RM_MIN and recv_pool_bytes + cap <= RECV_POOL_LIMIT and recv_pool_enter():
        if recv_pool_n < RECV_POOL_SLOTS and recv_pool_bytes + cap <= RECV_POOL_LIMIT:
            recv_pool_ptr[recv_pool_n] = p
            recv_pool_cap[recv_pool_n] = cap
            recv_pool_n += 1
            recv_pool_bytes += cap
            recv_pool_leave()
            return
        recv_pool_leave()
    free(p)


def _ready_memory_limit():
    """FABRIC_RECV_CACHE, else an eighth of physical memory, at most 1 GiB."""
    import os
    from fabric._buffers import _cache_limit
    if os.environ.get("FABRIC_RECV_CACHE"):
        return _cache_limit()
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        physical = 1 << 33
    return max(128 << 20, min(1 << 30, physical // 8))


fab_rm_set_limit(_ready_memory_limit())
RECV_POOL_LIMIT = min(RECV_POOL_LIMIT, _ready_memory_limit())


def _transparent_huge_pages():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return "unavailable"


def recv_pool_stats():
    """Memory of received messages, both tiers (process-wide).

    blocks/bytes: free blocks kept; limit: their bound (FABRIC_RECV_CACHE);
    reused: blocks handed out again; mapped/unmapped: huge-page blocks taken
    from and given back to the kernel; in_use_blocks/in_use_bytes: those held
    by messages now; populate_failed/huge_refused: kernel advice refused;
    transparent_huge_pages: the kernel's mode (madvise or always: used)."""
    cdef fab_rm_stats_t s = fab_rm_stats()
    return {"blocks": s.pooled_blocks + recv_pool_n, "bytes": s.pooled_bytes + recv_pool_bytes,
            "limit": s.limit, "reused": s.reused + recv_pool_hits,
            "mapped": s.mapped, "unmapped": s.unmapped,
            "in_use_blocks": s.live_blocks, "in_use_bytes": s.live_bytes,
            "populate_failed": s.populate_failed, "huge_refused": s.huge_refused,
            "transparent_huge_pages": _transparent_huge_pages()}


def prepare_recv_memory(Py_ssize_t size, int count=1):
    """Map and fault in `count` blocks for messages of `size` bytes ahead of
    their arrival (as far as the limit allows); returns how many were added."""
    if size < 0 or count < 0:
        raise ValueError("size and count must be >= 0")
    if <size_t>size < FAB_RM_MIN:
        return 0
    with nogil:
        count = fab_rm_prepare(size, count)
    return count


def trim_recv_memory():
    """Give every kept free block back to the kernel; returns the bytes released."""
    cdef size_t n
    global recv_pool_n, recv_pool_bytes
    with nogil:
        n = fab_rm_trim()
        if recv_pool_enter():
            while recv_pool_n > 0:
                recv_pool_n -= 1
                n += recv_pool_cap[recv_pool_n]
                free(recv_pool_ptr[recv_pool_n])
            recv_pool_bytes = 0
            recv_pool_leave()
    return n
