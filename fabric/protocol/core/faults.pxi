# Part of fabric.protocol.engine (included by engine.pyx).
#
# Test-only fault injection (FABRIC_FAULT_INJECT=<action>@<stage>[:<n>]):
# this process dies or its endpoint sends garbage at a protocol stage.
# Zero cost when unset (one flag test per stage).

cdef int fault_fires(ep_t* ep, int stage) noexcept nogil:
    """Test-only: this stage is where the configured fault happens now."""
    cdef opts_t* o = &ep.w.opts
    if o.fault_stage != stage:
        return 0
    o.fault_count -= 1
    if o.fault_count != 0:
        return 0
    if o.fault_action == FA_DIE:
        kill(getpid(), SIGKILL)
    return 1

cdef void send_garbage(ep_t* ep) noexcept nogil:
    """Test-only: a fabric message that is no frame at all (bad magic)."""
    cdef iovec v
    cdef int rc
    v.iov_base = GARBAGE
    v.iov_len = 64
    ep.peer_credits -= 1
    rc = ep.ch.ops.send(ep.ch, &v, NULL, 1, 0)      # verbs: inline, needs no registration
    if rc == FAB_PENDING:
        ep.pending_sends += 1
    elif rc < 0:
        ep_channel_failed(ep)

cdef void fault_after_post(ep_t* ep, int control) noexcept nogil:
    """Test-only: a due stage fault fires once its frame has been posted."""
    cdef int stage = ep.fault_stage_due
    if stage == 0:
        return
    if control:
        if ep.fault_seq != 0:
            return
    elif ep.fault_seq == 0 or ep.seq_posted < ep.fault_seq:
        return
    ep.fault_stage_due = 0
    if fault_fires(ep, stage):
        send_garbage(ep)

cdef inline void fault_due(ep_t* ep, int stage, uint64_t seq) noexcept nogil:
    if ep.w.opts.fault_stage == stage and ep.fault_stage_due == 0:
        ep.fault_stage_due = stage
        ep.fault_seq = seq

cdef void fault_batch(ep_t* ep, slab_t* s) noexcept nogil:
    """Test-only: a batch of 3+ frames is about to be posted."""
    cdef uint32_t first
    if s.frames < 3 or not fault_fires(ep, FS_BATCH):
        return
    first = rd32(s.data + 4)                  # body length of the first frame
    if FRAME_HEADER + first < s.used:
        s.data[FRAME_HEADER + first] ^= 0xFF  # the second frame's magic
