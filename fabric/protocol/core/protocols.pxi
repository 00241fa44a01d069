# Part of fabric.protocol.engine (included by engine.pyx).
#
# Protocol choice: which protocol a message of a given size takes on an
# endpoint, in one place (the send path and protocol_table() both use it).
#   size <= eager_limit: EAGER, zero-copy from the caller's buffer when the
#     channel is idle and the backend sends any memory, else copied into a slab
#     (and coalesced with other small frames when coalescing is on).
#   larger: rendezvous in chunk_size chunks pulled by the receiver
#     (chunks_in_flight ahead), or the fabric's own rendezvous (native) for
#     messages of native_min bytes or more, or always where the fabric requires
#     it (FAB_CAP_LARGE_NATIVE_ONLY).
# eager_limit is capped by the slab size, which the peer's HELLO bounds.

cdef size_t slab_size_for(const opts_t* o, size_t peer_max_recv) noexcept nogil:
    """The coalescing buffer (largest fabric message we send): coalesce_limit,
    at least one eager frame, at most what the peer accepts (HELLO)."""
    cdef size_t cap = o.coalesce_limit
    if cap < o.eager_limit + FRAME_HEADER:
        cap = o.eager_limit + FRAME_HEADER
    if cap > peer_max_recv:
        cap = peer_max_recv
    if cap < 1024:
        cap = 1024
    return cap

cdef size_t eager_limit_for(const opts_t* o, size_t slab_size) noexcept nogil:
    """Largest message sent eagerly: eager_limit, if one frame of it fits a slab."""
    if o.eager_limit > slab_size - FRAME_HEADER:
        return slab_size - FRAME_HEADER
    return o.eager_limit

cdef bint large_is_native(const opts_t* o, uint32_t caps, uint64_t total) noexcept nogil:
    """A message above the eager limit goes by the fabric's own rendezvous
    rather than our pulls."""
    if not (caps & FAB_CAP_NATIVE_LARGE):
        return 0
    if caps & FAB_CAP_LARGE_NATIVE_ONLY:
        return 1
    return o.native_min != 0 and total >= o.native_min

cdef inline bint uses_native(ep_t* ep, uint64_t total) noexcept nogil:
    # ep.caps, not ep.ch.caps: the channel may be gone (a closed endpoint)
    return large_is_native(&ep.w.opts, ep.caps, total)

cdef inline bint eager_zero_copy_now(ep_t* ep, sendop_t* op) noexcept nogil:
    """An eager message goes straight from the caller's buffers when the
    backend sends any memory and nothing is queued before it (it would
    overtake coalesced frames) and it may go now."""
    return ((ep.ch.caps & FAB_CAP_SEND_ANY_MEMORY) and ep.ready_head == NULL
            and (ep.open_data == NULL or ep.open_data.used == 0)
            and op.nseg <= MAX_SEGMENTS_ZC and can_post_data(ep))


def protocol_table(Backend backend not None, dict options not None, native_only=None):
    """The size ranges of each protocol for an endpoint of `backend` with the
    engine `options` (as fabric.options.resolve gives them), both peers
    alike: a list of (first size, last size or None, protocol, how).
    native_only: whether the channel sends every rendezvous by the fabric's
    own protocol (a backend may decide per connection, as ucx does by error
    mode); None: as the backend declares."""
    cdef opts_t o
    memset(&o, 0, sizeof(o))
    opts_from(options, &o)
    cdef uint32_t caps = backend.caps
    if native_only is not None:
        caps = (caps | FAB_CAP_LARGE_NATIVE_ONLY) if native_only else (caps & ~FAB_CAP_LARGE_NATIVE_ONLY)
    cdef size_t slab = slab_size_for(&o, slab_size_for(&o, 0xFFFFFFFFU))
    cdef size_t eager = eager_limit_for(&o, slab)
    rows = []
    how = ("zero-copy from the caller's buffer when the channel is idle, else "
           if caps & FAB_CAP_SEND_ANY_MEMORY else "") + "copied into a %d-byte slab" % slab
    if o.coalesce:
        how += ", coalesced with other small messages"
    rows.append((0, eager, "eager", how))
    pulls = "chunks of %d bytes, %d in flight, pulled by the receiver" % (o.chunk_size, o.chunks_in_flight)
    if not (caps & FAB_CAP_NATIVE_LARGE) or (not (caps & FAB_CAP_LARGE_NATIVE_ONLY) and o.native_min == 0):
        rows.append((eager + 1, None, "rendezvous", pulls))
    elif caps & FAB_CAP_LARGE_NATIVE_ONLY or o.native_min <= eager + 1:
        rows.append((eager + 1, None, "native", "the fabric's own rendezvous, chunks of up to %d bytes" % NATIVE_CHUNK))
    else:
        rows.append((eager + 1, o.native_min - 1, "rendezvous", pulls))
        rows.append((o.native_min, None, "native", "the fabric's own rendezvous, chunks of up to %d bytes" % NATIVE_CHUNK))
    return rows
