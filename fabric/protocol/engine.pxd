# Engine state, shared between engine.pyx sections. The engine sees backends
# only through fabric.backends.interface (fab_channel / fab_listener).
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from cpython.buffer cimport Py_buffer
from fabric._posix cimport pthread_mutex_t, pthread_cond_t, pthread_t
from fabric.backends.interface cimport fab_channel, fab_listener, fab_mr, fab_hub, fab_attach, Backend

cdef struct opts_t:
    size_t eager_limit          # largest message sent eagerly
    size_t chunk_size           # rendezvous chunk (pipelining unit)
    uint32_t chunks_in_flight   # chunks announced / read ahead per message (adapt: the least)
    int adapt                   # ADAPT_* bits: thresholds each connection sizes to its link
    size_t adapt_max_chunk      # adapt: largest chunk size a connection grows to
    uint32_t window_cap         # chunk slots per message: what we announce at most and accept
    uint32_t max_rendezvous     # rendezvous messages a peer may have announced and not seen pulled
    size_t coalesce_limit       # largest fabric message (coalescing buffer)
    uint32_t credits            # receive buffers offered to the peer
    size_t recv_budget          # bytes of unreceived messages buffered per endpoint
    size_t total_recv_budget    # ... by all endpoints of the worker together
    uint32_t send_buffers       # coalescing buffers per endpoint
    uint64_t max_message        # largest message accepted from a peer
    double spin                 # seconds of busy polling before blocking
    double spin_max             # adaptive polling never spins longer than this (0: off)
    double handshake_timeout
    uint32_t max_pending        # handshakes a listener runs at once (max_pending_handshakes)
    uint32_t max_connections    # connections a listener admits and keeps open at once
    double close_linger
    int progress_thread
    int coalesce                # 0: one frame per fabric message (no packing)
    uint64_t native_min         # messages this large use the fabric's own rendezvous (0: never)
    int posted_receives         # 1: recv_into() buffers are posted to the peer to write into
    int fault                   # test-only fault injection (FABRIC_FAULT_INJECT), 0 normally
    int fault_action            # FABRIC_FAULT_INJECT=<action>@<stage>[:<n>]: FA_DIE / FA_GARBAGE
    int fault_stage             # FS_* (0: none)
    int fault_count             # occurrences of the stage left before the fault fires

cdef struct slab_t:
    slab_t* next
    size_t used
    uint64_t seq
    uint32_t frames             # frames packed into it (fault injection: a batch)
    uint8_t* data
    fab_mr* mr                  # registration, for backends that send only registered memory

cdef struct seg_t:
    char* ptr
    size_t length

cdef struct sendop_t:
    sendop_t* next
    uint64_t msg_id
    int state
    int err
    int refs
    int nseg
    seg_t* segs
    Py_buffer* views
    int nviews
    size_t total
    int large_counted           # counted in worker_t.large_sends until op_finish
    # eager zero-copy header, kept until the backend completes the send
    uint8_t hdr[24]
    # rendezvous
    uint32_t nchunks
    size_t chunk                # this message's chunk size (fixed when its first chunk goes)
    double rndv_started         # when its first chunk was announced (bandwidth sample)
    uint32_t announced
    uint32_t acked
    int any_failed
    uint64_t head_seq           # data slab holding the first announcement
    int native                  # chunks go by the fabric's own rendezvous
    int native_pending          # native chunk sends the fabric has not completed
    char* native_first          # first native chunk, handed over once its announcement is posted
    size_t native_first_len
    int cur_seg                 # announcement cursor
    size_t cur_off
    size_t msg_off
    fab_mr* window              # chunks_in_flight registrations, slot = index % window
    uint32_t* window_index      # chunk index held by each slot, or UINT32_MAX
    uint8_t* window_served      # 1: the slot's chunk was all written (FAB_EV_SERVED), its region gone
    uint32_t released           # chunks served or acknowledged, whichever came first
    int user_done               # completed for the application before every CHUNK_DONE came
    # put (written into the peer's posted buffer, core/posted.pxi)
    int put
    uint64_t put_raddr
    uint8_t* put_rkey
    uint32_t put_rkey_len
    uint32_t put_issued         # writes issued
    uint32_t put_done           # ... and completed (in issue order)
    sendop_t* reap_next

cdef struct desc_t:
    desc_t* next
    inmsg_t* msg
    uint32_t index
    int reading
    int native
    uint64_t offset
    uint64_t raddr
    uint32_t length
    uint32_t rkey_len
    uint8_t* rkey

cdef struct inmsg_t:
    inmsg_t* next
    inmsg_t* rnext
    uint64_t msg_id
    int rndv
    int in_inq
    int in_rndv
    size_t total
    char* data
    int own_data
    int bound
    int failed
    size_t charge
    uint32_t next_index
    uint64_t next_offset
    desc_t* descs
    uint32_t ndescs             # announced chunks not answered yet (bounded: max_chunks)
    int reads
    size_t received
    int dst_registered
    fab_mr dst_mr

cdef struct posted_t:
    int active                  # a receive is waiting
    int withdrawing             # being withdrawn: takes no delivery any more
    int done                    # result ready: length or err
    char* dst                   # user buffer (recv_into) or NULL (recv)
    size_t cap
    int err
    size_t length
    char* result                # recv(): malloc'd message handed to the caller
    inmsg_t* msg                # bound message

cdef struct qlink_t:
    # An intrusive set membership (dirty, runnable, touched): O(1) add and remove.
    qlink_t* prev
    qlink_t* next
    void* obj
    int queued

cdef struct node_t:
    int kind                    # KIND_EP / KIND_LST
    uint32_t slot
    uint64_t key
    qlink_t touched             # progressed since an event loop last looked (fabric.aio)
    uint64_t touched_key        # key when touched: a close unregisters (key 0) before the loop looks
    uint64_t gen                # bumped whenever it is touched (fabric.aio closes its wake-up race with it)

cdef struct ep_t:
    node_t node
    worker_t* w
    fab_channel* ch
    qlink_t dirty               # its channel must be re-armed before anyone blocks
    qlink_t runnable            # its channel said progress is possible without waiting
    uint64_t hub_pass           # the hub pass that last progressed it
    uint32_t caps               # the channel's capabilities (kept after it is closed)
    char local_name[64]
    char peer_name[64]
    # a receive that completed while its caller was interrupted by a signal
    # (or cancelled): the next receive takes it first
    int has_stash
    char* stash_data
    size_t stash_len
    int stash_err                 # the stashed receive failed (EACCES: its message is gone)
    int state
    int closed                  # closed locally; the struct lives until its Endpoint is freed
    int err
    char error[200]
    int peer_closed
    int opened                  # the handshake completed (it may have failed since)
    int close_sent
    uint32_t armed
    lst_t* listener
    ep_t* lst_next
    double hs_deadline
    auth_t* auth                # state EP_AUTH: the authentication on the raw socket
    uint64_t admitted_by        # key of the listener whose nconnections counts it (0: none)
    # send side
    uint64_t next_out_id
    int peer_credits
    uint32_t peer_max_recv
    uint64_t peer_max_message
    uint32_t peer_max_rendezvous    # rendezvous the peer accepts in flight (its HELLO)
    uint32_t peer_max_chunks        # chunk announcements it accepts in flight per message
    uint32_t rndv_out_count         # our rendezvous sends announced and not finished
    uint32_t rndv_in_count          # the peer's rendezvous messages in ep.rndv_in
    size_t slab_cap
    size_t eager_limit
    # the link as measured (core/adapt.pxi) and the thresholds sized to it
    size_t chunk_size               # rendezvous chunk for new messages
    uint32_t window                 # chunks of a message announced ahead
    double rtt                      # seconds, least of the handshake's PINGs (0: not measured)
    double bandwidth                # bytes/s of recent rendezvous transfers (0: none yet)
    double ping_sent                # when our PING left (0: none outstanding)
    uint32_t pings_left             # PINGs still to send at the handshake
    uint32_t pings_answered         # the peer's PINGs (at most MAX_PEER_PINGS)
    uint64_t adaptations            # times the thresholds changed
    char adapt_why[120]             # the last change, for Endpoint.link
    int pending_sends
    int slabs_total
    slab_t* free_slabs
    slab_t* open_data
    slab_t* ready_head
    slab_t* ready_tail
    slab_t* ctrl
    slab_t* ctrl_ready_head
    slab_t* ctrl_ready_tail
    slab_t* inflight
    int close_requested
    double typical_wait         # recent waits on this endpoint (seconds, moving average; 0: none yet)
    int pull_ahead              # pull rendezvous messages early: until one went to recv_into()
    int send_waiters            # threads blocked until a send completes
    # counters (Endpoint.stats): which protocol messages took, how sends were packed
    uint64_t sent_eager
    uint64_t sent_eager_zero_copy
    uint64_t sent_rndv
    uint64_t chunks_announced
    uint64_t chunks_served          # chunks whose every byte the fabric reported written (tcp)
    uint64_t rndv_done_early        # rendezvous sends completed at their last byte, before CHUNK_DONE
    uint64_t chunks_native
    uint64_t chunks_written         # writes into the peer's posted buffers
    uint64_t sent_put               # messages written into a buffer the peer posted
    uint64_t posts_offered          # our recv_into buffers offered to the peer
    uint64_t puts_received          # ... that the peer wrote a message into
    uint64_t fabric_sends
    uint64_t frames_sent
    uint64_t fabric_recvs
    uint64_t rndv_copied        # rendezvous messages pulled ahead, then copied into recv_into's buffer
    uint64_t frames_received
    uint8_t hello[56]
    fab_mr* hello_mr
    int fault_stage_due         # fault injection: a stage reached, fires once its frame is posted
    uint64_t fault_seq          #   ... once data slab fault_seq is posted (0: the next control slab)
    int own_regions             # registrations of the endpoint's own buffers (slabs, HELLO)
    fab_mr fault_stale          # FAULT_STALE_KEY: a chunk's registration as it was before release
    int fault_has_stale
    uint64_t seq_sealed
    uint64_t seq_posted
    sendop_t* sendq_head
    sendop_t* sendq_tail
    sendop_t* rndv_out
    sendop_t* zc_out
    sendop_t* put_out               # put ops framed, writes still pending
    # the peer's post (core/posted.pxi): a buffer for our message peer_post_id
    uint32_t peer_features          # its HELLO's features
    uint64_t decided_id             # our last message whose use of a post was decided
    int peer_post_active
    uint64_t peer_posts             # POSTs the peer sent (it posts: look for one before a large send)
    int peer_posts_follow           # the last message decided had a POST, in time or just late
    uint64_t peer_post_id
    uint64_t peer_post_addr
    uint64_t peer_post_cap
    uint32_t peer_post_rkey_len
    uint8_t peer_post_rkey[256]
    int fault_has_stale_post        # FAULT_STALE_POST: the previous post, released since
    uint64_t fault_stale_post_addr
    uint8_t fault_stale_post_rkey[256]
    # receive side
    uint64_t next_in_id
    inmsg_t* inq_head
    inmsg_t* inq_tail
    inmsg_t* rndv_in
    size_t inbuf_bytes
    uint32_t c2r
    uint32_t c2r_quiet      # of c2r: for messages that only returned credits (no explicit CREDIT for them)
    uint32_t held
    posted_t posted
    # our post: posted.dst registered for the peer to write message post_id into
    int post_state                  # POST_NONE / POST_POSTED / POST_WITHDRAWING
    uint64_t post_id
    char* post_dst
    size_t post_cap
    fab_mr post_mr
    double post_deadline            # withdrawing: the peer must answer by then
    uint32_t post_misses            # posts in a row the peer did not use

cdef struct auth_t:
    # Peer authentication on the raw socket (core/auth.pxi), before the
    # backend builds anything on it. Freed when it ends either way.
    int fd                      # owned until the channel takes it
    int role                    # ROLE_CONNECTOR / ROLE_ACCEPTOR
    int stage                   # AS_PREAMBLE, AS_PEER_MAC, AS_FLUSH
    int heard                   # bytes received from the peer (0: a silent connection)
    double answered             # acceptor: when its preamble went into the queue
    double started
    uint8_t ours[48]            # our preamble
    uint8_t theirs[48]          # the peer's preamble
    uint8_t mac[32]             # the peer's MAC
    uint8_t out[80]             # what we still send: preamble, then our MAC
    uint32_t out_len
    uint32_t out_done
    uint32_t in_done            # of the preamble, then of the MAC
    fab_attach attach           # connector: how to build the channel once the peer passed

cdef struct lst_t:
    node_t node
    worker_t* w
    fab_listener* fl
    ep_t* pending
    ep_t* ready_head
    ep_t* ready_tail
    int npending
    uint32_t nconnections       # admitted (past the preamble) and not yet closed or dead
    int closed
    int disarmed                # the listening socket is out of the epoll set (table full, or EMFILE)
    double rearm_at             # ... until then (or, table full, until a pending handshake ends)
    int out_of_fds              # disarmed because accept() failed (EMFILE): only the time re-arms
    uint64_t refused            # connections refused by authentication
    uint64_t evicted            # pending handshakes dropped to make room for new ones
    char last_refusal[200]

cdef struct worker_t:
    pthread_mutex_t lock
    size_t inbuf_total          # sum of the endpoints' inbuf_bytes (total_recv_budget)
    pthread_cond_t cond
    int epfd
    int polling
    int waiters
    node_t** slots
    uint32_t* gens
    uint32_t nslots
    opts_t opts
    sendop_t* reap
    # background progress (see progress_thread_main)
    pthread_cond_t bg_cond
    pthread_t bg_thread
    int bg_running
    int bg_state
    int bg_stop
    uint64_t bg_rounds          # rounds of progress the thread made for an absent application
    uint64_t bg_loop_rounds     # ... of them for a polling event loop that was busy
    uint32_t large_sends        # sends above the eager limit, pulls served by our CPU, not finished
    int wake_fd
    int timer_fd                # the engine's one timer (core/timers.pxi)
    double timer_at             # ... set to fire then (0: disarmed)
    int notify_fd               # written after progress by other threads while a loop waits
    int loop_polling            # an asyncio loop watches epfd (it is the poller)
    int loop_attached           # a loop has used this worker: progress elsewhere notifies it
    double last_app
    fab_hub* hub                # the domain's shared progress (one fd for all its channels), or NULL
    int hub_pending             # arm found the hub busy: run it before blocking
    uint64_t hub_pass
    qlink_t* dirty              # endpoints to re-arm before blocking
    qlink_t* runnable           # endpoints that can progress without waiting
    qlink_t* touched            # nodes progressed since the event loop last looked
    int closed                  # Fabric.close(): every call fails, waits end
    int in_wait                 # threads inside worker_wait (close waits for them to leave)
    int fork_gen                # fork generation at creation: a forked child must not use it
    uint64_t gen                # touches of any node (fabric.aio waits on "anything moved")
    uint8_t* auth_key           # the shared secret (Fabric(auth_key=...)), or NULL: none
    size_t auth_key_len
    char backend_name[8]        # in the preamble: both ends must run the same fabric
