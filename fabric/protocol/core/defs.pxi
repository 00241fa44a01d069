# Part of fabric.protocol.engine (included by engine.pyx).
#
# Constants of the engine: endpoint and operation states, completion tags,
# error codes of our own, limits, and the test-only fault stages.

cdef enum:
    EP_HANDSHAKE = 1
    EP_OPEN = 2
    EP_FAILED = 3        # marked failed, not yet settled
    EP_DEAD = 4          # channel closed, operations failed
    EP_AUTH = 5          # authenticating the peer on the raw socket; no channel yet

cdef enum:
    OP_QUEUED = 1
    OP_ZC = 2
    OP_RNDV = 3
    OP_DONE = 4
    OP_FAILED = 5
    OP_PUT = 6           # being written into the peer's posted buffer

cdef enum:
    TAG_SLAB = 1
    TAG_OP = 2
    TAG_DESC = 3
    TAG_NATIVE = 4       # a native chunk send of a rendezvous op
    TAG_WRITE = 5        # a write of a put op into the peer's posted buffer
    TAG_MASK = 7         # malloc returns 16-byte aligned blocks

cdef enum:
    KIND_EP = 1
    KIND_LST = 2

cdef enum:
    ESHUTDOWN_ = 108     # closed, locally or by the peer's CLOSE
    EBUSY_ = 16          # another receive is in progress
    EACCES_ = 13         # the peer refused a read, or offered a bad region
    EKEYREJECTED_ = 129  # authentication failed (AuthenticationError)
    ECONNREFUSED_ = 111  # a listener at max_connections turned the connection away

cdef enum:
    CREDIT_RESERVE = 2      # credits kept for control frames
    MAX_EVENTS = 32
    MAX_SEGMENTS_ZC = 62    # scatter entries sent zero-copy in one send
    WAIT_SLICE_MS = 200     # blocking waits wake this often to check signals

cdef enum:
    BG_BEHIND_POLLER = 1 # an application thread is blocked in epoll: asleep until it leaves
    BG_WATCHING = 2      # the application is active: re-check after the grace period
    BG_POLLING = 3       # blocked in epoll, progressing for an application that is away
    BG_LOOKING = 4       # an event loop polls: watching, not taking, for an event it leaves waiting

cdef enum:
    FAULT_BAD_KEY = 1      # announce chunks with a forged remote key
    FAULT_BAD_RANGE = 2    # announce chunks at an address past their region
    FAULT_FLOOD = 3        # ignore the peer's max_rendezvous and chunks_in_flight
    FAULT_FOREIGN_KEY = 4  # announce another connection's live chunk (its address and key)
    FAULT_STALE_KEY = 5    # announce a chunk released after an earlier message completed
    FAULT_BAD_WRITE = 6    # write into the peer's post across its end
    FAULT_STALE_POST = 7   # write a message into the previous message's post (released since)

# Test-only stage faults (FABRIC_FAULT_INJECT=<action>@<stage>[:<n>]): this
# Fabric's process dies (SIGKILL, no clean-up at all) or its endpoint sends a
# garbage fabric message at the n-th time (default 1st) one of its endpoints
# reaches the stage. tests/test_faults.py drives every pair on every backend.
cdef enum:
    FA_DIE = 1
    FA_GARBAGE = 2

cdef enum:
    FS_HELLO = 1           # instead of sending HELLO
    FS_RNDV = 2            # once a message's first RNDV announcement was posted
    FS_PULL = 3            # once the first read of a message was issued (receiver)
    FS_CHUNK_DONE = 4      # once a CHUNK_DONE was posted (receiver)
    FS_BATCH = 5           # posting a coalesced batch of 3 or more frames (garbage: its 2nd frame)
    FS_CLOSE = 6           # once CLOSE was posted
    FS_PUT = 7             # once the first write of a message into the peer's post was issued

FAULT_ACTIONS = {"die": FA_DIE, "garbage": FA_GARBAGE}
FAULT_STAGES = {"hello": FS_HELLO, "rndv": FS_RNDV, "pull": FS_PULL, "chunk_done": FS_CHUNK_DONE,
                "batch": FS_BATCH, "close": FS_CLOSE, "put": FS_PUT}

cdef uint8_t GARBAGE[64]
for _i in range(64):
    GARBAGE[_i] = (0x5A ^ (_i * 37)) & 0xFF     # never a frame: bad magic at offset 0

cdef extern from "<signal.h>" nogil:
    int kill(int pid, int sig)
    enum:
        SIGKILL

cdef uint32_t NO_CHUNK = 0xFFFFFFFFU
cdef size_t NATIVE_CHUNK = 1 << 30
cdef uint64_t WAKE_KEY = 0xFFFFFFFFFFFFFFFFU
cdef uint64_t HUB_KEY = 0xFFFFFFFFFFFFFFFEU
cdef double BG_GRACE = 0.001    # application idle this long before the thread polls
# An event loop that polls for the worker and has not entered the engine for
# this long may have missed something (a frame a send read into a channel's
# buffer, where no descriptor announces it): the progress thread looks.
cdef double LOOP_SILENCE = 0.1
# A polling event loop that has not entered the engine for LOOP_BUSY may be
# running the application rather than its selector; an event it then leaves
# waiting LOOP_ANSWER (an idle loop takes one in tens of microseconds) is
# served by the progress thread. (1 ms cost a gRPC loop busy with 1000
# concurrent calls about 10% of its rate, A/B; 5 ms slowed 16 MiB pulls.)
cdef double LOOP_BUSY = 0.002
cdef double LOOP_ANSWER = 0.0005
# With no large send in flight the thread only checks, this often, whether
# one has started (a loop that is active otherwise needs nothing from it).
cdef double LOOP_CHECK = 0.004


ctypedef int (*pred_fn)(void* arg) noexcept nogil

# A pending handshake younger than this is never dropped to make room for a
# new connection (a legitimate peer answers in milliseconds, even loaded).
cdef double EVICT_GRACE = 0.5
