# cython: language_level=3
"""fabric.grpc's HTTP/2 core (RFC 9113), for gRPC's use of it, in C: no I/O
(the drivers, fabric/grpc/_http2.py with threads and _aio_http2.py with
asyncio, own the byte stream), and no Python object per frame.

Bytes in: receive(data) takes what the stream delivered, any amount, and
returns the streams it changed. What a driver sees are whole things: a
stream's headers, its complete gRPC messages (the 5-byte length prefix is
cut here, messages are bytes of their final size; a large one is written in
place, and direct_target()/direct_advance() let the driver read the rest of
a DATA frame straight into it), its trailers, its end or reset. Connection
events (PING ACKs, GOAWAY, more send window) are bits in `events`.

Bytes out: every call that sends queues frames; take_output() hands them out
in order as a list of buffers, small frames coalesced into one bytes object
and large DATA payloads as views of the sender's own buffer (zero-copy: a
fabric stream moves such a view by rendezvous into the peer's message).

Protocol errors become HTTP/2 errors as the RFC says: a stream error resets
that stream (RST_STREAM), a connection error queues GOAWAY with the code and
raises H2Error; after it the connection only says it is dead.

Settings ours take effect when sent (a peer may use a larger frame or window
as soon as it has read them, as grpcio does). Not supported, being outside
gRPC: server push (SETTINGS_ENABLE_PUSH is 0 from clients, PUSH_PROMISE is a
protocol error), priorities (parsed and ignored), the CONNECT method.
"""
import collections
import enum

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.memoryview cimport PyMemoryView_FromObject
from cpython.tuple cimport PyTuple_GET_ITEM
from libc.string cimport memcmp, memcpy

from fabric._buffers import new_bytes
from fabric.grpc._hpack import HpackError
from fabric.grpc._hpack cimport Decoder, Encoder
from fabric.grpc._outbuf cimport ob_byte, ob_clear, ob_free, ob_put, ob_reserve, outbuf_t


class ErrorCodes(enum.IntEnum):
    """HTTP/2 error codes (RFC 9113 section 7)."""
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


def error_name(code):
    try:
        return ErrorCodes(code).name
    except ValueError:
        return f"error {code:#x}"


class H2Error(Exception):
    """A connection error: the peer broke HTTP/2 (or asked us to stop).
    GOAWAY with `code` is queued; the connection is dead."""

    def __init__(self, code, text):
        super().__init__(text)
        self.code = code
        self.text = text


cdef enum:
    F_DATA = 0x0
    F_HEADERS = 0x1
    F_PRIORITY = 0x2
    F_RST_STREAM = 0x3
    F_SETTINGS = 0x4
    F_PUSH_PROMISE = 0x5
    F_PING = 0x6
    F_GOAWAY = 0x7
    F_WINDOW_UPDATE = 0x8
    F_CONTINUATION = 0x9

    FL_END_STREAM = 0x1
    FL_ACK = 0x1
    FL_END_HEADERS = 0x4
    FL_PADDED = 0x8
    FL_PRIORITY = 0x20

    E_NO_ERROR = 0
    E_PROTOCOL = 1
    E_INTERNAL = 2
    E_FLOW_CONTROL = 3
    E_STREAM_CLOSED = 5
    E_FRAME_SIZE = 6
    E_REFUSED_STREAM = 7
    E_CANCEL = 8
    E_COMPRESSION = 9
    E_ENHANCE_YOUR_CALM = 0xB

    S_HEADER_TABLE_SIZE = 1
    S_ENABLE_PUSH = 2
    S_MAX_CONCURRENT_STREAMS = 3
    S_INITIAL_WINDOW_SIZE = 4
    S_MAX_FRAME_SIZE = 5
    S_MAX_HEADER_LIST_SIZE = 6

    IN_PREFACE = 0
    IN_HEADER = 1
    IN_PAYLOAD = 2      # a frame kept whole (f_keep bytes) before it is handled
    IN_PADLEN = 3       # DATA: its pad length byte
    IN_DATA = 4
    IN_SKIP = 5         # padding, or bytes of a frame nobody keeps


# connection events (Connection.events, cleared by take_events())
EV_WINDOW = 1           # more send window, or a stream slot freed: senders and openers retry
EV_PING_ACK = 2         # ping_acks has data
EV_PING = 4             # the peer pinged (pings_received)
EV_GOAWAY = 8           # goaway_received is set
EV_SETTINGS = 16        # the peer's settings changed

DATA_FRAME = F_DATA
HEADERS_FRAME = F_HEADERS
END_STREAM_FLAG = FL_END_STREAM

cdef bytes PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
cdef long long MAX_WINDOW = 2147483647
cdef long long MAX_STREAM_ID = 2147483647
DIRECT_MIN = 64 << 10          # messages from this size are allocated whole and filled in place
ZERO_COPY_MIN = 64 << 10       # DATA payload pieces from this size leave as views, not copies
cdef Py_ssize_t C_DIRECT_MIN = 64 << 10
cdef Py_ssize_t C_ZERO_COPY_MIN = 64 << 10
cdef long long ACK_MIN = 1 << 20       # window given back in announcements of at least this (or a quarter)
cdef Py_ssize_t GOAWAY_DEBUG_KEPT = 1024
cdef Py_ssize_t BLOCK_FACTOR = 4       # raw header block bytes kept, per byte of header list allowed

cdef object _wire = None


cdef object wire():
    """fabric.grpc._wire (gRPC's message rules), imported on first use."""
    global _wire
    if _wire is None:
        from fabric.grpc import _wire as w
        _wire = w
    return _wire


cdef object wire_error(str code_name, str details):
    import grpc
    return wire().WireError(getattr(grpc.StatusCode, code_name), details)


cdef inline unsigned int rd24(const unsigned char* p) noexcept:
    return (<unsigned int>p[0] << 16) | (<unsigned int>p[1] << 8) | p[2]


cdef inline unsigned int rd32(const unsigned char* p) noexcept:
    return (<unsigned int>p[0] << 24) | (<unsigned int>p[1] << 16) | (<unsigned int>p[2] << 8) | p[3]


cdef inline void wr32(unsigned char* p, unsigned int v) noexcept:
    p[0] = (v >> 24) & 0xFF
    p[1] = (v >> 16) & 0xFF
    p[2] = (v >> 8) & 0xFF
    p[3] = v & 0xFF


cdef set CONNECTION_HEADERS = {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding",
                               b"upgrade"}
cdef set REQUEST_PSEUDO = {b":method", b":scheme", b":path", b":authority"}


cdef str malformed(list headers, int kind):
    """Why a header list breaks RFC 9113 8.2-8.3, or None. kind: 0 request,
    1 response, 2 trailers."""
    cdef bint regular_seen = False
    cdef object name, value
    cdef const unsigned char* p
    cdef Py_ssize_t i, n
    cdef set pseudo = set()
    for h in headers:
        name = <object>PyTuple_GET_ITEM(h, 0)
        value = <object>PyTuple_GET_ITEM(h, 1)
        n = PyBytes_GET_SIZE(name)
        if n == 0:
            return "an empty header name"
        p = <const unsigned char*>PyBytes_AS_STRING(name)
        for i in range(n):
            if (p[i] >= 65 and p[i] <= 90) or p[i] <= 32 or p[i] >= 127 or (p[i] == 58 and i > 0):
                return f"header name {name!r} is not a lowercase token"
        p = <const unsigned char*>PyBytes_AS_STRING(value)
        for i in range(PyBytes_GET_SIZE(value)):
            if p[i] == 0 or p[i] == 10 or p[i] == 13:
                return f"header {name!r} has NUL, CR or LF in its value"
        if (<const unsigned char*>PyBytes_AS_STRING(name))[0] == 58:      # ':' pseudo-header
            if regular_seen:
                return f"pseudo-header {name!r} after a regular header"
            if kind == 2:
                return f"pseudo-header {name!r} in trailers"
            if name in pseudo:
                return f"pseudo-header {name!r} twice"
            if kind == 0 and name not in REQUEST_PSEUDO:
                return f"pseudo-header {name!r} in a request"
            if kind == 1 and name != b":status":
                return f"pseudo-header {name!r} in a response"
            pseudo.add(name)
        else:
            regular_seen = True
            if name in CONNECTION_HEADERS:
                return f"connection-specific header {name!r}"
            if name == b"te" and value != b"trailers":
                return f"te: {value!r} (only 'trailers' is allowed)"
    if kind == 0:
        for need in (b":method", b":scheme", b":path"):
            if need not in pseudo:
                return f"request without {need.decode()}"
    elif kind == 1 and b":status" not in pseudo:
        return "response without :status"
    return None


cdef long long content_length_of(list headers):
    for h in headers:
        if <object>PyTuple_GET_ITEM(h, 0) == b"content-length":
            try:
                return int(<object>PyTuple_GET_ITEM(h, 1))
            except ValueError:
                return -2
    return -1


cdef object encoding_of(list headers):
    for h in headers:
        if <object>PyTuple_GET_ITEM(h, 0) == b"grpc-encoding":
            return (<bytes>PyTuple_GET_ITEM(h, 1)).decode("ascii", "replace")
    return None


cdef class Stream:
    """One HTTP/2 stream (one gRPC call): what it received, its windows."""

    def __cinit__(self):
        self.messages = collections.deque()
        self.need = -1
        self.content_length = -1
        self.max_receive = -1

    def __dealloc__(self):
        if self.out_held:
            PyBuffer_Release(&self.out_buf)

    cdef void _release_out(self) noexcept:
        if self.out_held:
            PyBuffer_Release(&self.out_buf)
            self.out_held = False
        self.out_obj = None

    @property
    def sending(self):
        """A message is partly sent (waiting for window)."""
        return self.out_held or self.out_prefix_left > 0

    @property
    def open(self):
        return self.in_table

    @property
    def partial(self):
        """Inside a message (its prefix or payload not complete)."""
        return self.prefix_fill > 0 or self.need >= 0

    def take_message(self):
        """The oldest complete message; the caller gives its window back with
        Connection.consume(stream, len(msg))."""
        return self.messages.popleft()

    def __repr__(self):
        return (f"<h2 stream {self.id} ended={self.ended} local_closed={self.local_closed} "
                f"reset={self.reset_code} messages={len(self.messages)}>")


cdef class Connection:
    """One HTTP/2 connection's state (see the module's doc)."""

    def __init__(self, bint client_side, long long initial_window=65535, long long connection_window=65535,
                 long long max_frame=16384, long long max_concurrent=100, long long max_header_list=65536,
                 Py_ssize_t max_receive=-1, Py_ssize_t queued_high_water=64 << 20):
        if not 16384 <= max_frame <= 16777215:
            raise ValueError("max_frame must be 16384 .. 2**24 - 1")
        if not 0 <= initial_window <= MAX_WINDOW or not 65535 <= connection_window <= MAX_WINDOW:
            raise ValueError("windows must be within 0 .. 2**31 - 1 (the connection's at least 65535)")
        self.client_side = client_side
        self.decoder = Decoder(max_header_list)
        self.encoder = Encoder()
        self.streams = {}
        self.touched = []
        self.segments = []
        self.ping_acks = []
        self.local_initial_window = initial_window
        self.local_max_frame = max_frame
        self.local_max_concurrent = max_concurrent
        self.local_max_header_list = max_header_list
        self.connection_window = connection_window
        self.remote_initial_window = 65535
        self.remote_max_frame = 16384
        self.remote_max_concurrent = MAX_STREAM_ID
        self.remote_max_header_list = -1
        self.send_window = 65535
        self.recv_window = 65535
        self.next_stream_id = 1 if client_side else 2
        self.goaway_sent_last = -1
        self.in_state = IN_HEADER if client_side else IN_PREFACE
        self.preface_left = 0 if client_side else len(PREFACE)
        self.max_receive = max_receive
        self.queued_high_water = queued_high_water
        self.validate = True

    def __dealloc__(self):
        ob_free(&self.fbuf)
        ob_free(&self.hblock)
        ob_free(&self.out)

    # ------------------------------------------------------------ set-up
    def initiate(self):
        """Our preface: (client) the magic, then SETTINGS, then the
        connection window beyond the initial 65535."""
        cdef unsigned char body[36]
        cdef int n = 0
        settings = [(S_MAX_CONCURRENT_STREAMS, self.local_max_concurrent),
                    (S_INITIAL_WINDOW_SIZE, self.local_initial_window),
                    (S_MAX_FRAME_SIZE, self.local_max_frame),
                    (S_MAX_HEADER_LIST_SIZE, self.local_max_header_list)]
        if self.client_side:
            ob_put(&self.out, PyBytes_AS_STRING(PREFACE), len(PREFACE))
            settings.insert(0, (S_ENABLE_PUSH, 0))
        for ident, value in settings:
            body[n] = 0
            body[n + 1] = ident
            wr32(body + n + 2, <unsigned int>value)
            n += 6
        self._frame(n, F_SETTINGS, 0, 0)
        ob_put(&self.out, body, n)
        if self.connection_window > 65535:
            self._window_update(0, self.connection_window - 65535)
            self.recv_window = self.connection_window

    # ------------------------------------------------------------ output
    cdef int _frame(self, Py_ssize_t length, int ftype, int flags, unsigned int sid) except -1:
        cdef unsigned char h[9]
        h[0] = (length >> 16) & 0xFF
        h[1] = (length >> 8) & 0xFF
        h[2] = length & 0xFF
        h[3] = ftype
        h[4] = flags
        wr32(h + 5, sid & 0x7FFFFFFF)
        return ob_put(&self.out, h, 9)

    cdef int _window_update(self, unsigned int sid, long long n) except -1:
        cdef unsigned char b[4]
        self._frame(4, F_WINDOW_UPDATE, 0, sid)
        wr32(b, <unsigned int>n)
        return ob_put(&self.out, b, 4)

    cdef int _cut(self) except -1:
        """What is in the output buffer becomes a segment of its own."""
        if self.out.len:
            self.segments.append(PyBytes_FromStringAndSize(<char*>self.out.data, self.out.len))
            ob_clear(&self.out)
        return 0

    def take_output(self):
        """The frames queued since the last call, in order: a list of bytes
        (small frames, coalesced) and memoryviews (large DATA payloads, still
        the sender's buffer: write them before that buffer changes); None
        when nothing is queued."""
        if self.out.len:
            if not self.segments:
                out = PyBytes_FromStringAndSize(<char*>self.out.data, self.out.len)
                ob_clear(&self.out)
                return [out]
            self._cut()
        if not self.segments:
            return None
        out = self.segments
        self.segments = []
        return out

    @property
    def counters(self):
        return {"data_frames_sent": self.data_frames_sent, "data_frames_received": self.data_frames_received,
                "zero_copy_pieces_sent": self.zero_copy_pieces_sent,
                "direct_bytes_received": self.direct_bytes_received}

    @property
    def has_output(self):
        return self.out.len > 0 or len(self.segments) > 0

    def take_events(self):
        cdef int ev = self.events
        self.events = 0
        return ev

    # ------------------------------------------------------------ errors
    cdef int _conn_error(self, int code, str text) except -1:
        cdef bytes debug
        if self.dead is None:
            self.dead = f"HTTP/2 protocol error from the peer ({error_name(code)}): {text}"
            debug = text.encode("utf-8", "replace")[:256]
            self._frame(8 + len(debug), F_GOAWAY, 0, 0)
            self._goaway_body(self.highest_inbound, code, debug)
        raise H2Error(code, self.dead)

    cdef int _stream_error(self, Stream s, int code, str text) except -1:
        """Reset s with code; the call fails with text."""
        cdef unsigned char b[4]
        if s.failure is None:
            s.failure = H2Error(code, f"HTTP/2 stream error ({error_name(code)}): {text}")
        if s.in_table:
            self._frame(4, F_RST_STREAM, 0, s.id)
            wr32(b, <unsigned int>code)
            ob_put(&self.out, b, 4)
            if s.reset_code is None:
                s.reset_code = code
            self._close_stream(s)
        self._touch(s)
        return 0

    cdef int _goaway_body(self, unsigned int last, unsigned int code, bytes debug) except -1:
        cdef unsigned char b[8]
        wr32(b, last & 0x7FFFFFFF)
        wr32(b + 4, code)
        ob_put(&self.out, b, 8)
        ob_put(&self.out, PyBytes_AS_STRING(debug), len(debug))
        return 0

    # ------------------------------------------------------------ streams
    cdef int _touch(self, Stream s) except -1:
        if not s.touched:
            s.touched = True
            self.touched.append(s)
        return 0

    cdef int _close_stream(self, Stream s) except -1:
        if s.in_table:
            s.in_table = False
            self.streams.pop(s.id, None)
            if s.outbound:
                self.open_outbound -= 1
            else:
                self.open_inbound -= 1
            self.events |= EV_WINDOW
            # what the peer still sends on it is discarded: its window goes back
            if s.unacked:
                self._conn_ack(s.unacked)
                s.unacked = 0
        s._release_out()
        s.out_prefix_left = 0
        return 0

    cdef int _maybe_close(self, Stream s) except -1:
        if s.ended and s.local_closed:
            self._close_stream(s)
        return 0

    @property
    def can_open(self):
        """A new stream may be opened now (the peer's limit, no GOAWAY)."""
        return (self.dead is None and self.goaway_received is None
                and self.open_outbound < self.remote_max_concurrent and self.next_stream_id <= MAX_STREAM_ID)

    def open_stream(self, headers, bint end_stream=False):
        """(client) A new stream with its request headers queued."""
        cdef Stream s
        if self.dead is not None:
            raise H2Error(E_PROTOCOL, self.dead)
        if self.goaway_received is not None:
            raise H2Error(E_NO_ERROR, "the server sent GOAWAY: no new streams")
        if self.next_stream_id > MAX_STREAM_ID:
            raise H2Error(E_NO_ERROR, "stream ids exhausted: open a new connection")
        s = Stream.__new__(Stream)
        s.id = self.next_stream_id
        self.next_stream_id += 2
        s.outbound = True
        s.in_table = True
        s.send_window = self.remote_initial_window
        s.recv_window = self.local_initial_window
        s.max_receive = self.max_receive
        self.streams[s.id] = s
        self.open_outbound += 1
        self._encode_headers(s, headers, end_stream)
        return s

    cdef int _encode_headers(self, Stream s, object headers, bint end_stream) except -1:
        """HEADERS (and CONTINUATION when the block exceeds the peer's frame size)."""
        cdef Py_ssize_t start = self.out.len, block, first, piece, pos
        cdef long long frame_max = self.remote_max_frame
        cdef int flags
        ob_reserve(&self.out, 9)
        self.out.len += 9                                # the HEADERS frame header, written below
        self.encoder.encode_into(headers, &self.out)
        block = self.out.len - start - 9
        flags = FL_END_STREAM if end_stream else 0
        if block <= frame_max:
            self.out.len = start
            self._frame(block, F_HEADERS, flags | FL_END_HEADERS, s.id)
            self.out.len = start + 9 + block
        else:
            # rare: cut the block into HEADERS + CONTINUATION frames
            raw = PyBytes_FromStringAndSize(<char*>self.out.data + start + 9, block)
            self.out.len = start
            pos = 0
            while pos < block:
                piece = min(block - pos, frame_max)
                last = pos + piece == block
                if pos == 0:
                    self._frame(piece, F_HEADERS, flags | (FL_END_HEADERS if last else 0), s.id)
                else:
                    self._frame(piece, F_CONTINUATION, FL_END_HEADERS if last else 0, s.id)
                ob_put(&self.out, PyBytes_AS_STRING(raw) + pos, piece)
                pos += piece
        if end_stream:
            s.local_closed = True
            s._release_out()
            self._maybe_close(s)
        return 0

    def send_headers(self, Stream s not None, headers, bint end_stream=False):
        """HEADERS on s: response headers, or (end_stream) trailers."""
        if self.dead is not None:
            raise H2Error(E_PROTOCOL, self.dead)
        if s.local_closed or not s.in_table:
            raise ValueError(f"stream {s.id} is closed for sending")
        self._encode_headers(s, headers, end_stream)

    def send_message(self, Stream s not None, data, bint compressed=False, bint end_stream=False):
        """A gRPC message (prefix and payload) on s, as far as the windows
        allow: True if all of it is queued; else call pump(s) once the
        window grows (EV_WINDOW). data must stay unchanged until then, and
        until the output that holds its views has been written."""
        cdef Py_ssize_t n
        if self.dead is not None:
            raise H2Error(E_PROTOCOL, self.dead)
        if s.local_closed or not s.in_table:
            raise ValueError(f"stream {s.id} is closed for sending")
        if s.out_held or s.out_prefix_left:
            raise ValueError(f"stream {s.id} is still sending a message")
        PyObject_GetBuffer(data, &s.out_buf, PyBUF_SIMPLE)
        s.out_held = True
        s.out_obj = data
        s.out_pos = 0
        n = s.out_buf.len
        if n > 0xFFFFFFFF:
            s._release_out()
            raise ValueError("a gRPC message holds at most 4 GiB")
        s.out_prefix[0] = 1 if compressed else 0
        wr32(s.out_prefix + 1, <unsigned int>n)
        s.out_prefix_left = 5
        s.out_end = end_stream
        return self._pump(s) == 1

    def pump(self, Stream s not None):
        """Go on with s's message; True once all of it is queued (or the
        stream is gone: check its state)."""
        if self.dead is not None:
            raise H2Error(E_PROTOCOL, self.dead)
        return self._pump(s) == 1

    cdef int _pump(self, Stream s) except -1:
        cdef long long room, left, n, k, m
        cdef bint fin
        cdef const unsigned char* base
        while True:
            if not s.in_table or s.local_closed:
                s._release_out()
                s.out_prefix_left = 0
                return 1
            left = s.out_prefix_left + (s.out_buf.len - s.out_pos if s.out_held else 0)
            if left == 0 and not s.out_held:
                return 1
            room = self.send_window
            if s.send_window < room:
                room = s.send_window
            if self.remote_max_frame < room:
                room = self.remote_max_frame
            if room <= 0 and left > 0:
                return 0
            n = left if left < room else room
            fin = s.out_end and n == left
            self._frame(n, F_DATA, FL_END_STREAM if fin else 0, s.id)
            self.data_frames_sent += 1
            k = s.out_prefix_left if s.out_prefix_left < n else n
            if k:
                ob_put(&self.out, s.out_prefix + 5 - s.out_prefix_left, k)
                s.out_prefix_left -= k
            m = n - k
            if m:
                base = <const unsigned char*>s.out_buf.buf
                if m >= C_ZERO_COPY_MIN:
                    self._cut()
                    view = PyMemoryView_FromObject(s.out_obj)
                    if view.ndim != 1 or view.itemsize != 1 or view.format not in ("B", "b", "c"):
                        view = view.cast("B")
                    self.segments.append(view[s.out_pos:s.out_pos + m])
                    self.zero_copy_pieces_sent += 1
                else:
                    ob_put(&self.out, base + s.out_pos, m)
                s.out_pos += m
            self.send_window -= n
            s.send_window -= n
            if s.out_pos >= s.out_buf.len and s.out_prefix_left == 0:
                s._release_out()
                if fin:
                    s.local_closed = True
                    self._maybe_close(s)
                return 1

    def end_stream(self, Stream s not None):
        """END_STREAM on s (an empty DATA frame)."""
        if self.dead is not None:
            raise H2Error(E_PROTOCOL, self.dead)
        if s.local_closed or not s.in_table:
            return
        self._frame(0, F_DATA, FL_END_STREAM, s.id)
        s.local_closed = True
        self._maybe_close(s)

    def reset_stream(self, Stream s not None, int code=E_CANCEL):
        """RST_STREAM on s (if still open); s is closed."""
        cdef unsigned char b[4]
        if s.reset_code is None:
            s.reset_code = code
        if s.in_table and self.dead is None:
            self._frame(4, F_RST_STREAM, 0, s.id)
            wr32(b, <unsigned int>code)
            ob_put(&self.out, b, 4)
        s.local_closed = True
        self._close_stream(s)

    def stream_send_window(self, Stream s not None):
        """What s may send now (connection and stream windows)."""
        return min(self.send_window, s.send_window)

    def ping(self, data):
        cdef bytes b = bytes(data)
        if len(b) != 8:
            raise ValueError("PING data is 8 bytes")
        self._frame(8, F_PING, 0, 0)
        ob_put(&self.out, PyBytes_AS_STRING(b), 8)

    def goaway(self, long long last_stream_id, int code=E_NO_ERROR, debug=b""):
        """GOAWAY: (server) streams above last_stream_id are refused from
        now on; those at or below it go on."""
        cdef bytes d = bytes(debug)
        self._frame(8 + len(d), F_GOAWAY, 0, 0)
        self._goaway_body(<unsigned int>last_stream_id, code, d)
        if self.goaway_sent_last < 0 or last_stream_id < self.goaway_sent_last:
            self.goaway_sent_last = last_stream_id

    def consume(self, Stream s not None, Py_ssize_t n):
        """The application took n bytes of s's messages: its window may go
        back to the peer."""
        s.queued_bytes -= n
        if s.unacked and s.queued_bytes <= self.queued_high_water:
            self._ack(s)

    cdef int _ack(self, Stream s) except -1:
        """Give s's received bytes back as window (both the stream's and the
        connection's), announced once they add up."""
        cdef long long n = s.unacked, threshold
        s.unacked = 0
        if n <= 0:
            return 0
        if s.in_table and not s.ended:
            s.ack_pending += n
            threshold = self.local_initial_window // 4
            if threshold > ACK_MIN:
                threshold = ACK_MIN
            if s.ack_pending >= threshold:
                self._window_update(s.id, s.ack_pending)
                s.recv_window += s.ack_pending
                s.ack_pending = 0
        return self._conn_ack(n)

    cdef int _conn_ack(self, long long n) except -1:
        cdef long long threshold = self.connection_window // 4
        self.conn_ack_pending += n
        if threshold > ACK_MIN:
            threshold = ACK_MIN
        if self.conn_ack_pending >= threshold and self.dead is None:
            self._window_update(0, self.conn_ack_pending)
            self.recv_window += self.conn_ack_pending
            self.conn_ack_pending = 0
        return 0

    # ------------------------------------------------------------ input
    def receive(self, data):
        """Take bytes from the peer; the streams they changed (new ones
        among them: is_new), in the order first changed. Raises H2Error on
        a connection error (GOAWAY is queued: write the output, then close)."""
        cdef Py_buffer view
        if self.dead is not None:
            raise H2Error(E_PROTOCOL, self.dead)
        PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
        try:
            self._receive(<const unsigned char*>view.buf, view.len)
        finally:
            PyBuffer_Release(&view)
        return self._take_touched()

    def _take_touched(self):
        out = self.touched
        if not out:
            return out
        self.touched = []
        for s in out:
            (<Stream>s).touched = False
        return out

    def direct_target(self):
        """Where the rest of the current DATA frame's payload can be read
        straight to (a writable view into a large message being assembled),
        or None. Fill it with a read, then call direct_advance(n)."""
        cdef Stream s = self.f_stream
        cdef long long m
        if self.in_state != IN_DATA or s is None or s.dest is None or s.failure is not None or self.dead is not None:
            return None
        m = s.need - s.fill
        if self.data_left < m:
            m = self.data_left
        if m <= 0:
            return None
        return s.dest_view[s.fill:s.fill + m]

    def direct_advance(self, Py_ssize_t n):
        """n bytes were read into direct_target(); the streams changed."""
        cdef Stream s = self.f_stream
        if self.in_state != IN_DATA or s is None or s.dest is None or n > self.data_left or n > s.need - s.fill:
            raise ValueError("direct_advance without a matching direct_target")
        self.direct_bytes_received += n
        s.fill += n
        self.data_left -= n
        if s.fill == s.need:
            msg = s.dest
            s.dest = s.dest_view = None
            s.need = -1
            self._message_done(s, msg)
        if self.data_left == 0:
            if self.pad_left:
                self.in_state = IN_SKIP
                self.f_left = self.pad_left
            else:
                self._data_frame_end()
        return self._take_touched()

    cdef int _receive(self, const unsigned char* p, Py_ssize_t n) except -1:
        cdef Py_ssize_t pos = 0, k
        cdef const unsigned char* magic
        while pos < n:
            if self.dead is not None:
                raise H2Error(E_PROTOCOL, self.dead)
            if self.in_state == IN_HEADER:
                if self.hdr_fill == 0 and n - pos >= 9:
                    memcpy(self.hdr, p + pos, 9)
                    pos += 9
                    self.hdr_fill = 9
                else:
                    k = 9 - self.hdr_fill
                    if k > n - pos:
                        k = n - pos
                    memcpy(self.hdr + self.hdr_fill, p + pos, k)
                    self.hdr_fill += k
                    pos += k
                if self.hdr_fill < 9:
                    return 0
                self.hdr_fill = 0
                self._begin_frame()
                if self.in_state == IN_PAYLOAD and self.f_keep == self.f_left and n - pos >= self.f_left:
                    # the whole frame is here: handle it in place
                    k = self.f_left
                    self.in_state = IN_HEADER
                    self._frame_complete(p + pos, k)
                    pos += k
            elif self.in_state == IN_DATA:
                k = self.data_left
                if k > n - pos:
                    k = n - pos
                self._data_bytes(p + pos, k)
                pos += k
                self.data_left -= k
                if self.data_left == 0:
                    if self.pad_left:
                        self.in_state = IN_SKIP
                        self.f_left = self.pad_left
                    else:
                        self._data_frame_end()
            elif self.in_state == IN_PAYLOAD:
                k = self.f_keep - self.fbuf.len
                if k > n - pos:
                    k = n - pos
                if k > 0:
                    ob_put(&self.fbuf, p + pos, k)
                    pos += k
                    self.f_left -= k
                if self.fbuf.len == self.f_keep:
                    if self.f_left:
                        self.in_state = IN_SKIP       # the part of the frame nobody keeps
                    else:
                        self.in_state = IN_HEADER
                        try:
                            self._frame_complete(self.fbuf.data, self.fbuf.len)
                        finally:
                            ob_clear(&self.fbuf)
            elif self.in_state == IN_SKIP:
                k = self.f_left
                if k > n - pos:
                    k = n - pos
                pos += k
                self.f_left -= k
                if self.f_left == 0:
                    if self.f_type == F_DATA:
                        self._data_frame_end()
                    else:
                        self.in_state = IN_HEADER
                        if self.f_keep:
                            try:
                                self._frame_complete(self.fbuf.data, self.fbuf.len)
                            finally:
                                ob_clear(&self.fbuf)
            elif self.in_state == IN_PADLEN:
                self.pad_left = p[pos]
                pos += 1
                self.f_left -= 1
                if self.pad_left > self.f_left:
                    self._conn_error(E_PROTOCOL, "DATA padding longer than the frame")
                self.data_left = self.f_left - self.pad_left
                self.in_state = IN_DATA
                if self.data_left == 0:
                    if self.pad_left:
                        self.in_state = IN_SKIP
                        self.f_left = self.pad_left
                    else:
                        self._data_frame_end()
            else:                                    # IN_PREFACE
                magic = <const unsigned char*>PyBytes_AS_STRING(PREFACE)
                k = self.preface_left
                if k > n - pos:
                    k = n - pos
                if memcmp(p + pos, magic + len(PREFACE) - self.preface_left, k) != 0:
                    self._conn_error(E_PROTOCOL, "not an HTTP/2 client connection preface")
                pos += k
                self.preface_left -= k
                if self.preface_left == 0:
                    self.in_state = IN_HEADER
        return 0

    cdef int _begin_frame(self) except -1:
        """A frame header was read: check it, and set up how its payload is taken."""
        cdef const unsigned char* h = self.hdr
        cdef long long length = rd24(h)
        cdef int ftype = h[3], flags = h[4]
        cdef unsigned int sid = rd32(h + 5) & 0x7FFFFFFF
        cdef Stream s
        self.f_type = ftype
        self.f_flags = flags
        self.f_sid = sid
        self.f_len = self.f_left = length
        self.f_keep = length
        self.pad_left = 0
        if length > self.local_max_frame:
            self._conn_error(E_FRAME_SIZE, f"a frame of {length} bytes, above the {self.local_max_frame} we allow")
        if self.cont_sid and (ftype != F_CONTINUATION or sid != self.cont_sid):
            self._conn_error(E_PROTOCOL, f"frame type {ftype} inside the header block of stream {self.cont_sid}")
        if not self.got_settings and (ftype != F_SETTINGS or flags & FL_ACK):
            self._conn_error(E_PROTOCOL, "the peer's first frame is not SETTINGS")
        if ftype == F_DATA:
            if sid == 0:
                self._conn_error(E_PROTOCOL, "DATA on stream 0")
            self.data_frames_received += 1
            if length > self.recv_window:
                self._conn_error(E_FLOW_CONTROL, f"DATA of {length} bytes beyond the connection window "
                                                 f"({self.recv_window})")
            self.recv_window -= length
            s = <Stream>self.streams.get(sid)
            self.f_stream = None
            if s is None:
                if self._is_idle(sid):
                    self._conn_error(E_PROTOCOL, f"DATA on idle stream {sid}")
                self._conn_ack(length)                   # a closed stream: discarded, window back
            elif s.ended:
                self._conn_ack(length)
                self._stream_error(s, E_STREAM_CLOSED, "DATA after the end of the stream")
            elif length > s.recv_window:
                self._conn_ack(length)
                self._stream_error(s, E_FLOW_CONTROL, f"DATA of {length} bytes beyond the stream window")
            else:
                s.recv_window -= length
                s.unacked += length
                self.f_stream = s
            if flags & FL_PADDED:
                if length == 0:
                    self._conn_error(E_FRAME_SIZE, "padded DATA without a pad length")
                self.in_state = IN_PADLEN
            else:
                self.data_left = length
                self.in_state = IN_DATA
                if length == 0:
                    self._data_frame_end()
            return 0
        if ftype == F_HEADERS or ftype == F_CONTINUATION:
            if sid == 0:
                self._conn_error(E_PROTOCOL, "a header block on stream 0")
            if ftype == F_CONTINUATION and self.cont_sid == 0:
                self._conn_error(E_PROTOCOL, "CONTINUATION without a header block open")
            if self.hblock.len + length > self.local_max_header_list * BLOCK_FACTOR + 4096:
                self._conn_error(E_ENHANCE_YOUR_CALM, "a header block far above the header list size we allow")
        elif ftype == F_SETTINGS:
            if sid != 0:
                self._conn_error(E_PROTOCOL, "SETTINGS on a stream")
            if flags & FL_ACK and length:
                self._conn_error(E_FRAME_SIZE, "SETTINGS ACK with a payload")
            if length % 6:
                self._conn_error(E_FRAME_SIZE, "SETTINGS length not a multiple of 6")
        elif ftype == F_PING:
            if sid != 0:
                self._conn_error(E_PROTOCOL, "PING on a stream")
            if length != 8:
                self._conn_error(E_FRAME_SIZE, "PING of other than 8 bytes")
        elif ftype == F_GOAWAY:
            if sid != 0:
                self._conn_error(E_PROTOCOL, "GOAWAY on a stream")
            if length < 8:
                self._conn_error(E_FRAME_SIZE, "GOAWAY shorter than 8 bytes")
            if length > 8 + GOAWAY_DEBUG_KEPT:
                self.f_keep = 8 + GOAWAY_DEBUG_KEPT
        elif ftype == F_RST_STREAM:
            if sid == 0:
                self._conn_error(E_PROTOCOL, "RST_STREAM on stream 0")
            if length != 4:
                self._conn_error(E_FRAME_SIZE, "RST_STREAM of other than 4 bytes")
        elif ftype == F_WINDOW_UPDATE:
            if length != 4:
                self._conn_error(E_FRAME_SIZE, "WINDOW_UPDATE of other than 4 bytes")
        elif ftype == F_PRIORITY:
            if sid == 0:
                self._conn_error(E_PROTOCOL, "PRIORITY on stream 0")
            if length != 5:
                self._conn_error(E_FRAME_SIZE, "PRIORITY of other than 5 bytes")
        elif ftype == F_PUSH_PROMISE:
            self._conn_error(E_PROTOCOL, "PUSH_PROMISE (push is not enabled)")
        else:
            self.f_keep = 0                              # unknown type: ignored (RFC 9113 4.1)
        if self.f_keep == 0 and self.f_left == 0:
            self.in_state = IN_HEADER
            if ftype <= F_CONTINUATION:
                self._frame_complete(NULL, 0)
        elif self.f_keep == 0:
            self.in_state = IN_SKIP
        else:
            self.in_state = IN_PAYLOAD
        return 0

    cdef bint _is_idle(self, unsigned int sid) noexcept:
        """A stream id not used yet, in either direction."""
        if (sid & 1) == (1 if self.client_side else 0):         # ours
            return sid >= self.next_stream_id
        return sid > self.highest_inbound

    cdef int _data_bytes(self, const unsigned char* p, Py_ssize_t n) except -1:
        cdef Stream s = self.f_stream
        if s is None or n == 0:
            return 0
        s.data_received += n
        if s.failure is not None or s.reset_code is not None:
            return 0
        return self._feed_message(s, p, n)

    cdef int _data_frame_end(self) except -1:
        cdef Stream s = self.f_stream
        self.in_state = IN_HEADER
        self.f_stream = None
        if s is None:
            return 0
        if self.f_flags & FL_END_STREAM:
            s.ended = True
            if s.failure is None and (s.prefix_fill or s.need >= 0):
                s.failure = wire_error("INTERNAL", "stream ended inside a message")
            if s.failure is None and s.content_length >= 0 and s.content_length != s.data_received:
                self._stream_error(s, E_PROTOCOL, "content-length differs from the DATA received")
                return 0
            self._touch(s)
        if s.queued_bytes <= self.queued_high_water:
            self._ack(s)
        if s.ended:
            self._maybe_close(s)
        return 0

    cdef int _feed_message(self, Stream s, const unsigned char* p, Py_ssize_t n) except -1:
        """DATA payload bytes into s's messages."""
        cdef Py_ssize_t k, want
        cdef long long length
        while n > 0:
            if s.failure is not None:
                return 0                                 # the call has failed: the rest is discarded
            if s.need < 0:
                k = 5 - s.prefix_fill
                if k > n:
                    k = n
                memcpy(s.prefix + s.prefix_fill, p, k)
                s.prefix_fill += k
                p += k
                n -= k
                if s.prefix_fill < 5:
                    return 0
                s.prefix_fill = 0
                s.flag = s.prefix[0]
                length = rd32(s.prefix + 1)
                if s.flag > 1:
                    s.failure = wire_error("INTERNAL", f"bad message flag {s.flag}")
                    self._touch(s)
                    return 0
                if s.flag == 1:
                    if s.encoding in (None, "identity"):
                        s.failure = wire_error("INTERNAL", "compressed message received without a grpc-encoding")
                        self._touch(s)
                        return 0
                    # the limit is on the inflated size; deflate's output is
                    # at most a little larger than its input
                    if s.max_receive >= 0 and length > s.max_receive + (s.max_receive >> 10) + 1024:
                        s.failure = wire_error("RESOURCE_EXHAUSTED", f"Received message larger than max "
                                                                     f"({length} vs. {s.max_receive})")
                        self._touch(s)
                        return 0
                elif s.max_receive >= 0 and length > s.max_receive:
                    s.failure = wire_error("RESOURCE_EXHAUSTED",
                                           f"Received message larger than max ({length} vs. {s.max_receive})")
                    self._touch(s)
                    return 0
                s.fill = 0
                if length == 0:
                    self._message_done(s, b"")
                    continue
                s.need = length
                if length >= C_DIRECT_MIN:
                    s.dest, s.dest_view = new_bytes(length)
                    s.dest_ptr = PyBytes_AS_STRING(s.dest)
                continue
            want = s.need - s.fill
            if s.dest is not None:
                k = want if want < n else n
                memcpy(s.dest_ptr + s.fill, p, k)
                s.fill += k
                p += k
                n -= k
                if s.fill == s.need:
                    msg = s.dest
                    s.dest = s.dest_view = None
                    s.need = -1
                    self._message_done(s, msg)
                continue
            if s.small is None and n >= want:
                msg = PyBytes_FromStringAndSize(<const char*>p, want)     # the common case: one copy
                p += want
                n -= want
                s.need = -1
                self._message_done(s, msg)
                continue
            if s.small is None:
                s.small = bytearray()
            k = want if want < n else n
            s.small += PyBytes_FromStringAndSize(<const char*>p, k)
            s.fill += k
            p += k
            n -= k
            if s.fill == s.need:
                msg = bytes(s.small)
                s.small = None
                s.need = -1
                self._message_done(s, msg)
        return 0

    cdef int _message_done(self, Stream s, object msg) except -1:
        if s.flag:
            try:
                msg = wire().decompress(msg, s.encoding, s.max_receive)
            except Exception as e:
                s.failure = e
                self._touch(s)
                return 0
        s.messages.append(msg)
        s.queued_bytes += len(msg)
        self._touch(s)
        return 0

    cdef int _frame_complete(self, const unsigned char* p, Py_ssize_t n) except -1:
        """A whole non-DATA frame (payload p[:n])."""
        cdef int ftype = self.f_type, flags = self.f_flags
        cdef unsigned int sid = self.f_sid
        cdef Py_ssize_t pad = 0, off = 0
        cdef unsigned int code, last
        cdef long long inc
        cdef Stream s
        if ftype == F_HEADERS:
            if flags & FL_PADDED:
                if n < 1:
                    self._conn_error(E_FRAME_SIZE, "padded HEADERS without a pad length")
                pad = p[0]
                off = 1
            if flags & FL_PRIORITY:
                off += 5
            if off + pad > n:
                self._conn_error(E_PROTOCOL, "HEADERS padding or priority longer than the frame")
            ob_put(&self.hblock, p + off, n - off - pad)
            self.cont_end_stream = flags & FL_END_STREAM
            if flags & FL_END_HEADERS:
                self._headers_complete()
            else:
                self.cont_sid = sid
        elif ftype == F_CONTINUATION:
            ob_put(&self.hblock, p, n)
            if flags & FL_END_HEADERS:
                self.cont_sid = 0
                self._headers_complete()
        elif ftype == F_SETTINGS:
            if not flags & FL_ACK:
                self._settings(p, n)
                self._frame(0, F_SETTINGS, FL_ACK, 0)
                self.got_settings = True
        elif ftype == F_PING:
            if flags & FL_ACK:
                self.ping_acks.append(PyBytes_FromStringAndSize(<const char*>p, 8))
                self.events |= EV_PING_ACK
            else:
                self._frame(8, F_PING, FL_ACK, 0)
                ob_put(&self.out, p, 8)
                self.pings_received += 1
                self.events |= EV_PING
        elif ftype == F_GOAWAY:
            last = rd32(p) & 0x7FFFFFFF
            code = rd32(p + 4)
            debug = PyBytes_FromStringAndSize(<const char*>p + 8, n - 8)
            if self.goaway_received is not None and last > self.goaway_received[0]:
                last = self.goaway_received[0]      # a later GOAWAY cannot take back its refusal
            self.goaway_received = (last, code, debug)
            self.events |= EV_GOAWAY | EV_WINDOW
        elif ftype == F_RST_STREAM:
            code = rd32(p)
            s = <Stream>self.streams.get(sid)
            if s is None:
                if self._is_idle(sid):
                    self._conn_error(E_PROTOCOL, f"RST_STREAM on idle stream {sid}")
                return 0
            if s.ended and code == E_NO_ERROR:
                s.peer_done = True
            elif s.reset_code is None:
                s.reset_code = code
            s.local_closed = True
            self._close_stream(s)
            self._touch(s)
        elif ftype == F_WINDOW_UPDATE:
            inc = rd32(p) & 0x7FFFFFFF
            if sid == 0:
                if inc == 0:
                    self._conn_error(E_PROTOCOL, "WINDOW_UPDATE of 0 on the connection")
                self.send_window += inc
                if self.send_window > MAX_WINDOW:
                    self._conn_error(E_FLOW_CONTROL, "connection window above 2**31 - 1")
                self.events |= EV_WINDOW
            else:
                s = <Stream>self.streams.get(sid)
                if s is None:
                    if self._is_idle(sid):
                        self._conn_error(E_PROTOCOL, f"WINDOW_UPDATE on idle stream {sid}")
                    return 0
                if inc == 0:
                    self._stream_error(s, E_PROTOCOL, "WINDOW_UPDATE of 0")
                    return 0
                s.send_window += inc
                if s.send_window > MAX_WINDOW:
                    self._stream_error(s, E_FLOW_CONTROL, "stream window above 2**31 - 1")
                    return 0
                self.events |= EV_WINDOW
        # PRIORITY, unknown types: nothing to do
        return 0

    cdef int _settings(self, const unsigned char* p, Py_ssize_t n) except -1:
        cdef Py_ssize_t i
        cdef int ident
        cdef long long value, delta
        cdef Stream s
        for i in range(0, n, 6):
            ident = (p[i] << 8) | p[i + 1]
            value = rd32(p + i + 2)
            if ident == S_HEADER_TABLE_SIZE:
                self.encoder.set_peer_limit(value)
            elif ident == S_ENABLE_PUSH:
                if value > 1:
                    self._conn_error(E_PROTOCOL, f"SETTINGS_ENABLE_PUSH {value}")
                # 1 from a server is refused by RFC 9113 but harmless: we never
                # accept a PUSH_PROMISE, so it is ignored
            elif ident == S_MAX_CONCURRENT_STREAMS:
                self.remote_max_concurrent = value
            elif ident == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    self._conn_error(E_FLOW_CONTROL, f"SETTINGS_INITIAL_WINDOW_SIZE {value}")
                delta = value - self.remote_initial_window
                self.remote_initial_window = value
                for s in self.streams.values():
                    s.send_window += delta
                    if s.send_window > MAX_WINDOW:
                        self._conn_error(E_FLOW_CONTROL, "a stream window above 2**31 - 1 after SETTINGS")
            elif ident == S_MAX_FRAME_SIZE:
                if value < 16384 or value > 16777215:
                    self._conn_error(E_PROTOCOL, f"SETTINGS_MAX_FRAME_SIZE {value}")
                self.remote_max_frame = value
            elif ident == S_MAX_HEADER_LIST_SIZE:
                self.remote_max_header_list = value
        self.events |= EV_SETTINGS | EV_WINDOW
        return 0

    cdef int _headers_complete(self) except -1:
        cdef unsigned int sid = self.f_sid
        cdef bint end_stream = self.cont_end_stream
        cdef list headers = []
        cdef int too_large
        cdef Stream s
        cdef str why
        try:
            too_large = self.decoder.decode_into(self.hblock.data, self.hblock.len, headers)
        except HpackError as e:
            ob_clear(&self.hblock)
            self._conn_error(E_COMPRESSION, str(e))
        ob_clear(&self.hblock)
        s = <Stream>self.streams.get(sid)
        if not self.client_side and s is None:
            if sid % 2 == 0:
                self._conn_error(E_PROTOCOL, f"HEADERS on even stream {sid} from a client")
            if sid <= self.highest_inbound:
                return 0                                  # a stream closed already: ignored
            self.highest_inbound = sid
            s = Stream.__new__(Stream)
            s.id = sid
            s.send_window = self.remote_initial_window
            s.recv_window = self.local_initial_window
            s.max_receive = self.max_receive
            if (self.goaway_sent_last >= 0 and sid > self.goaway_sent_last) or \
                    self.open_inbound >= self.local_max_concurrent:
                s.in_table = True
                self.open_inbound += 1
                self.streams[sid] = s
                self.reset_stream(s, E_REFUSED_STREAM)
                return 0
            s.in_table = True
            s.is_new = True
            self.streams[sid] = s
            self.open_inbound += 1
            why = "request header list too large" if too_large else (
                malformed(headers, 0) if self.validate else None)
            s.headers = headers
            s.encoding = encoding_of(headers)
            s.content_length = content_length_of(headers)
            if end_stream:
                s.ended = True
            if why is not None:
                if too_large:
                    s.failure = wire_error("RESOURCE_EXHAUSTED", f"request headers above the "
                                                                 f"{self.local_max_header_list} bytes allowed")
                    self._touch(s)
                else:
                    self._stream_error(s, E_PROTOCOL, why)
                return 0
            if s.content_length == -2:
                self._stream_error(s, E_PROTOCOL, "malformed content-length")
                return 0
            self._touch(s)
            return 0
        if s is None:
            if self._is_idle(sid):
                self._conn_error(E_PROTOCOL, f"HEADERS on idle stream {sid}")
            return 0                                      # closed: ignored (its HPACK state is kept)
        if s.ended:
            self._stream_error(s, E_STREAM_CLOSED, "HEADERS after the end of the stream")
            return 0
        if too_large:
            s.failure = wire_error("RESOURCE_EXHAUSTED", "received header list larger than allowed")
            self._stream_error(s, E_CANCEL, "header list too large")
            return 0
        if self.client_side and s.headers is None:
            status = None
            for h in headers:
                if <object>PyTuple_GET_ITEM(h, 0) == b":status":
                    status = <object>PyTuple_GET_ITEM(h, 1)
                    break
            if status is not None and len(status) == 3 and status[:1] == b"1" and not end_stream:
                return 0                                  # 1xx: informational, the real response follows
            why = malformed(headers, 1) if self.validate else None
            if why is not None:
                self._stream_error(s, E_PROTOCOL, why)
                return 0
            s.headers = headers
            s.encoding = encoding_of(headers)
            s.content_length = content_length_of(headers)
        else:
            if not end_stream:
                self._stream_error(s, E_PROTOCOL, "a second header block without END_STREAM")
                return 0
            why = malformed(headers, 2) if self.validate else None
            if why is not None:
                self._stream_error(s, E_PROTOCOL, why)
                return 0
            s.trailers = headers
        if end_stream:
            s.ended = True
            if s.failure is None and (s.prefix_fill or s.need >= 0):
                s.failure = wire_error("INTERNAL", "stream ended inside a message")
        self._touch(s)
        if end_stream:
            self._maybe_close(s)
        return 0

    def accepted(self, Stream s not None):
        """(server) The driver has taken the new stream s."""
        s.is_new = False

    @property
    def idle(self):
        """No stream open."""
        return not self.streams

    def __repr__(self):
        return (f"<h2 {'client' if self.client_side else 'server'} connection streams={len(self.streams)} "
                f"send_window={self.send_window} dead={self.dead!r}>")
