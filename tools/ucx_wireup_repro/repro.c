/*
 * UCX tcp wireup crash reproducer (fabric issue 26 item 6): libucp alone, no fabric.
 *
 * A survivor and a peer exchange worker addresses over a bootstrap socket, each calls
 * ucp_ep_create (PEER error mode, an error callback), and the peer is SIGKILLed around its
 * own ucp_ep_create. On UCX 1.22 with blocking tcp connects some survivors then die inside
 * ucp_worker_progress. See REPORT.md.
 *
 * Process layout, local mode (default): harness -> one survivor per iteration -> its peers.
 * The harness never touches UCX, so a crashed survivor is counted, not fatal. The survivor
 * forks its peers before it initialises UCX (forking with UCX's async thread running can
 * deadlock the child on UCX's global lock). Bootstrap sockets are socketpairs; EOF on one
 * means the peer is gone (fabric's peer_gone).
 *
 * Two-host mode: `-l IP:PORT` on the survivor's host, `-t IP:PORT` on the peers' host. The
 * survivor side's harness listens; each survivor accepts its peers' TCP bootstrap
 * connections. The peer side forks one doomed peer (then one healthy peer with -H) per
 * round and stops once the listener has gone. Only the self_* kill points work across hosts.
 *
 * Build: ./build.sh.   Usage: ./repro -h.
 */
#define _GNU_SOURCE
#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define AM_ID 0x3A           /* fabric's active-message id */
#define MAGIC 0xFAB1C0DEu
#define MAX_ROUNDS 32
#define MAX_CONNS (2 * MAX_ROUNDS)
#define CB_WAIT_US 5000000   /* how long a survivor waits for the error callback after EOF */

enum kill_mode { KILL_SURVIVOR, KILL_SELF_AFTER_EP, KILL_SELF_BEFORE_EP };
enum close_point { CLOSE_AFTER_CB, CLOSE_IN_CB, CLOSE_ON_EOF, CLOSE_AT_KILL, CLOSE_NEVER };
enum role { ROLE_DOOMED = 1, ROLE_HEALTHY = 2 };
static const char *kill_names[] = {"survivor", "self_after_ep", "self_before_ep"};
static const char *close_names[] = {"after_cb", "in_cb", "on_eof", "at_kill", "never"};

/* survivor exit codes */
enum { EXIT_CLEAN = 0, EXIT_HEALTHY_FAILED = 10, EXIT_SETUP = 11 };
/* peer exit codes (a doomed peer normally dies of SIGKILL) */
enum { PEER_OK = 0, PEER_DROPPED = 2, PEER_EP_FAILED = 3, PEER_SETUP = 4, PEER_NOT_KILLED = 5,
       PEER_NO_HELLO = 6 };

static struct {
    int iterations, kill, close, max_delay_us, post_close_ms, rounds, healthy, jitter_us;
    int survivor_am, peer_am, no_rma, skip_on_eof, err_none, event_wait, keep_core, timeout_s;
    const char *logdir, *listen_at, *connect_to;
} opt = {
    .iterations = 100, .kill = KILL_SURVIVOR, .close = CLOSE_ON_EOF, .max_delay_us = 2000,
    .post_close_ms = 50, .rounds = 1, .survivor_am = 1, .timeout_s = 20, .logdir = "logs/run",
};

/* What a survivor reports to its harness, written after every round (the last one counts). */
struct status {
    uint32_t magic;
    int rounds_done, refused, skipped, no_error_callback, error_callbacks, healthy_ok,
        healthy_failed, setup_errors, dropped;
};

typedef struct {
    ucp_ep_h ep;
    int failed, closed, hello;
    ucs_status_t fail_status;
    void *close_req, *send_req;
    ucp_dt_iov_t iov;        /* must outlive the send */
} conn_t;

/* Static so the error callback's argument outlives every round and the worker itself. */
static conn_t conns[MAX_CONNS];
static int hellos_received;
static char hello_payload[64];

typedef struct {
    ucp_context_h context;
    ucp_worker_h worker;
    ucp_address_t *address;
    size_t address_length;
    int efd;
} ucx_t;

/* ---------------------------------------------------------------- small helpers */

static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static uint64_t rng_state;
static void seed_rng(uint64_t extra) { rng_state = (now_us() ^ ((uint64_t)getpid() << 32) ^ extra) | 1; }
static unsigned uniform(unsigned max_inclusive)
{
    rng_state ^= rng_state << 13; rng_state ^= rng_state >> 7; rng_state ^= rng_state << 17;
    return max_inclusive ? (unsigned)(rng_state % ((uint64_t)max_inclusive + 1)) : 0;
}

static int write_all(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return -1;
        p += n; len -= (size_t)n;
    }
    return 0;
}

/* 0 done, 1 EOF before the first byte, -1 error or deadline */
static int read_exact(int fd, void *buf, size_t len, uint64_t deadline)
{
    char *p = buf;
    size_t got = 0;
    while (got < len) {
        uint64_t t = now_us();
        if (t >= deadline) return -1;
        struct pollfd pf = {fd, POLLIN, 0};
        int r = poll(&pf, 1, (int)((deadline - t) / 1000 + 1));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) continue;
        ssize_t n = recv(fd, p + got, len - got, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE))) return got ? -1 : 1;
        if (n < 0) return -1;
        got += (size_t)n;
    }
    return 0;
}

static int send_blob(int fd, const void *data, size_t len)
{
    uint32_t n = (uint32_t)len;
    return write_all(fd, &n, sizeof n) || write_all(fd, data, len) ? -1 : 0;
}

/* 0 done, 1 EOF first, -1 error */
static int recv_blob(int fd, void **data, size_t *len, uint64_t deadline)
{
    uint32_t n;
    int r = read_exact(fd, &n, sizeof n, deadline);
    if (r) return r;
    if (n == 0 || n > (1u << 20)) return -1;
    *data = malloc(n);
    if (read_exact(fd, *data, n, deadline)) { free(*data); return -1; }
    *len = n;
    return 0;
}

/* The bootstrap socket of a doomed peer carries nothing after the addresses: readable = gone. */
static int at_eof(int fd)
{
    struct pollfd pf = {fd, POLLIN, 0};
    if (poll(&pf, 1, 0) <= 0) return 0;
    char b;
    ssize_t n = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR);
}

static int parse_addr(const char *s, struct sockaddr_in *sa)
{
    char host[64];
    const char *colon = strrchr(s, ':');
    if (!colon || (size_t)(colon - s) >= sizeof host) return -1;
    memcpy(host, s, (size_t)(colon - s)); host[colon - s] = 0;
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons((uint16_t)atoi(colon + 1));
    return inet_pton(AF_INET, host, &sa->sin_addr) == 1 ? 0 : -1;
}

/* ---------------------------------------------------------------- UCX, as fabric uses it */

static ucs_status_t on_am(void *arg, const void *header, size_t header_length, void *data,
                          size_t length, const ucp_am_recv_param_t *param)
{
    uint32_t h[2];
    (void)arg; (void)data; (void)length; (void)param;
    if (header_length >= sizeof h) {
        memcpy(h, header, sizeof h);
        if (h[0] == MAGIC && h[1] < MAX_CONNS) conns[h[1]].hello = 1;
    }
    hellos_received++;
    return UCS_OK;
}

static unsigned runtime_version(void)
{
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    return UCP_VERSION(major, minor);
}

static int ucx_open(ucx_t *u)
{
    ucp_params_t params;
    ucp_config_t *config;
    ucp_worker_params_t wparams;
    ucp_am_handler_param_t am;
    memset(&params, 0, sizeof params);
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (opt.no_rma ? 0 : UCP_FEATURE_RMA);
    params.mt_workers_shared = 0;
    if (ucp_config_read(NULL, NULL, &config) != UCS_OK) return -1;
    /* fabric's setting; it does NOT set TCP_CONN_NB here: that is the workaround under test */
    if (getenv("UCX_TCP_MAX_CONN_RETRIES") == NULL && runtime_version() >= UCP_VERSION(1, 17))
        (void)ucp_config_modify(config, "TCP_MAX_CONN_RETRIES", "255");
    ucs_status_t s = ucp_init(&params, config, &u->context);
    ucp_config_release(config);
    if (s != UCS_OK) return -1;
    memset(&wparams, 0, sizeof wparams);
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE | UCP_WORKER_PARAM_FIELD_EVENTS;
    wparams.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    wparams.events = UCP_WAKEUP_RMA | UCP_WAKEUP_AMO | UCP_WAKEUP_TAG_SEND | UCP_WAKEUP_TAG_RECV |
                     UCP_WAKEUP_TX | UCP_WAKEUP_RX;
    if (ucp_worker_create(u->context, &wparams, &u->worker) != UCS_OK) return -1;
    memset(&am, 0, sizeof am);
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    am.id = AM_ID;
    am.cb = on_am;
    am.arg = NULL;
    am.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    if (ucp_worker_set_am_recv_handler(u->worker, &am) != UCS_OK) return -1;
    if (ucp_worker_get_address(u->worker, &u->address, &u->address_length) != UCS_OK) return -1;
    if (ucp_worker_get_efd(u->worker, &u->efd) != UCS_OK) return -1;
    return 0;
}

static void ucx_close(ucx_t *u)
{
    for (int i = 0; i < MAX_CONNS; i++) {      /* fabric's destroy_zombies */
        if (conns[i].send_req) { ucp_request_free(conns[i].send_req); conns[i].send_req = NULL; }
        if (conns[i].close_req) { ucp_request_free(conns[i].close_req); conns[i].close_req = NULL; }
    }
    ucp_worker_release_address(u->worker, u->address);
    ucp_worker_destroy(u->worker);
    ucp_cleanup(u->context);
}

static void close_conn(conn_t *c)
{
    ucp_request_param_t p;
    if (c->closed || !c->ep) return;
    memset(&p, 0, sizeof p);
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    void *r = ucp_ep_close_nbx(c->ep, &p);
    c->closed = 1;
    if (UCS_PTR_IS_PTR(r)) c->close_req = r;
}

/* Like fabric's on_ep_error: record the failure (and, for -c in_cb, close at once). */
static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    conn_t *c = arg;
    (void)ep;
    c->failed = 1;
    c->fail_status = status;
    if (opt.close == CLOSE_IN_CB) close_conn(c);
}

static ucs_status_t ep_create(ucx_t *u, const void *address, conn_t *c)
{
    ucp_ep_params_t p;
    memset(&p, 0, sizeof p);
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = address;
    p.err_mode = opt.err_none ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = on_ep_error;
    p.err_handler.arg = c;
    return ucp_ep_create(u->worker, &p, &c->ep);
}

static void on_send(void *request, ucs_status_t status, void *user_data)
{
    (void)request; (void)status; (void)user_data;
}

/* fabric's HELLO: an eager AM with a copied header and an iov payload */
static void send_hello(conn_t *c, uint32_t index)
{
    uint32_t header[4] = {MAGIC, index, 0, 0};
    ucp_request_param_t p;
    memset(&p, 0, sizeof p);
    c->iov.buffer = hello_payload;
    c->iov.length = sizeof hello_payload;
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_DATATYPE | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = on_send;
    p.user_data = c;
    p.datatype = ucp_dt_make_iov();
    p.flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_COPY_HEADER;
    void *r = ucp_am_send_nbx(c->ep, AM_ID, header, sizeof header, &c->iov, 1, &p);
    if (UCS_PTR_IS_PTR(r)) c->send_req = r;
}

/* fabric's close_pending: hand finished requests back */
static void reap(conn_t *c)
{
    if (c->send_req && ucp_request_check_status(c->send_req) != UCS_INPROGRESS) {
        ucp_request_free(c->send_req); c->send_req = NULL;
    }
    if (c->close_req && ucp_request_check_status(c->close_req) != UCS_INPROGRESS) {
        ucp_request_free(c->close_req); c->close_req = NULL;
    }
}

/* Busy progress, or (-e) fabric's hub: up to 64 rounds while there is work, arm, wait 1 ms. */
static void progress(ucx_t *u)
{
    if (!opt.event_wait) {
        ucp_worker_progress(u->worker);
    } else {
        int n = 0;
        while (ucp_worker_progress(u->worker) && ++n < 64) {}
        if (ucp_worker_arm(u->worker) == UCS_OK) {
            struct pollfd pf = {u->efd, POLLIN, 0};
            poll(&pf, 1, 1);
        }
    }
    if (opt.jitter_us) usleep(uniform((unsigned)opt.jitter_us));
}

static void progress_for(ucx_t *u, conn_t *c, uint64_t us)
{
    uint64_t end = now_us() + us;
    do { progress(u); if (c) reap(c); } while (now_us() < end);
}

/* ---------------------------------------------------------------- the peer */

static int peer_main(int fd, int doomed)
{
    ucx_t u;
    void *survivor_address;
    size_t length;
    uint64_t deadline = now_us() + (uint64_t)opt.timeout_s * 1000000u;
    conn_t *c = &conns[0];
    seed_rng((uint64_t)fd);
    uint32_t index;     /* the survivor's slot for this connection, named in our HELLO */
    int r = recv_blob(fd, &survivor_address, &length, deadline);
    if (r == 1) return PEER_DROPPED;
    if (r || read_exact(fd, &index, sizeof index, deadline)) return PEER_SETUP;
    if (ucx_open(&u)) return PEER_SETUP;
    if (send_blob(fd, u.address, u.address_length)) return PEER_DROPPED;
    if (doomed && opt.kill == KILL_SELF_BEFORE_EP) {
        progress_for(&u, NULL, uniform((unsigned)opt.max_delay_us));
        raise(SIGKILL);
    }
    if (ep_create(&u, survivor_address, c) != UCS_OK) return PEER_EP_FAILED;
    if (!doomed || opt.peer_am) send_hello(c, index);
    if (doomed) {
        if (opt.kill == KILL_SELF_AFTER_EP) {
            uint64_t delay = uniform((unsigned)opt.max_delay_us);
            if (delay) progress_for(&u, c, delay);
            raise(SIGKILL);
        }
        while (now_us() < deadline) { progress(&u); reap(c); }   /* the survivor kills us */
        return PEER_NOT_KILLED;
    }
    /* healthy: confirm the survivor's HELLO with 'k', leave on its 'b' */
    int confirmed = 0;
    while (now_us() < deadline) {
        progress(&u); reap(c);
        if (!confirmed && hellos_received) {
            if (write_all(fd, "k", 1)) break;
            confirmed = 1;
        }
        struct pollfd pf = {fd, POLLIN, 0};
        if (confirmed && poll(&pf, 1, 0) > 0) break;            /* 'b' or EOF */
    }
    close_conn(c);
    progress_for(&u, c, 10000);
    ucx_close(&u);
    return confirmed ? PEER_OK : PEER_NO_HELLO;
}

/* ---------------------------------------------------------------- the survivor */

/* 0 done, 1 the peer was gone before its address came (accept another), -1 setup error */
static int exchange(ucx_t *u, int fd, uint32_t index, void **peer_address)
{
    size_t length;
    uint64_t deadline = now_us() + (uint64_t)opt.timeout_s * 500000u;
    if (send_blob(fd, u->address, u->address_length) || write_all(fd, &index, sizeof index)) return 1;
    return recv_blob(fd, peer_address, &length, deadline);
}

static int doomed_round(ucx_t *u, int index, int fd, pid_t peer, struct status *st)
{
    conn_t *c = &conns[index];
    void *peer_address;
    int r = exchange(u, fd, (uint32_t)index, &peer_address);
    if (r) return r;
    if (opt.skip_on_eof && at_eof(fd)) { free(peer_address); st->skipped++; return 0; }
    ucs_status_t s = ep_create(u, peer_address, c);
    free(peer_address);
    if (s != UCS_OK) {
        c->ep = NULL;
        st->refused++;
        return 0;
    }
    if (opt.survivor_am) send_hello(c, (uint32_t)index);
    uint64_t kill_at = opt.kill == KILL_SURVIVOR ? now_us() + uniform((unsigned)opt.max_delay_us) : 0;
    int eof = 0;
    int wants_callback = !opt.err_none &&
                         (opt.close == CLOSE_AFTER_CB || opt.close == CLOSE_IN_CB || opt.close == CLOSE_NEVER);
    uint64_t callback_deadline = 0;
    for (;;) {
        progress(u);
        reap(c);
        uint64_t t = now_us();
        if (kill_at && t >= kill_at) {
            kill(peer, SIGKILL);
            kill_at = 0;
            if (opt.close == CLOSE_AT_KILL) close_conn(c);
        }
        if (!eof && at_eof(fd)) {
            eof = 1;
            callback_deadline = t + CB_WAIT_US;
            if (opt.close == CLOSE_ON_EOF) close_conn(c);
        }
        if (c->failed && opt.close == CLOSE_AFTER_CB) close_conn(c);
        if (opt.err_none && eof && opt.close != CLOSE_NEVER) close_conn(c);
        if (eof && (!wants_callback || c->failed) && (c->closed || opt.close == CLOSE_NEVER)) break;
        if (eof && t >= callback_deadline) {
            st->no_error_callback++;
            if (opt.close != CLOSE_NEVER) close_conn(c);
            break;
        }
    }
    if (c->failed) st->error_callbacks++;
    progress_for(u, c, (uint64_t)opt.post_close_ms * 1000u);
    return 0;
}

static int healthy_round(ucx_t *u, int index, int fd)
{
    conn_t *c = &conns[index];
    void *peer_address;
    int r = exchange(u, fd, (uint32_t)index, &peer_address);
    if (r) return r;
    ucs_status_t s = ep_create(u, peer_address, c);
    free(peer_address);
    if (s != UCS_OK) { c->ep = NULL; return 2; }
    send_hello(c, (uint32_t)index);
    uint64_t deadline = now_us() + (uint64_t)opt.timeout_s * 500000u;
    int confirmed = 0, ok = 0;
    while (now_us() < deadline && !c->failed) {
        progress(u); reap(c);
        if (!confirmed) {
            struct pollfd pf = {fd, POLLIN, 0};
            char b;
            if (poll(&pf, 1, 0) > 0) {
                if (recv(fd, &b, 1, 0) != 1 || b != 'k') break;
                confirmed = 1;
            }
        }
        if (confirmed && c->hello) { ok = 1; break; }
    }
    if (ok) (void)write_all(fd, "b", 1);
    close_conn(c);
    progress_for(u, c, 5000);
    return ok ? 0 : 2;
}

static void report(int status_fd, struct status *st)
{
    st->magic = MAGIC;
    (void)!write(status_fd, st, sizeof *st);
}

static int accept_role(int listen_fd, int role, uint64_t deadline)
{
    for (;;) {
        uint64_t t = now_us();
        if (t >= deadline) return -1;
        struct pollfd pf = {listen_fd, POLLIN, 0};
        if (poll(&pf, 1, (int)((deadline - t) / 1000 + 1)) <= 0) continue;
        int fd = accept(listen_fd, NULL, NULL);
        if (fd < 0) continue;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        uint32_t header[2];
        if (read_exact(fd, header, sizeof header, now_us() + 2000000u) == 0 &&
            header[0] == MAGIC && (int)header[1] == role)
            return fd;
        close(fd);    /* a connection meant for a survivor that crashed: drop it */
    }
}

static int survivor_main(int status_fd, int listen_fd)
{
    struct status st;
    ucx_t u;
    int nconns = opt.rounds * (opt.healthy ? 2 : 1);
    int fds[MAX_CONNS];
    pid_t pids[MAX_CONNS];
    memset(&st, 0, sizeof st);
    seed_rng(0);
    if (listen_fd < 0) {
        /* local: fork every peer before UCX exists in this process */
        for (int i = 0; i < nconns; i++) {
            int sv[2];
            if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) return EXIT_SETUP;
            pid_t pid = fork();
            if (pid < 0) return EXIT_SETUP;
            if (pid == 0) {
                close(status_fd);
                for (int j = 0; j < i; j++) close(fds[j]);
                close(sv[0]);
                _exit(peer_main(sv[1], !opt.healthy || i % 2 == 0));
            }
            close(sv[1]);
            fds[i] = sv[0];
            pids[i] = pid;
        }
    }
    if (ucx_open(&u)) { st.setup_errors++; report(status_fd, &st); return EXIT_SETUP; }
    int code = EXIT_CLEAN;
    uint64_t deadline = now_us() + (uint64_t)opt.timeout_s * 1000000u;
    for (int i = 0; i < nconns; i++) {
        int doomed = !opt.healthy || i % 2 == 0;
        int r;
        for (;;) {
            int fd = listen_fd < 0 ? fds[i]
                                   : accept_role(listen_fd, doomed ? ROLE_DOOMED : ROLE_HEALTHY, deadline);
            if (fd < 0) { r = -1; break; }
            if (listen_fd >= 0) fds[i] = fd;
            r = doomed ? doomed_round(&u, i, fd, listen_fd < 0 ? pids[i] : 0, &st) : healthy_round(&u, i, fd);
            if (r == 1 && listen_fd >= 0) { close(fd); st.dropped++; continue; }
            break;
        }
        if (r == 2 || (!doomed && r != 0)) { st.healthy_failed++; code = EXIT_HEALTHY_FAILED; }
        else if (!doomed) st.healthy_ok++;
        else if (r != 0) { st.setup_errors++; code = EXIT_SETUP; }
        else st.rounds_done++;
        report(status_fd, &st);
        if (code == EXIT_SETUP) break;
    }
    ucx_close(&u);
    if (listen_fd < 0) {
        for (int i = 0; i < nconns; i++) { kill(pids[i], SIGKILL); waitpid(pids[i], NULL, 0); }
    }
    report(status_fd, &st);
    return code;
}

/* ---------------------------------------------------------------- the harnesses */

static int peer_side(void)
{
    struct sockaddr_in sa;
    if (parse_addr(opt.connect_to, &sa)) { fprintf(stderr, "bad -t address\n"); return 2; }
    int counts[8] = {0}, killed = 0, hung = 0, other = 0, connected_once = 0, doomed_rounds = 0;
    uint64_t start = now_us();
    for (int round = 0;; round++) {
        int role = (!opt.healthy || round % 2 == 0) ? ROLE_DOOMED : ROLE_HEALTHY;
        /* the listener exists for the whole survivor run: refused after a success = it ended */
        uint64_t give_up = now_us() + (connected_once ? 5000000u : 180000000u);
        int fd = -1;
        while (now_us() < give_up) {
            fd = socket(AF_INET, SOCK_STREAM, 0);
            if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0) break;
            close(fd); fd = -1;
            usleep(50000);
        }
        if (fd < 0) break;
        connected_once = 1;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        uint32_t header[2] = {MAGIC, (uint32_t)role};
        if (write_all(fd, header, sizeof header)) { close(fd); continue; }
        pid_t pid = fork();
        if (pid == 0) _exit(peer_main(fd, role == ROLE_DOOMED));
        close(fd);
        if (role == ROLE_DOOMED) doomed_rounds++;
        int status = 0;
        uint64_t deadline = now_us() + (uint64_t)opt.timeout_s * 1000000u;
        while (waitpid(pid, &status, WNOHANG) == 0) {
            if (now_us() > deadline) { kill(pid, SIGKILL); waitpid(pid, &status, 0); hung++; break; }
            usleep(1000);
        }
        if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) killed++;
        else if (WIFEXITED(status) && WEXITSTATUS(status) < 8) counts[WEXITSTATUS(status)]++;
        else other++;
    }
    printf("PEERS kill=%s healthy=%d: rounds=%d doomed=%d killed=%d healthy_ok=%d dropped=%d "
           "ep_failed=%d setup=%d not_killed=%d no_hello=%d hung=%d other=%d time=%.1fs\n",
           kill_names[opt.kill], opt.healthy, counts[0] + counts[2] + counts[3] + counts[4] + counts[5] +
           counts[6] + killed + hung + other, doomed_rounds, killed, counts[PEER_OK], counts[PEER_DROPPED],
           counts[PEER_EP_FAILED], counts[PEER_SETUP], counts[PEER_NOT_KILLED], counts[PEER_NO_HELLO], hung,
           other, (now_us() - start) / 1e6);
    return 0;
}

/* a writable copy of the log directory's path, for making its parents */
static char *current_dir(const char *set)
{
    static char path[4096];
    if (set) snprintf(path, sizeof path, "%s", set);
    return path;
}

static int harness(void)
{
    unsigned major, minor, release;
    int listen_fd = -1;
    char current[4096], kept[4096];
    ucp_get_version(&major, &minor, &release);
    printf("UCX runtime %u.%u.%u (headers %d.%d), UCX_TLS=%s UCX_NET_DEVICES=%s UCX_TCP_CONN_NB=%s%s%s\n",
           major, minor, release, UCP_API_MAJOR, UCP_API_MINOR, getenv("UCX_TLS") ?: "(unset)",
           getenv("UCX_NET_DEVICES") ?: "(unset)", getenv("UCX_TCP_CONN_NB") ?: "(unset)",
           opt.listen_at ? " listening on " : "", opt.listen_at ?: "");
    fflush(stdout);
    for (char *slash = strchr(current_dir(opt.logdir), '/'); slash; slash = strchr(slash + 1, '/')) {
        *slash = 0; mkdir(current_dir(NULL), 0755); *slash = '/';
    }
    mkdir(opt.logdir, 0755);
    snprintf(current, sizeof current, "%s/current.stderr", opt.logdir);
    if (opt.listen_at) {
        struct sockaddr_in sa;
        int one = 1;
        if (parse_addr(opt.listen_at, &sa)) { fprintf(stderr, "bad -l address\n"); return 2; }
        listen_fd = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(listen_fd, (struct sockaddr *)&sa, sizeof sa) || listen(listen_fd, 64)) {
            perror("listen"); return 2;
        }
    }
    int crashes = 0, hangs = 0, healthy_failed = 0, setup = 0, other = 0, clean = 0;
    int by_signal[65] = {0};
    struct status total;
    memset(&total, 0, sizeof total);
    uint64_t start = now_us();
    for (int iter = 0; iter < opt.iterations; iter++) {
        int sp[2];
        if (pipe(sp)) return 2;
        int err = open(current, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (err < 0) { perror(current); return 2; }
        pid_t pid = fork();
        if (pid == 0) {
            setpgid(0, 0);
            close(sp[0]);
            dup2(err, 1);     /* UCX logs to stdout: keep the harness's stdout for results */
            dup2(err, 2);
            close(err);
            if (opt.keep_core) {
                struct rlimit rl = {RLIM_INFINITY, RLIM_INFINITY};
                setrlimit(RLIMIT_CORE, &rl);
            }
            _exit(survivor_main(sp[1], listen_fd));
        }
        setpgid(pid, pid);
        close(sp[1]);
        close(err);
        int status = 0, hung = 0;
        uint64_t deadline = now_us() + (uint64_t)opt.timeout_s * 1000000u +
                            (uint64_t)opt.rounds * (opt.post_close_ms + 100) * 1000u;
        while (waitpid(pid, &status, WNOHANG) == 0) {
            if (now_us() > deadline) { kill(-pid, SIGKILL); waitpid(pid, &status, 0); hung = 1; break; }
            usleep(2000);
        }
        kill(-pid, SIGKILL);   /* peers left behind by a crashed survivor */
        while (waitpid(-1, NULL, WNOHANG) > 0) {}
        struct status st, last;
        memset(&last, 0, sizeof last);
        fcntl(sp[0], F_SETFL, O_NONBLOCK);
        while (read(sp[0], &st, sizeof st) == (ssize_t)sizeof st)
            if (st.magic == MAGIC) last = st;
        close(sp[0]);
        total.rounds_done += last.rounds_done; total.refused += last.refused;
        total.skipped += last.skipped; total.no_error_callback += last.no_error_callback;
        total.error_callbacks += last.error_callbacks; total.healthy_ok += last.healthy_ok;
        total.healthy_failed += last.healthy_failed; total.dropped += last.dropped;
        const char *what = NULL;
        char why[96];
        if (hung) { hangs++; what = "HANG"; snprintf(why, sizeof why, "no exit after %d s", opt.timeout_s); }
        else if (WIFSIGNALED(status)) {
            int sig = WTERMSIG(status);
            crashes++;
            if (sig > 0 && sig < 65) by_signal[sig]++;
            what = "CRASH";
            snprintf(why, sizeof why, "signal %d (%s)", sig, strsignal(sig));
        } else if (WEXITSTATUS(status) == EXIT_CLEAN) {
            clean++;
        } else {
            int code = WEXITSTATUS(status);
            if (code == EXIT_HEALTHY_FAILED) healthy_failed++;
            else if (code == EXIT_SETUP) setup++;
            else other++;
            what = "exit";
            snprintf(why, sizeof why, "%d (%s)", code,
                     code == EXIT_HEALTHY_FAILED ? "a healthy connection failed" :
                     code == EXIT_SETUP ? "setup error" : "unexpected");
        }
        if (what) {
            snprintf(kept, sizeof kept, "%s/iter-%d.stderr", opt.logdir, iter);
            rename(current, kept);
            printf("iter %d: %s %s, stderr in %s\n", iter, what, why, kept);
            fflush(stdout);
            if (opt.keep_core && crashes) break;
        }
    }
    if (listen_fd >= 0) close(listen_fd);
    unlink(current);
    int ran = crashes + hangs + healthy_failed + setup + other + clean;
    printf("RESULT kill=%s close=%s survivor_am=%d peer_am=%d max_delay_us=%d post_close_ms=%d rounds=%d "
           "healthy=%d event_wait=%d jitter_us=%d mode=%s: iterations=%d crashes=%d (%.2f%%) hangs=%d "
           "healthy_failed=%d setup_errors=%d other=%d clean=%d | rounds=%d ep_create_refused=%d "
           "skipped=%d error_callbacks=%d no_error_callback=%d healthy_ok=%d dropped=%d time=%.1fs\n",
           kill_names[opt.kill], close_names[opt.close], opt.survivor_am, opt.peer_am, opt.max_delay_us,
           opt.post_close_ms, opt.rounds, opt.healthy, opt.event_wait, opt.jitter_us,
           opt.listen_at ? "two-host" : "local", ran, crashes, ran ? 100.0 * crashes / ran : 0.0, hangs,
           healthy_failed, setup, other, clean, total.rounds_done, total.refused, total.skipped,
           total.error_callbacks, total.no_error_callback, total.healthy_ok, total.dropped,
           (now_us() - start) / 1e6);
    for (int s = 1; s < 65; s++)
        if (by_signal[s]) printf("  signal %d (%s): %d\n", s, strsignal(s), by_signal[s]);
    return 0;
}

static int lookup(const char *value, const char **names, int n)
{
    for (int i = 0; i < n; i++)
        if (strcmp(value, names[i]) == 0) return i;
    fprintf(stderr, "unknown value %s\n", value);
    exit(2);
}

static void usage(void)
{
    printf("usage: repro [options]\n"
           "  -n N        iterations (one survivor process each; default 100)\n"
           "  -L DIR      keep the stderr of failed iterations in DIR (default logs/run)\n"
           "  -k MODE     who kills the peer: survivor (0..d us after the survivor's ep_create),\n"
           "              self_after_ep (the peer, 0..d us after its own ep_create, progressing),\n"
           "              self_before_ep (the peer, 0..d us after it sent its address)\n"
           "  -d US       max kill delay (default 2000)\n"
           "  -c POINT    survivor's force-close: after_cb, in_cb, on_eof (default), at_kill, never\n"
           "  -p MS       progress after the close before the next round/teardown (default 50)\n"
           "  -r N        rounds (killed peers) per survivor (default 1, max %d)\n"
           "  -H          a healthy peer after each killed one (HELLO both ways must arrive)\n"
           "  -j US       random sleeps of 0..US between progress calls on both sides\n"
           "  -s 0|1      survivor posts HELLO after its ep_create (default 1)\n"
           "  -S 0|1      doomed peer posts HELLO after its ep_create (default 0)\n"
           "  -R          no UCP_FEATURE_RMA\n"
           "  -C          skip ucp_ep_create when the bootstrap socket is already at EOF\n"
           "  -N          error handling mode NONE\n"
           "  -e          fabric's hub wait: progress while busy, arm, poll the efd 1 ms\n"
           "  -X          let a crashing survivor dump core (RLIMIT_CORE) and stop at the first crash\n"
           "  -T S        an iteration that has not ended after S s is a hang (default 20)\n"
           "  -l IP:PORT  two hosts: survivor side, accept the peers' bootstrap connections here\n"
           "  -t IP:PORT  two hosts: peer side, connect there, run peers until the listener goes\n",
           MAX_ROUNDS);
}

int main(int argc, char **argv)
{
    int ch;
    while ((ch = getopt(argc, argv, "n:L:k:d:c:p:r:Hj:s:S:RCNeXT:l:t:h")) != -1) {
        switch (ch) {
        case 'n': opt.iterations = atoi(optarg); break;
        case 'L': opt.logdir = optarg; break;
        case 'k': opt.kill = lookup(optarg, kill_names, 3); break;
        case 'd': opt.max_delay_us = atoi(optarg); break;
        case 'c': opt.close = lookup(optarg, close_names, 5); break;
        case 'p': opt.post_close_ms = atoi(optarg); break;
        case 'r': opt.rounds = atoi(optarg); break;
        case 'H': opt.healthy = 1; break;
        case 'j': opt.jitter_us = atoi(optarg); break;
        case 's': opt.survivor_am = atoi(optarg); break;
        case 'S': opt.peer_am = atoi(optarg); break;
        case 'R': opt.no_rma = 1; break;
        case 'C': opt.skip_on_eof = 1; break;
        case 'N': opt.err_none = 1; break;
        case 'e': opt.event_wait = 1; break;
        case 'X': opt.keep_core = 1; break;
        case 'T': opt.timeout_s = atoi(optarg); break;
        case 'l': opt.listen_at = optarg; break;
        case 't': opt.connect_to = optarg; break;
        case 'h': usage(); return 0;
        default: usage(); return 2;
        }
    }
    if (opt.rounds < 1 || opt.rounds > MAX_ROUNDS || opt.iterations < 0 || opt.timeout_s < 1) {
        usage(); return 2;
    }
    if (opt.close == CLOSE_AT_KILL && opt.kill != KILL_SURVIVOR) {
        fprintf(stderr, "-c at_kill needs -k survivor\n"); return 2;
    }
    if ((opt.listen_at || opt.connect_to) && opt.kill == KILL_SURVIVOR) {
        fprintf(stderr, "across hosts the peer kills itself: use -k self_after_ep or self_before_ep\n");
        return 2;
    }
    /* local runs must stay on 127.0.0.1 (this host has other interfaces) */
    if (!opt.listen_at && !opt.connect_to) setenv("UCX_NET_DEVICES", "lo", 0);
    signal(SIGPIPE, SIG_IGN);
    return opt.connect_to ? peer_side() : harness();
}
