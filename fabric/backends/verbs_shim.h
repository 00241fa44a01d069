/* Thin wrappers over libibverbs calls whose structs hold unions (work
 * requests, QP attributes), for the verbs backend. Each returns 0 or an errno. */
#ifndef FABRIC_VERBS_SHIM_H
#define FABRIC_VERBS_SHIM_H

#include <errno.h>
#include <string.h>
#include <infiniband/verbs.h>

static inline struct ibv_context *fab_ib_open(const char *name)
{
    int n, i;
    struct ibv_context *ctx = NULL;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (list == NULL)
        return NULL;
    for (i = 0; i < n; i++)
        if (strcmp(ibv_get_device_name(list[i]), name) == 0) {
            ctx = ibv_open_device(list[i]);
            break;
        }
    ibv_free_device_list(list);
    return ctx;
}

static inline int fab_ib_port(struct ibv_context *ctx, int port, int gid_index, uint8_t *gid16,
                              uint16_t *lid, int *active_mtu, int *is_eth, uint32_t *max_rd_atomic)
{
    struct ibv_port_attr pa;
    struct ibv_device_attr da;
    union ibv_gid gid;
    int rc;
    if ((rc = ibv_query_port(ctx, (uint8_t)port, &pa)) != 0)
        return rc;
    if ((rc = ibv_query_device(ctx, &da)) != 0)
        return rc;
    if ((rc = ibv_query_gid(ctx, (uint8_t)port, gid_index, &gid)) != 0)
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
    qp = ibv_create_qp(pd, &a);
    if (qp == NULL && max_inline) {
        a.cap.max_inline_data = 0;
        qp = ibv_create_qp(pd, &a);
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
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
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
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
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
    return ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
                         IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC);
}

static inline int fab_ib_qp_error(struct ibv_qp *qp)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof(a));
    a.qp_state = IBV_QPS_ERR;
    return ibv_modify_qp(qp, &a, IBV_QP_STATE);
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
