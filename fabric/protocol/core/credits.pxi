# Part of fabric.protocol.engine (included by engine.pyx).
#
# Credits: flow control between two endpoints.
# Each side offers `credits` receive buffers; every fabric message costs the
# sender one peer credit (peer_credits) and comes back piggybacked on the
# receiver's next frame or in an explicit CREDIT (c2r: owed to the peer).
# CREDIT_RESERVE of them are kept for control frames, so CHUNK_DONE, CREDIT
# and CLOSE always get through. A receiver holding more than recv_budget
# bytes of unreceived messages keeps the credits of new ones (held) until the
# application receives: a fast sender cannot make it buffer without bound.
# total_recv_budget does the same for all endpoints of a worker together; an
# endpoint whose application took every message gets its credits back even
# then, so a backlog elsewhere never starves it (beyond the budget, each
# endpoint buffers at most what its peer's credits carry). A peer sending
# past its credits is cut off (on_fabric_msg).
# Invariant: credits are conserved: peer_credits + in flight + c2r + held
# equals what was offered.

cdef inline uint16_t take_credits(ep_t* ep) noexcept nogil:
    cdef uint32_t c = ep.c2r
    if c > 0xFFFF:
        c = 0xFFFF
    ep.c2r -= c
    if ep.c2r_quiet > ep.c2r:
        ep.c2r_quiet = ep.c2r
    return <uint16_t>c

cdef inline void charge_budget(ep_t* ep, size_t charge) noexcept nogil:
    ep.inbuf_bytes += charge
    ep.w.inbuf_total += charge

cdef inline bint over_budget(ep_t* ep, size_t more, bint others_queued) noexcept nogil:
    """Would `more` buffered bytes put ep past its budget, or (if it buffers
    other messages: others_queued) its worker past the total? An endpoint
    with nothing else queued is never held back by the others' backlog: its
    credits come back (release_budget) and it may pull one message ahead."""
    return (ep.inbuf_bytes + more > ep.w.opts.recv_budget
            or (others_queued and ep.w.inbuf_total + more > ep.w.opts.total_recv_budget))

cdef void release_budget(ep_t* ep, size_t charge) noexcept nogil:
    ep.inbuf_bytes -= charge
    ep.w.inbuf_total -= charge
    if ep.held and ep.inbuf_bytes <= ep.w.opts.recv_budget and (
            ep.w.inbuf_total <= ep.w.opts.total_recv_budget or ep.inq_head == NULL):
        ep.c2r += ep.held
        ep.held = 0
