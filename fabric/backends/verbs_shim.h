/* libibverbs for the verbs backend, loaded at run time, and thin wrappers
 * over the calls whose structs hold unions (work requests, QP attributes).
 *
 * The extension links no libibverbs: fab_ibv_load() dlopens the host's
 * libibverbs.so.1, so one build (one wheel) imports on a host without
 * rdma-core (verbs then says why it is unavailable) and, where rdma-core is
 * installed, uses that copy and the provider drivers it finds. A copy grafted
 * into a wheel would not see the host's providers. Only the header (the ABI)
 * is needed at build time. Each symbol is looked up at the version the header
 * describes, so a future ABI change behind a new symbol version is not
 * called with today's structs. The data-path calls (post, poll, notify) are
 * inline in verbs.h and go through the context's ops: no symbol at all. */
#ifndef FABRIC_VERBS_SHIM_H
#define FABRIC_VERBS_SHIM_H

#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <infiniband/verbs.h>

static struct fab_ibv_table {
    void *lib;
    struct ibv_device **(*get_device_list)(int *);
    void (*free_device_list)(struct ibv_device **);
    const char *(*get_device_name)(struct ibv_device *);
    struct ibv_context *(*open_device)(struct ibv_device *);
    int (*close_device)(struct ibv_context *);
    int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
    int (*query_port)(struct ibv_context *, uint8_t, struct _compat_ibv_port_attr *);
    int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
    struct ibv_pd *(*alloc_pd)(struct ibv_context *);
    int (*dealloc_pd)(struct ibv_pd *);
    struct ibv_comp_channel *(*create_comp_channel)(struct ibv_context *);
    int (*destroy_comp_channel)(struct ibv_comp_channel *);
    struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
    int (*destroy_cq)(struct ibv_cq *);
    struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
    int (*destroy_qp)(struct ibv_qp *);
    struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
    int (*dereg_mr)(struct ibv_mr *);
    int (*get_cq_event)(struct ibv_comp_channel *, struct ibv_cq **, void **);
    void (*ack_cq_events)(struct ibv_cq *, unsigned int);
    const char *(*wc_status_str)(enum ibv_wc_status);
} fab_ibv;

/* 0 once libibverbs is loaded (idempotent); else -1 and `why` says what failed. */
static int fab_ibv_load(char *why, size_t why_len)
{
    static const struct { const char *name, *version; size_t offset; } syms[] = {
#define FAB_SYM(field, version) {"ibv_" #field, version, offsetof(struct fab_ibv_table, field)}
        FAB_SYM(get_device_list, "IBVERBS_1.1"), FAB_SYM(free_device_list, "IBVERBS_1.1"),
        FAB_SYM(get_device_name, "IBVERBS_1.1"), FAB_SYM(open_device, "IBVERBS_1.1"),
        FAB_SYM(close_device, "IBVERBS_1.1"), FAB_SYM(query_device, "IBVERBS_1.1"),
        FAB_SYM(query_port, "IBVERBS_1.1"), FAB_SYM(query_gid, "IBVERBS_1.1"),
        FAB_SYM(alloc_pd, "IBVERBS_1.1"), FAB_SYM(dealloc_pd, "IBVERBS_1.1"),
        FAB_SYM(create_comp_channel, "IBVERBS_1.0"), FAB_SYM(destroy_comp_channel, "IBVERBS_1.0"),
        FAB_SYM(create_cq, "IBVERBS_1.1"), FAB_SYM(destroy_cq, "IBVERBS_1.1"),
        FAB_SYM(create_qp, "IBVERBS_1.1"), FAB_SYM(modify_qp, "IBVERBS_1.1"),
        FAB_SYM(destroy_qp, "IBVERBS_1.1"), FAB_SYM(reg_mr, "IBVERBS_1.1"),
        FAB_SYM(dereg_mr, "IBVERBS_1.1"), FAB_SYM(get_cq_event, "IBVERBS_1.1"),
        FAB_SYM(ack_cq_events, "IBVERBS_1.1"), FAB_SYM(wc_status_str, "IBVERBS_1.1"),
#undef FAB_SYM
    };
    void *lib;
    size_t i;
    const char *err;
    if (fab_ibv.lib != NULL)
        return 0;
    lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        err = dlerror();
        snprintf(why, why_len, "cannot load libibverbs.so.1 (%s): install rdma-core's libibverbs "
                 "(apt install libibverbs1 ibverbs-providers)", err ? err : "not found");
        return -1;
    }
    for (i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        void *fn = dlvsym(lib, syms[i].name, syms[i].version);
        if (fn == NULL) {
            snprintf(why, why_len, "the host's libibverbs.so.1 has no %s@%s (rdma-core too old?)",
                     syms[i].name, syms[i].version);
            dlclose(lib);
            return -1;
        }
        memcpy((char *)&fab_ibv + syms[i].offset, &fn, sizeof(fn));
    }
    fab_ibv.lib = lib;
    return 0;
}

/* verbs.h's ibv_query_port, through the loaded table: newer providers answer
 * through the extended context, older ones through the exported call */
static inline int fab_ibv_query_port(struct ibv_context *ctx, uint8_t port, struct ibv_port_attr *pa)
{
    struct verbs_context *vctx = verbs_get_ctx_op(ctx, query_port);
    if (vctx != NULL)
        return vctx->query_port(ctx, port, pa, sizeof(*pa));
    memset(pa, 0, sizeof(*pa));
    return fab_ibv.query_port(ctx, port, (struct _compat_ibv_port_attr *)pa);
}

/* verbs.pyx calls these under the names below (see its extern block) */
#define fab_ibv_alloc_pd(ctx) fab_ibv.alloc_pd(ctx)
#define fab_ibv_dealloc_pd(pd) fab_ibv.dealloc_pd(pd)
#define fab_ibv_close_device(ctx) fab_ibv.close_device(ctx)
#define fab_ibv_create_comp_channel(ctx) fab_ibv.create_comp_channel(ctx)
#define fab_ibv_destroy_comp_channel(cc) fab_ibv.destroy_comp_channel(cc)
#define fab_ibv_create_cq(ctx, n, c, cc, v) fab_ibv.create_cq(ctx, n, c, cc, v)
#define fab_ibv_destroy_cq(cq) fab_ibv.destroy_cq(cq)
#define fab_ibv_destroy_qp(qp) fab_ibv.destroy_qp(qp)
#define fab_ibv_reg_mr(pd, a, n, acc) fab_ibv.reg_mr(pd, a, n, acc)
#define fab_ibv_dereg_mr(mr) fab_ibv.dereg_mr(mr)
#define fab_ibv_get_cq_event(cc, cq, c) fab_ibv.get_cq_event(cc, cq, c)
#define fab_ibv_ack_cq_events(cq, n) fab_ibv.ack_cq_events(cq, n)
#define fab_ibv_wc_status_str(st) fab_ibv.wc_status_str((enum ibv_wc_status)(st))

static inline struct ibv_context *fab_ib_open(const char *name)
{
    int n, i;
    struct ibv_context *ctx = NULL;
    struct ibv_device **list = fab_ibv.get_device_list(&n);
    if (list == NULL)
        return NULL;
    for (i = 0; i < n; i++)
        if (strcmp(fab_ibv.get_device_name(list[i]), name) == 0) {
            ctx = fab_ibv.open_device(list[i]);
            break;
        }
    fab_ibv.free_device_list(list);
    return ctx;
}

static inline int fab_ib_port(struct ibv_context *ctx, int port, int gid_index, uint8_t *gid16,
                              uint16_t *lid, int *active_mtu, int *is_eth, uint32_t *max_rd_atomic)
{
    struct ibv_port_attr pa;
    struct ibv_device_attr da;
    union ibv_gid gid;
    int rc;
    if ((rc = fab_ibv_query_port(ctx, (uint8_t)port, &pa)) != 0)
        return rc;
    if ((rc = fab_ibv.query_device(ctx, &da)) != 0)
        return rc;
    if ((rc = fab_ibv.query_gid(ctx, (uint8_t)port, gid_index, &gid)) != 0)
        return rc;
    memcpy(gid16, gid.raw, 16);
    *lid = pa.lid;
    *active_mtu = pa.active_mtu;
    *is_eth = pa.link_layer == IBV_LINK_LAYER_ETHERNET;
    *max_rd_atomic = (uint32_t)da.max_qp_rd_atom;
    return 0;
}

static inline struct ibv_qp *fab_ib_create_qp(struct ibv_pd *pd, struct ibv_cq *cq, uint32_t max_send,
                                              uint32_t max_recv, uint32_t max_inline, uint32_t *inline_out)
{
    struct ibv_qp_init_attr a;
    struct ibv_qp *qp;
    memset(&a, 0, sizeof(a));
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = IBV_QPT_RC;
    a.cap.max_send_wr = max_send;
    a.cap.max_recv_wr = max_recv;
    a.cap.max_send_sge = 16;
    a.cap.max_recv_sge = 1;
    a.cap.max_inline_data = max_inline;
    qp = fab_ibv.create_qp(pd, &a);
    if (qp == NULL && max_inline) {
        a.cap.max_inline_data = 0;
        qp = fab_ibv.create_qp(pd, &a);
    }
    if (qp)
        *inline_out = a.cap.max_inline_data;
    return qp;
}

static inline int fab_ib_qp_init(struct ibv_qp *qp, int port)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = (uint8_t)port;
    /* what a peer may do is decided per region (its MR's access flags): read
     * a rendezvous chunk, write into a receive buffer posted to it */
    a.qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_LOCAL_WRITE;
    return fab_ibv.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static inline int fab_ib_qp_rtr(struct ibv_qp *qp, int port, int mtu, uint32_t dest_qpn, uint32_t dest_psn,
                                const uint8_t *dest_gid, uint16_t dest_lid, int gid_index, int is_eth,
                                uint32_t max_dest_rd_atomic)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = (enum ibv_mtu)mtu;
    a.dest_qp_num = dest_qpn;
    a.rq_psn = dest_psn;
    a.max_dest_rd_atomic = (uint8_t)max_dest_rd_atomic;
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = (uint8_t)port;
    a.ah_attr.dlid = dest_lid;
    if (is_eth) {
        a.ah_attr.is_global = 1;
        memcpy(a.ah_attr.grh.dgid.raw, dest_gid, 16);
        a.ah_attr.grh.sgid_index = (uint8_t)gid_index;
        a.ah_attr.grh.hop_limit = 64;
    }
    return fab_ibv.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                         IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

static inline int fab_ib_qp_rts(struct ibv_qp *qp, uint32_t psn, uint32_t max_rd_atomic)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = psn;
    /* a dead peer must become an error, not a hang: 4.096 us * 2^16 = 268 ms
     * per try, 7 tries */
    a.timeout = 16;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = (uint8_t)max_rd_atomic;
    return fab_ibv.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                         IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

static inline int fab_ib_qp_error(struct ibv_qp *qp)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_ERR;
    return fab_ibv.modify_qp(qp, &a, IBV_QP_STATE);
}

static inline int fab_ib_post_send(struct ibv_qp *qp, struct ibv_sge *sge, int n, uint64_t wr_id, int inline_)
{
    struct ibv_send_wr wr, *bad;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.sg_list = sge;
    wr.num_sge = n;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED | (inline_ ? IBV_SEND_INLINE : 0);
    return ibv_post_send(qp, &wr, &bad);
}

static inline int fab_ib_post_read(struct ibv_qp *qp, uint64_t laddr, uint32_t length, uint32_t lkey,
                                   uint64_t raddr, uint32_t rkey, uint64_t wr_id)
{
    struct ibv_sge sge;
    struct ibv_send_wr wr, *bad;
    sge.addr = laddr;
    sge.length = length;
    sge.lkey = lkey;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_READ;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    return ibv_post_send(qp, &wr, &bad);
}

static inline int fab_ib_post_write(struct ibv_qp *qp, uint64_t laddr, uint32_t length, uint32_t lkey,
                                    uint64_t raddr, uint32_t rkey, uint64_t wr_id)
{
    struct ibv_sge sge;
    struct ibv_send_wr wr, *bad;
    sge.addr = laddr;
    sge.length = length;
    sge.lkey = lkey;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_RDMA_WRITE;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    return ibv_post_send(qp, &wr, &bad);
}

static inline int fab_ib_post_recv(struct ibv_qp *qp, uint64_t addr, uint32_t length, uint32_t lkey, uint64_t wr_id)
{
    struct ibv_sge sge;
    struct ibv_recv_wr wr, *bad;
    sge.addr = addr;
    sge.length = length;
    sge.lkey = lkey;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    return ibv_post_recv(qp, &wr, &bad);
}

#endif
