/* Thin wrappers over UCP calls whose parameter structs contain anonymous
 * unions (awkward to declare from Cython). Only what the ucx backend uses;
 * each returns what the UCP call returns. Works with UCX >= 1.11. */
#ifndef FABRIC_UCX_SHIM_H
#define FABRIC_UCX_SHIM_H

#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

#define FAB_UCX_AM_ID 0x3A

/* UCX >= 1.14 can copy the header at once; older ones read it until the send
 * completes, so callers keep every header alive until then either way. */
#ifdef UCP_AM_SEND_FLAG_COPY_HEADER
#define FAB_UCX_COPY_HEADER UCP_AM_SEND_FLAG_COPY_HEADER
#else
#define FAB_UCX_COPY_HEADER 0
#endif

static inline unsigned fab_ucx_api_version(void)
{
    return UCP_API_VERSION;
}

static inline unsigned fab_ucx_runtime_version(void)
{
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return UCP_VERSION(major, minor);
}

static inline ucs_status_t fab_ucx_init(ucp_context_h *context)
{
    ucp_params_t params;
    ucp_config_t *config;
    ucs_status_t status;

    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    /* The user's UCX_* environment (UCX_TLS, UCX_NET_DEVICES, ...) is read here. */
    status = ucp_config_read(NULL, NULL, &config);
    if (status != UCS_OK)
        return status;
    /* UCX's TCP lanes retry a connect the peer reset (lost simultaneous-connect
     * race, full accept queue) only 25 times, back to back; on a loaded 2-core
     * host that budget runs out while the peer is merely slow to progress.
     * Only UCX >= 1.17 resolves a transport's prefixed key given to UCP
     * (uct_config_modify learnt table prefixes then); older ones keep the key
     * unused and warn "invalid configuration" at ucp_init (1.13 on stdout). */
    if (getenv("UCX_TCP_MAX_CONN_RETRIES") == NULL && fab_ucx_runtime_version() >= UCP_VERSION(1, 17))
        (void)ucp_config_modify(config, "TCP_MAX_CONN_RETRIES", "255");
    /* A peer that dies during wireup: with the blocking connect, UCX's tcp
     * lane sends its connection request before the endpoint may send, finds
     * the peer gone, schedules the endpoint's own destruction and still hands
     * it to UCP, which uses it after it is freed (SIGSEGV in
     * ucp_worker_discard_uct_ep_destroy_progress, or the assertion in
     * uct_tcp_ep_destroy_progress). A non-blocking connect reports the failure
     * through UCP's error path instead: 0 crashes in 3,625 iterations of
     * tools/ucx_wireup_repro against 2-8% without it (UCX 1.22). */
    if (getenv("UCX_TCP_CONN_NB") == NULL && fab_ucx_runtime_version() >= UCP_VERSION(1, 17))
        (void)ucp_config_modify(config, "TCP_CONN_NB", "y");
    status = ucp_init(&params, config, context);
    ucp_config_release(config);
    return status;
}

/* A worker of the context: a Fabric's, or its probe's (ucx.pyx). */
static inline ucs_status_t fab_ucx_worker_create(ucp_context_h context, ucp_worker_h *worker)
{
    ucp_worker_params_t wparams;

    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
    /* fabric serializes every call under its worker mutex */
    wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    wparams.events = UCP_WAKEUP_RMA | UCP_WAKEUP_AMO | UCP_WAKEUP_TAG_SEND | UCP_WAKEUP_TAG_RECV |
                     UCP_WAKEUP_TX | UCP_WAKEUP_RX;
    return ucp_worker_create(context, &wparams, worker);
}

static inline ucs_status_t fab_ucx_set_am_handler(ucp_worker_h worker, ucp_am_recv_callback_t cb, void *arg)
{
    ucp_am_handler_param_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    p.id = FAB_UCX_AM_ID;
    p.cb = cb;
    p.arg = arg;
    p.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    return ucp_worker_set_am_recv_handler(worker, &p);
}

static inline ucs_status_t fab_ucx_ep_create(ucp_worker_h worker, const ucp_address_t *address,
                                             int peer_errors, ucp_err_handler_cb_t on_error, void *arg,
                                             ucp_ep_h *ep)
{
    ucp_ep_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = address;
    /* PEER: UCX reports a failed peer. Shared-memory transports cannot, so
     * there the caller passes 0 and watches its bootstrap socket instead. */
    p.err_mode = peer_errors ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    p.err_handler.cb = on_error;
    p.err_handler.arg = arg;
    return ucp_ep_create(worker, &p, ep);
}

static inline ucs_status_ptr_t fab_ucx_ep_close(ucp_ep_h ep, int force)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    return ucp_ep_close_nbx(ep, &p);
}

static inline ucs_status_ptr_t fab_ucx_am_send(ucp_ep_h ep, const void *header, size_t header_length,
                                               const ucp_dt_iov_t *iov, size_t iovcnt,
                                               ucp_send_nbx_callback_t cb, void *user_data)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = cb;
    p.user_data = user_data;
    p.datatype = ucp_dt_make_iov();
    /* fabric messages are bounded (the engine's coalesce limit): always eager,
     * so the receiver gets them whole in its handler */
    p.flags = UCP_AM_SEND_FLAG_EAGER | FAB_UCX_COPY_HEADER;
    return ucp_am_send_nbx(ep, FAB_UCX_AM_ID, header, header_length, iov, iovcnt, &p);
}

/* UCX's own rendezvous for one large chunk: the receiver fetches it with
 * fab_ucx_am_recv_data once it names a destination. */
static inline ucs_status_ptr_t fab_ucx_am_send_large(ucp_ep_h ep, const void *header, size_t header_length,
                                                     void *buffer, size_t length,
                                                     ucp_send_nbx_callback_t cb, void *user_data)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = cb;
    p.user_data = user_data;
    p.flags = UCP_AM_SEND_FLAG_RNDV | FAB_UCX_COPY_HEADER;
    return ucp_am_send_nbx(ep, FAB_UCX_AM_ID, header, header_length, buffer, length, &p);
}

static inline ucs_status_ptr_t fab_ucx_am_recv_data(ucp_worker_h worker, void *desc, void *buffer, size_t length,
                                                    ucp_am_recv_data_nbx_callback_t cb, void *user_data)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = cb;
    p.user_data = user_data;
    return ucp_am_recv_data_nbx(worker, desc, buffer, length, &p);
}

static inline ucs_status_ptr_t fab_ucx_get(ucp_ep_h ep, void *dst, size_t length, uint64_t raddr,
                                           ucp_rkey_h rkey, ucp_send_nbx_callback_t cb, void *user_data)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = cb;
    p.user_data = user_data;
    return ucp_get_nbx(ep, dst, length, raddr, rkey, &p);
}

static inline ucs_status_ptr_t fab_ucx_put(ucp_ep_h ep, const void *src, size_t length, uint64_t raddr,
                                           ucp_rkey_h rkey, ucp_send_nbx_callback_t cb, void *user_data)
{
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = cb;
    p.user_data = user_data;
    return ucp_put_nbx(ep, src, length, raddr, rkey, &p);
}

static inline ucs_status_t fab_ucx_mem_map(ucp_context_h context, void *address, size_t length,
                                           ucp_mem_h *memh)
{
    ucp_mem_map_params_t p;
    memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = address;
    p.length = length;
    return ucp_mem_map(context, &p, memh);
}

static inline int fab_ucx_is_ptr(ucs_status_ptr_t p) { return UCS_PTR_IS_PTR(p); }
static inline int fab_ucx_is_err(ucs_status_ptr_t p) { return UCS_PTR_IS_ERR(p); }
static inline ucs_status_t fab_ucx_status(ucs_status_ptr_t p) { return UCS_PTR_STATUS(p); }

#endif
