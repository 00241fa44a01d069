/* Ready memory: where large received messages land.
 *
 * A large message that recv() hands out needs memory nobody touched yet.
 * Fresh pages from the kernel are faulted in and zeroed on first touch
 * (256 MiB: 65,536 faults, about 0.06 s here, half of what a recv() loop
 * moved). So blocks of FAB_RM_MIN bytes or more are mapped by us, aligned to
 * and sized in huge pages (MADV_HUGEPAGE: one fault per 2 MiB where the kernel
 * offers transparent huge pages), populated in one call when mapped
 * (MADV_POPULATE_WRITE, Linux 5.14+), and kept when freed: the next message
 * that fits reuses pages that are already there.
 *
 * Bounds: the free blocks kept never exceed `limit` bytes (FABRIC_RECV_CACHE)
 * nor FAB_RM_SLOTS blocks; the least recently freed go first, and a block
 * idle for FAB_RM_IDLE_NS is unmapped at the next call. Blocks handed out are
 * tracked in a set (by address) so fab_rm_free() can tell ours from malloc's:
 * ours are aligned to FAB_RM_ALIGN, so only such addresses are looked up.
 *
 * Locking: one spin lock held only for table updates (never across mmap or
 * munmap); a forked child starts with it released.
 */
#ifndef FABRIC_READY_MEMORY_H
#define FABRIC_READY_MEMORY_H

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifndef MADV_HUGEPAGE
#define MADV_HUGEPAGE 14
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define FAB_RM_MIN ((size_t)1 << 20)
#define FAB_RM_ALIGN ((size_t)2 << 20)
#define FAB_RM_SLOTS 32
#define FAB_RM_IDLE_NS (30ull * 1000000000ull)

typedef struct {
    char* base;
    size_t cap;
    uint64_t freed_ns;
} fab_rm_block_t;

typedef struct {
    uint64_t mapped;          /* blocks mapped fresh */
    uint64_t reused;          /* blocks handed out again from the pool */
    uint64_t unmapped;        /* blocks given back to the kernel */
    uint64_t populate_failed; /* MADV_POPULATE_WRITE refused (old kernel): pages fault on touch */
    uint64_t huge_refused;    /* MADV_HUGEPAGE refused: small pages */
    size_t pooled_bytes, live_bytes;
    size_t pooled_blocks, live_blocks;
    size_t limit;
} fab_rm_stats_t;

static struct {
    int lock;
    int atfork_done;
    size_t limit;
    fab_rm_block_t pool[FAB_RM_SLOTS];    /* free blocks, oldest first */
    int pool_n;
    /* handed-out blocks: open addressing on base, 0 = empty, 1 = deleted */
    char** live_key;
    size_t* live_cap;
    size_t live_slots, live_used, live_n;
    fab_rm_stats_t st;
} fab_rm = {0, 0, (size_t)128 << 20};

static inline void fab_rm_lock(void) {
    while (__atomic_exchange_n(&fab_rm.lock, 1, __ATOMIC_ACQUIRE))
        sched_yield();
}
static inline void fab_rm_unlock(void) { __atomic_store_n(&fab_rm.lock, 0, __ATOMIC_RELEASE); }
static void fab_rm_child_after_fork(void) { fab_rm.lock = 0; }

static inline uint64_t fab_rm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline size_t fab_rm_hash(char* p, size_t slots) {
    uint64_t x = (uint64_t)(uintptr_t)p >> 21;
    x *= 0x9E3779B97F4A7C15ull;
    return (size_t)(x >> 17) & (slots - 1);
}

/* Under the lock. 0 on success, -1 if the set cannot grow. */
static int fab_rm_live_add(char* p, size_t cap) {
    size_t i;
    if ((fab_rm.live_used + 1) * 2 > fab_rm.live_slots) {
        /* sized from the live count (tombstones are dropped), so churn never grows it */
        size_t slots = 64;
        while (slots < (fab_rm.live_n + 1) * 4) slots *= 2;
        char** keys = (char**)calloc(slots, sizeof(char*));
        size_t* caps = (size_t*)calloc(slots, sizeof(size_t));
        if (keys == NULL || caps == NULL) {
            free(keys);
            free(caps);
            return -1;
        }
        for (i = 0; i < fab_rm.live_slots; i++) {
            char* k = fab_rm.live_key[i];
            if ((uintptr_t)k > 1) {
                size_t j = fab_rm_hash(k, slots);
                while (keys[j] != NULL) j = (j + 1) & (slots - 1);
                keys[j] = k;
                caps[j] = fab_rm.live_cap[i];
            }
        }
        free(fab_rm.live_key);
        free(fab_rm.live_cap);
        fab_rm.live_key = keys;
        fab_rm.live_cap = caps;
        fab_rm.live_slots = slots;
        fab_rm.live_used = fab_rm.live_n;
    }
    i = fab_rm_hash(p, fab_rm.live_slots);
    while ((uintptr_t)fab_rm.live_key[i] > 1) i = (i + 1) & (fab_rm.live_slots - 1);
    if (fab_rm.live_key[i] == NULL) fab_rm.live_used++;
    fab_rm.live_key[i] = p;
    fab_rm.live_cap[i] = cap;
    fab_rm.live_n++;
    fab_rm.st.live_bytes += cap;
    return 0;
}

/* Under the lock: the block's capacity if p is ours (and forget it), else 0. */
static size_t fab_rm_live_take(char* p) {
    size_t i, cap;
    if (fab_rm.live_slots == 0) return 0;
    i = fab_rm_hash(p, fab_rm.live_slots);
    while (fab_rm.live_key[i] != NULL) {
        if (fab_rm.live_key[i] == p) {
            cap = fab_rm.live_cap[i];
            fab_rm.live_key[i] = (char*)1;
            fab_rm.live_n--;
            fab_rm.st.live_bytes -= cap;
            return cap;
        }
        i = (i + 1) & (fab_rm.live_slots - 1);
    }
    return 0;
}

/* Under the lock: take pool entry i out, keeping the rest oldest first. */
static fab_rm_block_t fab_rm_pool_remove(int i) {
    fab_rm_block_t b = fab_rm.pool[i];
    memmove(&fab_rm.pool[i], &fab_rm.pool[i + 1], (size_t)(fab_rm.pool_n - i - 1) * sizeof(fab_rm_block_t));
    fab_rm.pool_n--;
    fab_rm.st.pooled_bytes -= b.cap;
    return b;
}

/* Under the lock: move idle (or, with `need`, the oldest) free blocks into
 * `out` until `need` more bytes fit under the limit. Returns how many. */
static int fab_rm_evict(size_t need, fab_rm_block_t* out, uint64_t now) {
    int n = 0;
    while (fab_rm.pool_n > 0 &&
           (now - fab_rm.pool[0].freed_ns > FAB_RM_IDLE_NS ||
            (need && (fab_rm.st.pooled_bytes + need > fab_rm.limit || fab_rm.pool_n >= FAB_RM_SLOTS))))
        out[n++] = fab_rm_pool_remove(0);
    return n;
}

static void fab_rm_unmap_all(fab_rm_block_t* blocks, int n) {
    for (int i = 0; i < n; i++) munmap(blocks[i].base, blocks[i].cap);
    if (n) {
        fab_rm_lock();
        fab_rm.st.unmapped += (uint64_t)n;
        fab_rm_unlock();
    }
}

/* A fresh block of at least n bytes, aligned to FAB_RM_ALIGN, or NULL. */
static char* fab_rm_map(size_t n, size_t* cap_out, int populate) {
    size_t cap = (n + FAB_RM_ALIGN - 1) & ~(FAB_RM_ALIGN - 1);
    size_t span = cap + FAB_RM_ALIGN;
    char* raw = (char*)mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return NULL;
    char* base = (char*)(((uintptr_t)raw + FAB_RM_ALIGN - 1) & ~(uintptr_t)(FAB_RM_ALIGN - 1));
    if (base > raw) munmap(raw, (size_t)(base - raw));
    if (raw + span > base + cap) munmap(base + cap, (size_t)(raw + span - (base + cap)));
    int huge_refused = madvise(base, cap, MADV_HUGEPAGE) != 0;
    int populate_failed = populate && madvise(base, cap, MADV_POPULATE_WRITE) != 0;
    fab_rm_lock();
    fab_rm.st.mapped++;
    fab_rm.st.huge_refused += (uint64_t)huge_refused;
    fab_rm.st.populate_failed += (uint64_t)populate_failed;
    fab_rm_unlock();
    *cap_out = cap;
    return base;
}

static void fab_rm_init_once(void) {
    if (!fab_rm.atfork_done) {
        fab_rm.atfork_done = 1;
        pthread_atfork(NULL, NULL, fab_rm_child_after_fork);
    }
}

/* At least n bytes (n >= FAB_RM_MIN), page-aligned, ready to write; NULL on failure. */
static char* fab_rm_alloc(size_t n) {
    fab_rm_block_t idle[FAB_RM_SLOTS];
    int nidle, best = -1;
    uint64_t now = fab_rm_now();
    char* p;
    size_t cap;
    fab_rm_lock();
    fab_rm_init_once();
    nidle = fab_rm_evict(0, idle, now);
    for (int i = 0; i < fab_rm.pool_n; i++) {
        size_t c = fab_rm.pool[i].cap;
        /* a block at most half again as large (plus one huge page) */
        if (c >= n && c - n <= n / 2 + FAB_RM_ALIGN && (best < 0 || c < fab_rm.pool[best].cap))
            best = i;
    }
    if (best >= 0) {
        fab_rm_block_t b = fab_rm_pool_remove(best);
        if (fab_rm_live_add(b.base, b.cap) == 0) {
            fab_rm.st.reused++;
            fab_rm_unlock();
            fab_rm_unmap_all(idle, nidle);
            return b.base;
        }
        idle[nidle++] = b;
    }
    fab_rm_unlock();
    fab_rm_unmap_all(idle, nidle);
    p = fab_rm_map(n, &cap, 1);
    if (p == NULL) return NULL;
    fab_rm_lock();
    if (fab_rm_live_add(p, cap) != 0) {
        fab_rm_unlock();
        munmap(p, cap);
        return NULL;
    }
    fab_rm_unlock();
    return p;
}

/* Keep a free block (or unmap it if it cannot be kept). Not under the lock. */
static void fab_rm_keep(char* p, size_t cap) {
    fab_rm_block_t out[FAB_RM_SLOTS + 1];
    int n = 0;
    uint64_t now = fab_rm_now();
    fab_rm_lock();
    if (cap <= fab_rm.limit) {
        n = fab_rm_evict(cap, out, now);
        fab_rm.pool[fab_rm.pool_n].base = p;
        fab_rm.pool[fab_rm.pool_n].cap = cap;
        fab_rm.pool[fab_rm.pool_n].freed_ns = now;
        fab_rm.pool_n++;
        fab_rm.st.pooled_bytes += cap;
    } else {
        out[n].base = p;
        out[n].cap = cap;
        n++;
    }
    fab_rm_unlock();
    fab_rm_unmap_all(out, n);
}

/* 1 if p was one of ours (now kept or unmapped), 0 if it is not ours. */
static int fab_rm_free(char* p) {
    size_t cap;
    if (p == NULL || ((uintptr_t)p & (FAB_RM_ALIGN - 1)) != 0) return 0;
    fab_rm_lock();
    cap = fab_rm_live_take(p);
    fab_rm_unlock();
    if (cap == 0) return 0;
    fab_rm_keep(p, cap);
    return 1;
}

/* Map `count` blocks of `size` bytes into the pool ahead of use (as far as the
 * limit allows). Returns how many were added. */
static int fab_rm_prepare(size_t size, int count) {
    int added = 0;
    size_t cap;
    for (int i = 0; i < count; i++) {
        fab_rm_lock();
        fab_rm_init_once();
        size_t rounded = (size + FAB_RM_ALIGN - 1) & ~(FAB_RM_ALIGN - 1);
        int room = fab_rm.pool_n < FAB_RM_SLOTS && fab_rm.st.pooled_bytes + rounded <= fab_rm.limit;
        fab_rm_unlock();
        if (!room) break;
        char* p = fab_rm_map(size, &cap, 1);
        if (p == NULL) break;
        fab_rm_keep(p, cap);
        added++;
    }
    return added;
}

/* Unmap every free block; returns the bytes given back. */
static size_t fab_rm_trim(void) {
    fab_rm_block_t out[FAB_RM_SLOTS];
    size_t bytes;
    int n;
    fab_rm_lock();
    bytes = fab_rm.st.pooled_bytes;
    n = fab_rm_evict(0, out, UINT64_MAX / 2 + fab_rm_now());
    fab_rm_unlock();
    fab_rm_unmap_all(out, n);
    return bytes;
}

static void fab_rm_set_limit(size_t limit) {
    fab_rm_lock();
    fab_rm.limit = limit;
    fab_rm_unlock();
}

static fab_rm_stats_t fab_rm_stats(void) {
    fab_rm_stats_t s;
    fab_rm_lock();
    s = fab_rm.st;
    s.pooled_blocks = (size_t)fab_rm.pool_n;
    s.live_blocks = fab_rm.live_n;
    s.limit = fab_rm.limit;
    fab_rm_unlock();
    return s;
}

#endif
