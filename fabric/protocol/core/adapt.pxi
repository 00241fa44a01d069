# Part of fabric.protocol.engine (included by engine.pyx).
#
# Thresholds sized to the link (options adapt, adapt_max_chunk,
# adapt_max_window). Owns: an endpoint's link measurements (the round trip,
# least of HANDSHAKE_PINGS PING/PONG exchanges right after the HELLOs; the
# bandwidth its finished rendezvous sends showed) and the eager_limit,
# chunk_size and window (chunks announced ahead) derived from them.
# Invariants: a threshold only grows from its configured value (the defaults
# are measured on loopback, the link with the least delay) and never past its
# bound: eager_limit the largest frame of a slab the peer's HELLO allows,
# chunk_size adapt_max_chunk, window the slots of a message (window_cap) and
# what the peer accepts (its HELLO's max_chunks). A threshold the user set
# (argument, environment, profile) is not in opts.adapt and stays. A message
# keeps the chunk size it started with.

cdef enum:
    ADAPT_EAGER = 1
    ADAPT_CHUNK = 2
    ADAPT_WINDOW = 4
    HANDSHAKE_PINGS = 3
    MAX_PEER_PINGS = 64        # PINGs a peer may send on one connection (each costs us a PONG)
    CHUNK_GRAIN = 65536        # adapted chunk sizes are multiples of this

# A link whose round trip is longer than this is another host's: there
# rendezvous's extra round trip costs far more than copying a whole slab
# (64 KiB copies in about 15 us at 4 GB/s), so every message a slab holds
# goes eagerly. Same-host round trips are 10-60 us, a few hundred on a loaded
# 2-core VM; the bound sits above those so that a busy machine does not
# switch its loopback connections (the least of three PINGs counts).
cdef double FAR_RTT = 500e-6
# Bytes in flight per message, in bandwidth-delay products. A transfer held
# back by its window shows less than the link's bandwidth; keeping twice the
# product in flight lets the next transfer show more, until the link (or a
# bound) is what limits it.
cdef double BDP_HEADROOM = 2.0


cdef inline uint64_t ping_cookie(double sent) noexcept nogil:
    return <uint64_t>(sent * 1e9) | 1

cdef void adapt_open(ep_t* ep) noexcept nogil:
    """The handshake is done: thresholds start at the configured values; a
    peer that answers PINGs is measured."""
    ep.chunk_size = ep.w.opts.chunk_size
    ep.window = ep.w.opts.chunks_in_flight
    if ep.window > ep.w.opts.window_cap:
        ep.window = ep.w.opts.window_cap
    if ep.w.opts.adapt and (ep.peer_features & HELLO_MEASURES):
        ep.pings_left = HANDSHAKE_PINGS
        send_ping(ep)

cdef void send_ping(ep_t* ep) noexcept nogil:
    cdef uint8_t* room
    # A connection saying goodbye measures no more: the peer refuses any
    # frame after our CLOSE but the answers it asked for.
    if ep.close_requested or ep.close_sent or ep.peer_closed:
        ep.pings_left = 0
        return
    room = ctrl_room(ep, FRAME_HEADER)
    if room == NULL:
        return
    ep.ping_sent = monotonic_now()
    ep.pings_left -= 1
    put_header(room, F_PING, 0, 0, ping_cookie(ep.ping_sent), 0, 0)

cdef int on_ping(ep_t* ep, frame_t* f) noexcept nogil:
    cdef uint8_t* room
    ep.pings_answered += 1
    if ep.pings_answered > MAX_PEER_PINGS:
        ep_fail(ep, EPROTO, "peer sent more PINGs than a connection answers")
        return -1
    room = ctrl_room(ep, FRAME_HEADER)
    if room == NULL:
        return -1
    put_header(room, F_PONG, 0, 0, f.msg_id, 0, 0)
    return 0

cdef int on_pong(ep_t* ep, frame_t* f) noexcept nogil:
    cdef double sample
    if ep.ping_sent == 0 or f.msg_id != ping_cookie(ep.ping_sent):
        ep_fail(ep, EPROTO, "peer answered a PING that was not sent")
        return -1
    sample = monotonic_now() - ep.ping_sent
    ep.ping_sent = 0
    if ep.rtt == 0 or sample < ep.rtt:
        ep.rtt = sample
    if ep.pings_left > 0:
        send_ping(ep)
    else:
        adapt_resize(ep, "round trip")
    return 0

cdef void adapt_rndv_done(ep_t* ep, sendop_t* op) noexcept nogil:
    """A rendezvous send of ours finished: its rate is a bandwidth sample
    (the most recent high one counts: a transfer sharing the link or held
    back by its window shows less than the link can carry)."""
    cdef double took, sample
    if not ep.w.opts.adapt or op.rndv_started == 0 or op.native or op.nchunks < 2:
        return
    took = monotonic_now() - op.rndv_started
    if took <= 0:
        return
    sample = <double>op.total / took
    if sample > ep.bandwidth:
        ep.bandwidth = sample
    else:
        ep.bandwidth = 0.875 * ep.bandwidth + 0.125 * sample
    adapt_resize(ep, "bandwidth")

cdef void adapt_resize(ep_t* ep, const char* after) noexcept nogil:
    """Size the thresholds the user left free to the measured link."""
    cdef opts_t* o = &ep.w.opts
    cdef size_t eager = ep.eager_limit
    cdef size_t chunk = ep.chunk_size
    cdef uint32_t window = ep.window
    cdef uint32_t most = o.window_cap
    cdef double want
    cdef size_t c
    if ep.rtt <= 0:
        return
    if ep.peer_max_chunks < most:
        most = ep.peer_max_chunks
    if (o.adapt & ADAPT_EAGER) and ep.rtt > FAR_RTT and ep.slab_cap > FRAME_HEADER:
        if eager < ep.slab_cap - FRAME_HEADER:
            eager = ep.slab_cap - FRAME_HEADER
    if ep.bandwidth > 0:
        want = ep.bandwidth * ep.rtt * BDP_HEADROOM
        if (o.adapt & ADAPT_WINDOW) and <double>chunk * window < want:
            while window < most and <double>chunk * window < want:
                window += 1
        if (o.adapt & ADAPT_CHUNK) and <double>chunk * window < want:
            c = <size_t>(want / window / CHUNK_GRAIN + 1) * CHUNK_GRAIN
            if c > o.adapt_max_chunk:
                c = o.adapt_max_chunk
            if c > chunk:
                chunk = c
    if eager == ep.eager_limit and chunk == ep.chunk_size and window == ep.window:
        return
    ep.eager_limit = eager
    ep.chunk_size = chunk
    ep.window = window
    ep.adaptations += 1
    if ep.bandwidth > 0:
        snprintf(ep.adapt_why, sizeof(ep.adapt_why), "after %s: round trip %.0f us, bandwidth %.0f MB/s",
                 after, ep.rtt * 1e6, ep.bandwidth / 1e6)
    else:
        snprintf(ep.adapt_why, sizeof(ep.adapt_why), "after %s: round trip %.0f us (no bandwidth sample yet)",
                 after, ep.rtt * 1e6)
