# cython: language_level=3
"""The raw ibverbs fabric (RC queue pairs; Soft-RoCE is this on an rxe device).

Per Fabric: the device context, a protection domain and one completion
channel (the "domain", also the channels' hub: one descriptor to wait on for
every connection of the Fabric; a CQ event names its channel). Per
connection: a CQ and an RC QP, connected through the TCP bootstrap
(bootstrap.pyx) that exchanges QPN, PSN, GID, LID, path MTU and read depth;
the socket stays open as a liveness monitor and is the channel's own
descriptor. Receives land in a registered pool of
`recv_depth` buffers posted before the bootstrap completes; sends are SENDs
(inline up to max_inline_data); the engine's pulls are RDMA READs. The QP
grants remote READ only: a peer can never write into our memory, and can read
only regions registered for a chunk in flight (the engine deregisters each
chunk at release).

Bootstrap message (40 bytes, little-endian): "FIBV" | u32 version 1 | u32 QPN |
u32 PSN | 16-byte GID | u16 LID | u8 MTU enum | u8 0 | u32 max read depth.

Device, port and GID are chosen automatically (first device with an ACTIVE
port; on Ethernet the first RoCE v2 GID holding an IPv4-mapped address, on
InfiniBand the LID) or by FABRIC_VERBS_DEVICE, FABRIC_VERBS_PORT,
FABRIC_VERBS_GID_INDEX; a failed choice names what was tried.
"""
import os

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy, memset
from posix.uio cimport iovec
from posix.unistd cimport getpid as c_getpid

from fabric._posix cimport *
from fabric._bytes cimport wr32, rd32
from fabric.backends.interface cimport *
from fabric.backends.bootstrap cimport *

cdef extern from "<fcntl.h>" nogil:
    int fcntl(int fd, int cmd, ...)
    enum:
        F_GETFL
        F_SETFL
        O_NONBLOCK

cdef extern from "verbs_shim.h" nogil:
    struct ibv_context:
        pass
    struct ibv_pd:
        pass
    struct ibv_cq:
        pass
    struct ibv_comp_channel:
        int fd
    struct ibv_qp:
        uint32_t qp_num
    struct ibv_mr:
        void* addr
        size_t length
        uint32_t lkey
        uint32_t rkey
    struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey
    struct ibv_wc:
        uint64_t wr_id
        int status
        int opcode
        uint32_t byte_len
    enum:
        IBV_WC_SUCCESS
        IBV_WC_REM_ACCESS_ERR
        IBV_WC_RECV
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_READ
        IBV_ACCESS_REMOTE_WRITE
    ibv_context* fab_ib_open(const char* name)
    int fab_ib_port(ibv_context* ctx, int port, int gid_index, uint8_t* gid16, uint16_t* lid,
                    int* active_mtu, int* is_eth, uint32_t* max_rd_atomic)
    ibv_qp* fab_ib_create_qp(ibv_pd* pd, ibv_cq* cq, uint32_t max_send, uint32_t max_recv,
                             uint32_t max_inline, uint32_t* inline_out)
    int fab_ib_qp_init(ibv_qp* qp, int port)
    int fab_ib_qp_rtr(ibv_qp* qp, int port, int mtu, uint32_t dest_qpn, uint32_t dest_psn,
                      const uint8_t* dest_gid, uint16_t dest_lid, int gid_index, int is_eth,
                      uint32_t max_dest_rd_atomic)
    int fab_ib_qp_rts(ibv_qp* qp, uint32_t psn, uint32_t max_rd_atomic)
    int fab_ib_qp_error(ibv_qp* qp)
    int fab_ib_post_send(ibv_qp* qp, ibv_sge* sge, int n, uint64_t wr_id, int inline_)
    int fab_ib_post_read(ibv_qp* qp, uint64_t laddr, uint32_t length, uint32_t lkey,
                         uint64_t raddr, uint32_t rkey, uint64_t wr_id)
    int fab_ib_post_write(ibv_qp* qp, uint64_t laddr, uint32_t length, uint32_t lkey,
                          uint64_t raddr, uint32_t rkey, uint64_t wr_id)
    int fab_ib_post_recv(ibv_qp* qp, uint64_t addr, uint32_t length, uint32_t lkey, uint64_t wr_id)
    int fab_ibv_load(char* why, size_t why_len)
    ibv_pd* ibv_alloc_pd "fab_ibv_alloc_pd"(ibv_context* ctx)
    int ibv_dealloc_pd "fab_ibv_dealloc_pd"(ibv_pd* pd)
    int ibv_close_device "fab_ibv_close_device"(ibv_context* ctx)
    ibv_comp_channel* ibv_create_comp_channel "fab_ibv_create_comp_channel"(ibv_context* ctx)
    int ibv_destroy_comp_channel "fab_ibv_destroy_comp_channel"(ibv_comp_channel* cc)
    ibv_cq* ibv_create_cq "fab_ibv_create_cq"(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* cc, int vector)
    int ibv_destroy_cq "fab_ibv_destroy_cq"(ibv_cq* cq)
    int ibv_destroy_qp "fab_ibv_destroy_qp"(ibv_qp* qp)
    ibv_mr* ibv_reg_mr "fab_ibv_reg_mr"(ibv_pd* pd, void* addr, size_t length, int access)
    int ibv_dereg_mr "fab_ibv_dereg_mr"(ibv_mr* mr)
    int ibv_poll_cq(ibv_cq* cq, int n, ibv_wc* wc)
    int ibv_req_notify_cq(ibv_cq* cq, int solicited_only)
    int ibv_get_cq_event "fab_ibv_get_cq_event"(ibv_comp_channel* cc, ibv_cq** cq, void** ctx)
    void ibv_ack_cq_events "fab_ibv_ack_cq_events"(ibv_cq* cq, unsigned int n)
    const char* ibv_wc_status_str "fab_ibv_wc_status_str"(int status)

cdef enum:
    BOOT_MAGIC = 0x56424946      # "FIBV"
    BOOT_SIZE = 40
    ST_BOOT = 1
    ST_READY = 2
    ST_RTS = 3                   # our QP is connected; the peer's may not be yet
    BOOT_READY_BYTE = 0x52       # "R": sent on the bootstrap socket once our QP is RTR
    SEND_DEPTH = 64              # SEND work requests in flight
    READ_DEPTH = 64              # RDMA READs in flight (the device caps them further)
    WRITE_DEPTH = 16             # RDMA WRITEs in flight (into the peer's posted buffers)
    STASH = 32
    EACCES_ = 13
    EIO_ = 5

cdef uint64_t WR_RECV = 1ULL << 63
cdef uint64_t WR_READ = 1ULL << 62
cdef uint64_t WR_WRITE = 1ULL << 61


cdef struct vb_domain:
    fab_hub hub                 # first: the engine's view (completion channel fd)
    ibv_context* ctx
    ibv_comp_channel* cc        # every CQ of the domain reports here
    int port
    int gid_index
    int is_eth
    int active_mtu
    uint8_t gid[16]
    uint16_t lid
    uint32_t max_rd_atomic
    int refs

cdef struct vb_deferred:
    boot_deferred link          # first: queued by the bootstrap until the QP is connected
    int n
    int inline_
    ibv_sge sge[16]

cdef struct vb_chan:
    fab_channel base
    vb_domain* dom
    ibv_pd* pd                  # the connection's own: its keys are valid on its QP only
    ibv_cq* cq
    ibv_qp* qp
    uint32_t max_inline
    uint32_t psn
    fab_boot boot               # the bootstrap socket, then the liveness monitor
    int state
    int ready_sent              # our BOOT_READY_BYTE is out
    int ready_heard             # the peer's is in
    unsigned int unacked
    char* rbuf
    ibv_mr* rmr
    uint32_t depth
    size_t slot
    uint32_t* repost
    uint32_t nrepost
    fab_regnode* mrs
    ibv_wc stash[STASH]
    int nstash
    uint32_t writes_out          # RDMA WRITEs posted and not completed

cdef fab_channel_ops VB_OPS
VB_OPS.send = vb_send
VB_OPS.reg = vb_reg
VB_OPS.dereg = vb_dereg
VB_OPS.read = vb_read
VB_OPS.write = vb_write
VB_OPS.send_large = NULL
VB_OPS.recv_large = NULL
VB_OPS.cancel_read = vb_cancel_read
VB_OPS.poll = vb_poll
VB_OPS.arm = vb_arm
VB_OPS.close = vb_close
VB_OPS.recycle = vb_recycle


cdef void domain_unref(vb_domain* d) noexcept nogil:
    if domain_unref_last(&d.refs):
        if d.cc != NULL:
            ibv_destroy_comp_channel(d.cc)
        ibv_close_device(d.ctx)
        free(d)


cdef int vb_hub_progress(fab_hub* hub) noexcept nogil:
    """Read the completion channel: each event names the CQ (and so the
    channel) that has completions; the engine then polls those channels."""
    cdef vb_domain* d = <vb_domain*>hub
    cdef ibv_cq* ev_cq
    cdef void* ev_ctx
    cdef vb_chan* ch
    cdef int n = 0
    while ibv_get_cq_event(d.cc, &ev_cq, &ev_ctx) == 0:
        ch = <vb_chan*>ev_ctx
        ch.unacked += 1
        hub_mark_ready(hub, &ch.base)
        n += 1
    if n:
        hub.activity += 1
    return n


cdef int vb_hub_arm(fab_hub* hub) noexcept nogil:
    return 0        # each channel re-arms its own CQ (vb_arm)


cdef class VerbsDomain:
    cdef vb_domain* d
    cdef int pid

    def __dealloc__(self):
        self.close()

    def close(self):
        """Drop the Fabric's reference (the device goes with the last channel).
        In a forked child it only forgets the parent's device."""
        if self.d != NULL:
            if self.pid == c_getpid():
                domain_unref(self.d)
            self.d = NULL

    @property
    def refs(self):
        """References held on the domain: its Fabric's, one per live channel
        and listener (leak and race checks)."""
        return self.d.refs if self.d != NULL else 0


# ------------------------------------------------------------- bootstrap

cdef int go_ready(vb_chan* ch) noexcept nogil:
    cdef vb_domain* d = ch.dom
    cdef const char* bin = ch.boot.head
    cdef uint32_t qpn = rd32(bin + 8), psn = rd32(bin + 12)
    cdef uint16_t lid
    cdef int mtu = <uint8_t>bin[34]
    cdef uint32_t peer_rd = rd32(bin + 36)
    cdef uint32_t rd = d.max_rd_atomic
    cdef int rc
    memcpy(&lid, bin + 32, 2)
    if rd32(bin) != BOOT_MAGIC or rd32(bin + 4) != 1 or mtu < 1 or mtu > 5:
        return fab_fail(&ch.base, EPROTO, "peer is not a fabric verbs endpoint (bad bootstrap)")
    if mtu > d.active_mtu:
        mtu = d.active_mtu          # path MTU: the smaller port MTU
    if peer_rd < rd:
        rd = peer_rd
    if rd < 1:
        rd = 1
    rc = fab_ib_qp_rtr(ch.qp, d.port, mtu, qpn, psn, <uint8_t*>(bin + 16), lid, d.gid_index,
                       d.is_eth, d.max_rd_atomic)
    if rc != 0:
        return fab_fail(&ch.base, rc, "moving the queue pair to RTR failed (GID/port choice?)")
    rc = fab_ib_qp_rts(ch.qp, ch.psn, rd)
    if rc != 0:
        return fab_fail(&ch.base, rc, "moving the queue pair to RTS failed")
    # Nothing may be sent until the peer's QP can receive it: a SEND that
    # reaches a QP not yet in RTR is dropped, and its retransmission waits for
    # the ACK timeout (268 ms here). So each side says on the socket once its
    # QP is ready, and posts only after hearing the peer's.
    ch.state = ST_RTS
    return ready_step(ch)

cdef int ready_step(vb_chan* ch) noexcept nogil:
    """Send our ready byte, take the peer's; then post the deferred sends."""
    cdef vb_deferred* dq
    cdef ssize_t r
    cdef char c = BOOT_READY_BYTE
    cdef int rc
    if not ch.ready_sent:
        r = send(ch.boot.sock, &c, 1, MSG_DONTWAIT | MSG_NOSIGNAL)
        if r == 1:
            ch.ready_sent = 1
        elif errno != EAGAIN and errno != EINTR:
            return fab_fail(&ch.base, errno, "bootstrap send")
    if not ch.ready_heard:
        r = recv(ch.boot.sock, &c, 1, MSG_DONTWAIT)
        if r == 0:
            return fab_fail(&ch.base, ECONNRESET, "peer closed the bootstrap connection")
        if r < 0:
            if errno == EAGAIN or errno == EINTR:
                return 0
            return fab_fail(&ch.base, errno, "bootstrap recv")
        if c != BOOT_READY_BYTE:
            return fab_fail(&ch.base, EPROTO, "peer is not a fabric verbs endpoint (bad bootstrap)")
        ch.ready_heard = 1
    if not ch.ready_sent:
        return 0                  # ours goes when the socket takes it (vb_arm asks for EPOLLOUT)
    ch.state = ST_READY
    dq = <vb_deferred*>boot_next_deferred(&ch.boot)
    while dq != NULL:
        rc = fab_ib_post_send(ch.qp, dq.sge, dq.n, dq.link.ctx, dq.inline_)
        free(dq)
        if rc != 0:
            return fab_fail(&ch.base, rc, "ibv_post_send")
        dq = <vb_deferred*>boot_next_deferred(&ch.boot)
    return 0

cdef int boot_step(vb_chan* ch) noexcept nogil:
    """Exchange the fixed-size bootstrap messages; connect the QP once both
    are through. 0, or -errno."""
    cdef int rc
    if ch.state == ST_RTS:
        return ready_step(ch)
    rc = boot_progress(&ch.boot, &ch.base, NULL)
    if rc <= 0:
        return rc
    boot_release(&ch.boot)      # the peer's message stays in boot.head
    return go_ready(ch)


# ------------------------------------------------------------ operations

cdef int vb_send(fab_channel* fch, iovec* iov, fab_mr** mrs, int iovcnt, uint64_t ctx) noexcept nogil:
    cdef vb_chan* ch = <vb_chan*>fch
    cdef ibv_sge sge[16]
    cdef size_t total = 0
    cdef int i, n = 0, inl, rc
    cdef vb_deferred* dq
    if fch.failed:
        return -fch.failed
    if iovcnt > 16:
        return -EINVAL
    for i in range(iovcnt):
        if iov[i].iov_len == 0:
            continue
        sge[n].addr = <uint64_t><size_t>iov[i].iov_base
        sge[n].length = <uint32_t>iov[i].iov_len
        sge[n].lkey = (<ibv_mr*>(<fab_regnode*>mrs[i].handle).handle).lkey if mrs != NULL and mrs[i] != NULL else 0
        total += iov[i].iov_len
        n += 1
    inl = total <= ch.max_inline
    if not inl and mrs == NULL:
        return -EINVAL           # the engine registers what it sends here
    if ch.state != ST_READY:
        dq = <vb_deferred*>boot_defer(&ch.boot, sizeof(vb_deferred), ctx)
        if dq == NULL:
            return fab_fail(fch, ENOMEM, "send")
        dq.n = n
        dq.inline_ = inl
        memcpy(dq.sge, sge, n * sizeof(ibv_sge))
        return FAB_PENDING
    rc = fab_ib_post_send(ch.qp, sge, n, ctx, inl)
    if rc != 0:
        return fab_fail(fch, rc, "ibv_post_send")
    return FAB_PENDING           # completes when the peer acknowledged it

cdef int vb_reg(fab_channel* fch, void* addr, size_t length, fab_mr* mr, int remote) noexcept nogil:
    cdef vb_chan* ch = <vb_chan*>fch
    cdef fab_regnode* node
    if fch.failed or ch.pd == NULL:
        return -(fch.failed or EIO_)     # a channel that failed while being set up has no PD
    node = <fab_regnode*>calloc(1, sizeof(fab_regnode))
    if node == NULL:
        return -ENOMEM
    # only a rendezvous chunk is readable by the peer and only a posted receive
    # buffer writable by it; slabs, HELLO and pull destinations are our own
    cdef int access = IBV_ACCESS_LOCAL_WRITE
    if remote == FAB_REG_READ:
        access |= IBV_ACCESS_REMOTE_READ
    elif remote == FAB_REG_WRITE:
        access |= IBV_ACCESS_REMOTE_WRITE
    cdef ibv_mr* ib = ibv_reg_mr(ch.pd, addr, length, access)
    if ib == NULL:
        free(node)
        return -(errno if errno else ENOMEM)
    node.handle = ib
    mr.handle = node
    mr.addr = <uint64_t><size_t>addr
    mr.length = length
    mr.rkey_len = 4
    memcpy(mr.rkey, &ib.rkey, 4)
    reglist_push(&ch.mrs, node)
    fch.live_regions += 1
    return FAB_DONE

cdef void vb_dereg(fab_channel* fch, fab_mr* mr) noexcept nogil:
    cdef vb_chan* ch = <vb_chan*>fch
    cdef fab_regnode* node = <fab_regnode*>mr.handle
    if node == NULL:
        return
    reglist_unlink(&ch.mrs, node)
    ibv_dereg_mr(<ibv_mr*>node.handle)
    free(node)
    mr.handle = NULL
    fch.live_regions -= 1

cdef int vb_read(fab_channel* fch, void* dst, fab_mr* dst_mr, size_t length, uint64_t raddr,
                 uint8_t* rkey, uint32_t rkey_len, uint64_t ctx) noexcept nogil:
    cdef vb_chan* ch = <vb_chan*>fch
    cdef uint32_t key
    cdef int rc
    if fch.failed:
        return -fch.failed
    if rkey_len != 4 or dst_mr == NULL or dst_mr.handle == NULL or length > 0xFFFFFFFFUL:
        return -EINVAL
    memcpy(&key, rkey, 4)
    rc = fab_ib_post_read(ch.qp, <uint64_t><size_t>dst, <uint32_t>length,
                          (<ibv_mr*>(<fab_regnode*>dst_mr.handle).handle).lkey, raddr, key, ctx | WR_READ)
    if rc != 0:
        return fab_fail(fch, rc, "ibv_post_send (RDMA READ)")
    return FAB_PENDING

cdef int vb_write(fab_channel* fch, void* src, fab_mr* src_mr, size_t length, uint64_t raddr,
                  uint8_t* rkey, uint32_t rkey_len, uint64_t ctx) noexcept nogil:
    """RDMA WRITE into the peer's posted buffer. The SEND of the PUT frame
    posted after it on this QP completes at the peer only once these bytes
    are placed (RC executes a QP's requests in order)."""
    cdef vb_chan* ch = <vb_chan*>fch
    cdef uint32_t key
    cdef int rc
    if fch.failed:
        return -fch.failed
    if rkey_len != 4 or src_mr == NULL or src_mr.handle == NULL or length > 0x7FFFFFFFUL:
        return -EINVAL
    if ch.writes_out >= WRITE_DEPTH or ch.qp == NULL or ch.state == ST_BOOT:
        return -EAGAIN
    memcpy(&key, rkey, 4)
    rc = fab_ib_post_write(ch.qp, <uint64_t><size_t>src, <uint32_t>length,
                           (<ibv_mr*>(<fab_regnode*>src_mr.handle).handle).lkey, raddr, key, ctx | WR_WRITE)
    if rc != 0:
        return fab_fail(fch, rc, "ibv_post_send (RDMA WRITE)")
    ch.writes_out += 1
    return FAB_PENDING

cdef int vb_cancel_read(fab_channel* fch, uint64_t ctx) noexcept nogil:
    return 1        # an RDMA READ cannot be withdrawn: wait for it

cdef int emit_wc(vb_chan* ch, ibv_wc* wc, fab_completion* out, int n) noexcept nogil:
    cdef uint32_t slot
    if wc.wr_id & WR_RECV:
        slot = <uint32_t>(wc.wr_id & 0xFFFFFFFFU)
        ch.repost[ch.nrepost] = slot
        ch.nrepost += 1
        if wc.status != IBV_WC_SUCCESS:
            fab_fail(&ch.base, ECONNRESET, ibv_wc_status_str(wc.status))
            return n
        out[n].kind = FAB_EV_RECV
        out[n].status = 0
        out[n].ctx = 0
        out[n].data = ch.rbuf + slot * ch.slot
        out[n].length = wc.byte_len
        return n + 1
    if wc.wr_id & WR_READ:
        out[n].kind = FAB_EV_READ
        out[n].status = 0 if wc.status == IBV_WC_SUCCESS else -13
        out[n].ctx = wc.wr_id & ~WR_READ
        out[n].data = NULL
        out[n].length = 0
        if wc.status != IBV_WC_SUCCESS:
            # the QP is in error now: this read fails, and so does the connection
            fab_fail(&ch.base, ECONNRESET if wc.status != IBV_WC_REM_ACCESS_ERR else EACCES_,
                     ibv_wc_status_str(wc.status))
        return n + 1
    if wc.wr_id & WR_WRITE:
        ch.writes_out -= 1
        out[n].kind = FAB_EV_WRITE
        out[n].status = 0 if wc.status == IBV_WC_SUCCESS else -13
        out[n].ctx = wc.wr_id & ~WR_WRITE
        out[n].data = NULL
        out[n].length = 0
        if wc.status != IBV_WC_SUCCESS:
            fab_fail(&ch.base, ECONNRESET if wc.status != IBV_WC_REM_ACCESS_ERR else EACCES_,
                     ibv_wc_status_str(wc.status))
        return n + 1
    if wc.status != IBV_WC_SUCCESS:
        fab_fail(&ch.base, ECONNRESET, ibv_wc_status_str(wc.status))
        return n
    out[n].kind = FAB_EV_SEND
    out[n].status = 0
    out[n].ctx = wc.wr_id
    out[n].data = NULL
    out[n].length = 0
    return n + 1

cdef void vb_recycle(fab_channel* fch) noexcept nogil:
    """Receive buffers handed out by the last poll go back to the receive
    queue. The engine calls this before it returns their credits: only
    credits + 1 buffers are posted, and a peer that used a returned credit
    before the buffer was back would meet an RNR NAK (and a wait of
    min_rnr_timer)."""
    cdef vb_chan* ch = <vb_chan*>fch
    cdef uint32_t k
    for k in range(ch.nrepost):
        if fab_ib_post_recv(ch.qp, <uint64_t><size_t>(ch.rbuf + ch.repost[k] * ch.slot), <uint32_t>ch.slot,
                            ch.rmr.lkey, WR_RECV | ch.repost[k]) != 0 and not fch.failed:
            fab_fail(fch, EIO_, "ibv_post_recv")
    ch.nrepost = 0

cdef int vb_poll(fab_channel* fch, fab_completion* out, int max_events) noexcept nogil:
    cdef vb_chan* ch = <vb_chan*>fch
    cdef ibv_wc wc[32]
    cdef int n = 0, got, i, want
    cdef ibv_cq* ev_cq
    cdef void* ev_ctx
    # (what the engine did not recycle after the previous poll)
    vb_recycle(fch)
    if (ch.state == ST_BOOT or ch.state == ST_RTS) and not fch.failed:
        boot_step(ch)
    if ch.unacked >= 16:
        ibv_ack_cq_events(ch.cq, ch.unacked)
        ch.unacked = 0
    for i in range(ch.nstash):
        if n < max_events:
            n = emit_wc(ch, &ch.stash[i], out, n)
    ch.nstash = 0
    while n < max_events:
        want = max_events - n
        if want > 32:
            want = 32
        got = ibv_poll_cq(ch.cq, want, wc)
        if got <= 0:
            break
        fch.activity += 1
        for i in range(got):
            n = emit_wc(ch, &wc[i], out, n)
    boot_watch(&ch.boot, fch, ch.state == ST_READY)
    if ch.boot.peer_gone and n == 0 and not fch.failed:
        boot_fail_gone(&ch.boot, fch)
    if fch.failed and n < max_events:
        out[n].kind = FAB_EV_FAILED
        out[n].status = -fch.failed
        out[n].ctx = 0
        out[n].data = NULL
        out[n].length = 0
        n += 1
    return n

cdef int vb_arm(fab_channel* fch, uint32_t* events) noexcept nogil:
    """Ask for the CQ's next event (it comes through the hub) and name the
    socket's events: the peer going away, or the bootstrap."""
    cdef vb_chan* ch = <vb_chan*>fch
    cdef int got
    if fch.failed or ch.boot.peer_gone or ch.nstash > 0 or ch.nrepost > 0:
        return 1
    ibv_req_notify_cq(ch.cq, 0)
    # a completion that arrived before the request would not be signalled
    got = ibv_poll_cq(ch.cq, STASH, ch.stash)
    if got > 0:
        ch.nstash = got
        return 1
    events[0] = boot_events(&ch.boot)
    if ch.state == ST_RTS and not ch.ready_sent:
        events[0] |= EPOLLOUT
    return 0

cdef void vb_close(fab_channel* fch) noexcept nogil:
    cdef vb_chan* ch = <vb_chan*>fch
    cdef fab_regnode* node
    if ch.qp != NULL:
        fab_ib_qp_error(ch.qp)
        ibv_destroy_qp(ch.qp)      # no access to our memory after this
    hub_unready(&ch.dom.hub, fch)
    if ch.unacked:
        ibv_ack_cq_events(ch.cq, ch.unacked)
    if ch.cq != NULL:
        ibv_destroy_cq(ch.cq)
    while ch.mrs != NULL:
        node = ch.mrs
        ch.mrs = node.next
        ibv_dereg_mr(<ibv_mr*>node.handle)
        free(node)
    if ch.rmr != NULL:
        ibv_dereg_mr(ch.rmr)
    if ch.pd != NULL:
        ibv_dealloc_pd(ch.pd)      # after its QP and every registration in it
    free(ch.rbuf)
    free(ch.repost)
    boot_close(&ch.boot, fch)
    domain_unref(ch.dom)
    free(ch)


# ----------------------------------------------------------------- set-up

cdef fab_channel* new_channel(void* domain, int sock, size_t max_recv, uint32_t depth,
                              const char* host) noexcept nogil:
    """A channel in bootstrap on a connected socket (dialled or accepted); a
    failed one if its resources cannot be had; NULL, sock closed, if none."""
    cdef vb_domain* d = <vb_domain*>domain
    cdef vb_chan* ch = <vb_chan*>calloc(1, sizeof(vb_chan))
    cdef uint32_t i, psn = 0
    cdef char* out
    if ch == NULL:
        close(sock)
        return NULL
    ch.base.ops = &VB_OPS
    ch.base.hub = &d.hub
    ch.base.caps = FAB_CAP_NATIVE_READ | FAB_CAP_NATIVE_WRITE | FAB_CAP_ORDERED_WRITE
    ch.base.max_recv = max_recv
    ch.base.recv_depth = depth
    ch.base.send_depth = SEND_DEPTH
    ch.dom = d
    domain_ref(&d.refs)
    ch.state = ST_BOOT
    boot_init(&ch.boot, &ch.base, sock, BOOT_SIZE)
    ch.slot = max_recv
    ch.depth = depth
    ch.rbuf = <char*>malloc(depth * max_recv)
    ch.repost = <uint32_t*>malloc(depth * sizeof(uint32_t))
    if ch.rbuf == NULL or ch.repost == NULL:
        fab_fail(&ch.base, ENOMEM, "cannot set up the connection")
        return &ch.base
    ch.cq = ibv_create_cq(d.ctx, <int>(depth + SEND_DEPTH + READ_DEPTH + WRITE_DEPTH + 16), <void*>ch, d.cc, 0)
    if ch.cq == NULL:
        fab_fail(&ch.base, errno if errno else ENOMEM, "ibv_create_cq")
        return &ch.base
    # A protection domain per connection: a remote key works only on QPs of
    # its PD, so a key announced on one connection is useless on another
    # (the device checks it; one PD per Fabric would accept it on any QP)
    ch.pd = ibv_alloc_pd(d.ctx)
    if ch.pd == NULL:
        fab_fail(&ch.base, errno if errno else ENOMEM, "ibv_alloc_pd")
        return &ch.base
    ch.qp = fab_ib_create_qp(ch.pd, ch.cq, SEND_DEPTH + READ_DEPTH + WRITE_DEPTH, depth, 256, &ch.max_inline)
    if ch.qp == NULL:
        fab_fail(&ch.base, errno if errno else ENOMEM, "ibv_create_qp")
        return &ch.base
    ch.rmr = ibv_reg_mr(ch.pd, ch.rbuf, depth * max_recv, IBV_ACCESS_LOCAL_WRITE)
    if ch.rmr == NULL or fab_ib_qp_init(ch.qp, d.port) != 0:
        fab_fail(&ch.base, errno if errno else EIO_, "preparing the queue pair")
        return &ch.base
    # every receive is posted before the peer learns our QP number
    for i in range(depth):
        if fab_ib_post_recv(ch.qp, <uint64_t><size_t>(ch.rbuf + i * max_recv), <uint32_t>max_recv,
                            ch.rmr.lkey, WR_RECV | i) != 0:
            fab_fail(&ch.base, EIO_, "ibv_post_recv")
            return &ch.base
    getrandom(&psn, sizeof(psn), 0)
    ch.psn = psn & 0xFFFFFF
    out = boot_message(&ch.boot, &ch.base, BOOT_SIZE)
    if out == NULL:
        return &ch.base
    wr32(out, BOOT_MAGIC)
    wr32(out + 4, 1)
    wr32(out + 8, ch.qp.qp_num)
    wr32(out + 12, ch.psn)
    memcpy(out + 16, d.gid, 16)
    memcpy(out + 32, &d.lid, 2)
    out[34] = <char>d.active_mtu
    out[35] = 0
    wr32(out + 36, d.max_rd_atomic)
    boot_step(ch)
    return &ch.base


cdef void unref_domain(void* d) noexcept nogil:
    domain_unref(<vb_domain*>d)


# --------------------------------------------------- device, port and GID

def load_libibverbs():
    """None once the host's libibverbs.so.1 is loaded, else why it is not
    (verbs_shim.h: the extension links no libibverbs of its own)."""
    cdef char why[512]
    if fab_ibv_load(why, sizeof(why)) == 0:
        return None
    return why.decode(errors="replace")


SYS = "/sys/class/infiniband"


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _is_rxe(sys_dir, dev):
    """Soft-RoCE devices have no PCI parent and report the rxe driver."""
    parent = _read(f"{sys_dir}/{dev}/parent")
    return dev.startswith("rxe") or (parent is not None and not os.path.exists(f"{sys_dir}/{dev}/device"))


def select_device(env=None, rxe_only=False, root=None):
    """(device, port, gid_index, link_layer) by the documented rule, or raise
    LookupError naming what was tried. `root` replaces /sys/class/infiniband
    (tests)."""
    env = os.environ if env is None else env
    SYS = root or globals()["SYS"]
    if not os.path.isdir(SYS) or not os.listdir(SYS):
        raise LookupError("no RDMA device: /sys/class/infiniband is empty or absent (this kernel has no "
                          "RDMA driver; Soft-RoCE needs rdma_rxe: run under tools/softroce.py)")
    want_dev = env.get("FABRIC_VERBS_DEVICE")
    want_port = env.get("FABRIC_VERBS_PORT")
    want_gid = env.get("FABRIC_VERBS_GID_INDEX")
    tried = []
    for dev in sorted(os.listdir(SYS)):
        if want_dev and dev != want_dev:
            continue
        if rxe_only and not _is_rxe(SYS, dev):
            tried.append(f"{dev}: not an rxe device")
            continue
        ports = sorted(os.listdir(f"{SYS}/{dev}/ports"), key=int)
        for port in ports:
            if want_port and port != want_port:
                continue
            state = _read(f"{SYS}/{dev}/ports/{port}/state") or "?"
            if "ACTIVE" not in state:
                tried.append(f"{dev} port {port}: state {state}")
                continue
            link = _read(f"{SYS}/{dev}/ports/{port}/link_layer") or "InfiniBand"
            if link != "Ethernet":
                return dev, int(port), int(want_gid or 0), link
            gids = sorted(os.listdir(f"{SYS}/{dev}/ports/{port}/gids"), key=int)
            for idx in gids:
                if want_gid is not None and idx != want_gid:
                    continue
                gid = _read(f"{SYS}/{dev}/ports/{port}/gids/{idx}") or ""
                gtype = _read(f"{SYS}/{dev}/ports/{port}/gid_attrs/types/{idx}") or "?"
                if want_gid is not None:
                    return dev, int(port), int(idx), link
                if gtype == "RoCE v2" and gid.startswith("0000:0000:0000:0000:0000:ffff:"):
                    return dev, int(port), int(idx), link
            tried.append(f"{dev} port {port}: no RoCE v2 GID with an IPv4 address "
                         f"(set FABRIC_VERBS_GID_INDEX)")
    if not tried:
        tried.append("no device matched FABRIC_VERBS_DEVICE/FABRIC_VERBS_PORT")
    raise LookupError("no usable RDMA port; tried: " + "; ".join(tried))


cdef class VerbsBackend(Backend):
    """RC queue pairs over libibverbs: SEND/RECV for frames, RDMA READ for pulls."""
    cdef public bint rxe_only

    def __init__(self):
        self.name = "verbs"
        self.caps = FAB_CAP_NATIVE_READ | FAB_CAP_NATIVE_WRITE | FAB_CAP_ORDERED_WRITE
        self.rxe_only = False

    def default_options(self):
        # Measured on rxe0 in the QEMU guest (bench/RESULTS.md): eager SENDs
        # up to 64 KiB beat a rendezvous there (one round trip less per
        # message, and larger coalescing buffers: 2.7x the small-message rate).
        return {"eager_limit": 65536, "chunk_size": 1 << 20, "chunks_in_flight": 4,
                "coalesce_limit": 65536 + 4096, "credits": 32}

    @staticmethod
    def available():
        why = load_libibverbs()
        if why is not None:
            return False, why
        try:
            dev, port, gid, link = select_device()
        except LookupError as e:
            return False, str(e)
        return True, f"{dev} port {port} ({link}, GID index {gid})"

    def for_softroce(self):
        try:
            select_device(rxe_only=True)
        except LookupError as e:
            from fabric.errors import BackendUnavailable
            raise BackendUnavailable(f"backend 'softroce' needs an rxe device: {e}") from None
        b = VerbsBackend()
        b.rxe_only = True
        return b

    def open_domain(self, dict options):
        cdef VerbsDomain dom = VerbsDomain.__new__(VerbsDomain)
        cdef vb_domain* d
        cdef int rc
        why = load_libibverbs()
        if why is not None:
            from fabric.errors import BackendUnavailable
            raise BackendUnavailable(f"backend 'verbs' is unavailable: {why}")
        dev, port, gid_index, link = select_device(rxe_only=self.rxe_only)
        d = <vb_domain*>calloc(1, sizeof(vb_domain))
        if d == NULL:
            raise MemoryError()
        bname = dev.encode()
        d.ctx = fab_ib_open(bname)
        if d.ctx == NULL:
            free(d)
            raise OSError(f"cannot open RDMA device {dev}")
        d.cc = ibv_create_comp_channel(d.ctx)
        if d.cc == NULL:
            ibv_close_device(d.ctx)
            free(d)
            raise OSError(f"cannot create a completion channel on {dev}")
        fcntl(d.cc.fd, F_SETFL, fcntl(d.cc.fd, F_GETFL) | O_NONBLOCK)
        d.hub.fd = d.cc.fd
        d.hub.progress = vb_hub_progress
        d.hub.arm = vb_hub_arm
        d.port = port
        d.gid_index = gid_index
        d.refs = 1
        dom.d = d
        dom.pid = os.getpid()
        rc = fab_ib_port(d.ctx, port, gid_index, d.gid, &d.lid, &d.active_mtu, &d.is_eth, &d.max_rd_atomic)
        if rc != 0:
            raise OSError(rc, f"cannot query {dev} port {port} GID {gid_index}")
        if d.max_rd_atomic > 16:
            d.max_rd_atomic = 16
        return dom

    cdef fab_listener* listen(self, object domain, str host, int port, dict options) except NULL:
        cdef vb_domain* d = (<VerbsDomain?>domain).d
        return boot_listen(host, port, d, &d.refs, recv_depth_for(options), new_channel, unref_domain)

    cdef fab_hub* hub(self, object domain) except? NULL:
        return &(<VerbsDomain?>domain).d.hub

    cdef int prepare_attach(self, object domain, dict options, fab_attach* out) except -1:
        out.attach = new_channel
        out.domain = (<VerbsDomain?>domain).d
        out.recv_depth = recv_depth_for(options)
        return 0

