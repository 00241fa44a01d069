from cpython.buffer cimport Py_buffer

from fabric.grpc._hpack cimport Decoder, Encoder
from fabric.grpc._outbuf cimport outbuf_t


cdef class Stream:
    cdef readonly unsigned int id
    cdef readonly bint is_new            # opened by the peer and not yet handed to the driver
    cdef public object headers           # the first header block received (list of (name, value))
    cdef public object trailers          # the second (trailers), or None
    cdef public object messages          # complete gRPC messages received (bytes), oldest first
    cdef public Py_ssize_t queued_bytes  # bytes of those messages
    cdef public bint ended               # END_STREAM received
    cdef public bint local_closed        # END_STREAM sent, or the stream was reset
    cdef public object reset_code        # RST_STREAM code sent or received, else None
    cdef public bint peer_done           # the peer ended the stream, then reset it with NO_ERROR
    cdef public object failure           # what ends the call here (a broken or oversized message...)
    cdef public object owner             # the driver's object for this call
    cdef public object on_event          # the driver's callback, if it wants one
    cdef public Py_ssize_t max_receive   # largest message accepted (-1: no limit)
    cdef public object encoding          # the peer's grpc-encoding (str) or None
    cdef bint touched
    cdef bint in_table                   # still in the connection's table of open streams
    cdef bint outbound                   # opened by us
    cdef long long send_window
    cdef long long recv_window
    cdef long long unacked               # received bytes not yet given back as window
    cdef long long ack_pending           # given back but not yet announced
    cdef long long content_length        # -1: no content-length header
    cdef long long data_received
    # the message being assembled
    cdef unsigned char prefix[5]
    cdef int prefix_fill
    cdef int flag
    cdef long long need                  # its length, or -1 while its prefix is read
    cdef long long fill
    cdef object small                    # bytearray of a small message spread over frames
    cdef object dest                     # bytes of a large message, written in place
    cdef object dest_view                # a writable view of dest
    cdef char* dest_ptr
    # the message being sent
    cdef Py_buffer out_buf
    cdef bint out_held
    cdef object out_obj
    cdef Py_ssize_t out_pos
    cdef unsigned char out_prefix[5]
    cdef int out_prefix_left
    cdef bint out_end

    cdef void _release_out(self) noexcept


cdef class Connection:
    cdef readonly bint client_side
    cdef Decoder decoder
    cdef Encoder encoder
    cdef public dict streams             # stream id -> Stream, for open streams
    cdef list touched
    cdef readonly object dead            # why the connection failed, once it did
    # settings: what we sent (in force once sent) and what the peer sent
    cdef readonly long long local_initial_window
    cdef readonly long long local_max_frame
    cdef readonly long long local_max_concurrent
    cdef readonly long long local_max_header_list
    cdef readonly long long remote_initial_window
    cdef readonly long long remote_max_frame
    cdef readonly long long remote_max_concurrent
    cdef readonly long long remote_max_header_list
    cdef readonly bint got_settings
    cdef readonly long long send_window
    cdef long long recv_window
    cdef long long conn_ack_pending
    cdef long long connection_window
    cdef readonly unsigned int next_stream_id
    cdef readonly unsigned int highest_inbound
    cdef readonly int open_outbound
    cdef readonly int open_inbound
    cdef readonly object goaway_received  # (last stream id, error code, debug data) of the peer's GOAWAY
    cdef readonly long long goaway_sent_last   # -1: none sent
    cdef readonly int events             # EV_* since take_events()
    cdef public list ping_acks           # opaque data of PING ACKs received
    cdef readonly long long pings_received
    cdef public Py_ssize_t queued_high_water
    cdef public Py_ssize_t max_receive   # default for new streams
    cdef public bint validate            # check received headers against RFC 9113 8.2-8.3
    cdef readonly long long data_frames_sent
    cdef readonly long long data_frames_received
    cdef readonly long long zero_copy_pieces_sent
    cdef readonly long long direct_bytes_received
    # input
    cdef int in_state
    cdef int preface_left
    cdef unsigned char hdr[9]
    cdef int hdr_fill
    cdef int f_type
    cdef int f_flags
    cdef unsigned int f_sid
    cdef long long f_len
    cdef long long f_left                # bytes of this frame still to come
    cdef long long f_keep                # of those, bytes kept in fbuf (the rest is skipped)
    cdef long long data_left
    cdef long long pad_left
    cdef Stream f_stream                 # the stream a DATA frame feeds, or None (discarded)
    cdef outbuf_t fbuf
    cdef unsigned int cont_sid           # a header block is open on this stream (CONTINUATION due)
    cdef bint cont_end_stream
    cdef outbuf_t hblock
    # output
    cdef outbuf_t out
    cdef list segments

    cdef int _receive(self, const unsigned char* p, Py_ssize_t n) except -1
    cdef int _begin_frame(self) except -1
    cdef int _frame_complete(self, const unsigned char* p, Py_ssize_t n) except -1
    cdef int _data_bytes(self, const unsigned char* p, Py_ssize_t n) except -1
    cdef int _data_frame_end(self) except -1
    cdef int _headers_complete(self) except -1
    cdef int _settings(self, const unsigned char* p, Py_ssize_t n) except -1
    cdef int _feed_message(self, Stream s, const unsigned char* p, Py_ssize_t n) except -1
    cdef int _message_done(self, Stream s, object msg) except -1
    cdef int _conn_error(self, int code, str text) except -1
    cdef int _stream_error(self, Stream s, int code, str text) except -1
    cdef int _touch(self, Stream s) except -1
    cdef int _maybe_close(self, Stream s) except -1
    cdef int _close_stream(self, Stream s) except -1
    cdef int _ack(self, Stream s) except -1
    cdef int _conn_ack(self, long long n) except -1
    cdef int _frame(self, Py_ssize_t length, int ftype, int flags, unsigned int sid) except -1
    cdef int _window_update(self, unsigned int sid, long long n) except -1
    cdef int _encode_headers(self, Stream s, object headers, bint end_stream) except -1
    cdef int _pump(self, Stream s) except -1
    cdef int _cut(self) except -1
    cdef int _goaway_body(self, unsigned int last, unsigned int code, bytes debug) except -1
    cdef bint _is_idle(self, unsigned int sid) noexcept
