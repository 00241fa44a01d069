# Part of fabric.protocol.engine (included by engine.pyx).
#
# Memory of received messages (msg_alloc / msg_free).
# Owns: a small cache of freed blocks of RECV_POOL_MIN bytes or more, so a loop
# receiving large messages reuses warm pages instead of faulting in new ones.
# Invariants: the cache never holds more than its byte bound; it is entered
# with a try-lock and skipped (plain malloc/free) when busy, so no caller ever
# blocks on it; blocks are plain malloc blocks (free() is always valid).

#
# A large message that recv() hands out lands in memory the engine
# allocates; fresh large blocks come from the kernel as pages it faults in
# and zeroes on first touch (16 MiB: ~4000 faults), which halved what a
# recv() loop moved. Freed blocks of RECV_POOL_MIN bytes or more are kept
# (at most RECV_POOL_SLOTS, RECV_POOL_LIMIT bytes: FABRIC_RECV_CACHE, the
# limit of fabric._buffers' cache too) and handed to the next message that
# fits (a block at most 1.5x its size). They are ordinary malloc blocks, so
# any path may still free() one. The pool never blocks: a thread that finds
# it busy (or a forked child inheriting it held) just uses the allocator.

cdef extern from "<malloc.h>" nogil:
    size_t malloc_usable_size(void* ptr)

cdef enum:
    RECV_POOL_SLOTS = 16
cdef size_t RECV_POOL_MIN = 256 << 10
cdef size_t RECV_POOL_LIMIT = 128 << 20
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
    if p == NULL:
        return
    cap = malloc_usable_size(p)
    if cap >= RECV_POOL_MIN and recv_pool_bytes + cap <= RECV_POOL_LIMIT and recv_pool_enter():
        if recv_pool_n < RECV_POOL_SLOTS and recv_pool_bytes + cap <= RECV_POOL_LIMIT:
            recv_pool_ptr[recv_pool_n] = p
            recv_pool_cap[recv_pool_n] = cap
            recv_pool_n += 1
            recv_pool_bytes += cap
            recv_pool_leave()
            return
        recv_pool_leave()
    free(p)


def _recv_pool_limit_from_env():
    from fabric._buffers import _cache_limit
    return _cache_limit()


RECV_POOL_LIMIT = _recv_pool_limit_from_env()


def recv_pool_stats():
    """The pool of received-message memory: blocks and bytes kept, blocks reused."""
    return {"blocks": recv_pool_n, "bytes": recv_pool_bytes, "reused": recv_pool_hits,
            "limit": RECV_POOL_LIMIT}
