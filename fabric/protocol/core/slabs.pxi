# Part of fabric.protocol.engine (included by engine.pyx).
#
# Slabs: the pre-registered send buffers of an endpoint (eager copies and
# coalescing of small frames, control frames).
# Owns: the free list, the open data and control slabs, the ready lists.
# Invariants: a slab is in exactly one place (free, open, ready, or posted
# with the backend until its send completes); frames inside a slab keep their
# order; control frames never wait behind data (their own slab and list).

cdef slab_t* slab_get(ep_t* ep, int control) noexcept nogil:
    cdef slab_t* s = ep.free_slabs
    if s != NULL:
        ep.free_slabs = s.next
    else:
        if not control and <uint32_t>ep.slabs_total >= ep.w.opts.send_buffers:
            return NULL
        s = <slab_t*>malloc(sizeof(slab_t) + sizeof(fab_mr) + ep.slab_cap)
        if s == NULL:
            return NULL
        s.data = <uint8_t*>(<char*>s + sizeof(slab_t) + sizeof(fab_mr))
        s.mr = NULL
        if not (ep.ch.caps & FAB_CAP_SEND_ANY_MEMORY):
            # registered once, for the slab's life; closing the channel
            # releases the registration
            s.mr = <fab_mr*>(<char*>s + sizeof(slab_t))
            if ep.ch.ops.reg(ep.ch, s.data, ep.slab_cap, s.mr, 0) < 0:
                free(s)
                if ep.ch.failed:
                    ep_channel_failed(ep)   # the real reason, not "out of memory"
                return NULL
            ep.own_regions += 1
        ep.slabs_total += 1
    s.next = NULL
    s.used = 0
    s.seq = 0
    s.frames = 0
    return s

cdef inline void slab_put(ep_t* ep, slab_t* s) noexcept nogil:
    s.next = ep.free_slabs
    ep.free_slabs = s

cdef void free_slab_list(slab_t* s) noexcept nogil:
    cdef slab_t* n
    while s != NULL:
        n = s.next
        free(s)
        s = n

cdef void slab_append(slab_t** head, slab_t** tail, slab_t* s) noexcept nogil:
    s.next = NULL
    if tail[0] == NULL:
        head[0] = s
    else:
        tail[0].next = s
    tail[0] = s

cdef slab_t* next_to_post(slab_t** head, slab_t** tail, slab_t** open_slab) noexcept nogil:
    """The oldest sealed slab of a queue, else the open one if it holds frames."""
    cdef slab_t* s = head[0]
    if s != NULL:
        head[0] = s.next
        if head[0] == NULL:
            tail[0] = NULL
        return s
    s = open_slab[0]
    if s != NULL and s.used > 0:
        open_slab[0] = NULL
        return s
    return NULL

cdef uint8_t* ctrl_room(ep_t* ep, size_t need) noexcept nogil:
    """Space for a control frame; control frames never wait for slabs."""
    cdef slab_t* s = ep.ctrl
    if s != NULL and s.used + need > ep.slab_cap:
        slab_append(&ep.ctrl_ready_head, &ep.ctrl_ready_tail, s)
        s = NULL
        ep.ctrl = NULL
    if s == NULL:
        s = slab_get(ep, 1)
        if s == NULL:
            ep_fail(ep, ENOMEM, "out of memory for control frames")
            return NULL
        ep.ctrl = s
    s.used += need
    s.frames += 1
    return s.data + s.used - need

cdef void seal_data(ep_t* ep) noexcept nogil:
    slab_append(&ep.ready_head, &ep.ready_tail, ep.open_data)
    ep.open_data = NULL

cdef uint8_t* data_room(ep_t* ep, size_t need) noexcept nogil:
    """Space in the open data slab, or NULL when every slab is in use."""
    if ep.open_data != NULL and ep.open_data.used + need > ep.slab_cap:
        seal_data(ep)
    if ep.open_data == NULL:
        ep.open_data = slab_get(ep, 0)
        if ep.open_data == NULL:
            return NULL
        ep.seq_sealed += 1
        ep.open_data.seq = ep.seq_sealed
    ep.open_data.used += need
    ep.open_data.frames += 1
    return ep.open_data.data + ep.open_data.used - need
