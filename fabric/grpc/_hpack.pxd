from fabric.grpc._outbuf cimport outbuf_t


cdef class Decoder:
    cdef list entries                  # the dynamic table, newest last: (name, value) tuples
    cdef Py_ssize_t size               # its size as RFC 7541 counts it (32 + name + value per entry)
    cdef Py_ssize_t max_size           # its current limit (the encoder's last size update)
    cdef readonly Py_ssize_t settings_max   # what we allow (SETTINGS_HEADER_TABLE_SIZE we sent)
    cdef public Py_ssize_t max_header_list  # decoded bytes of one header list we keep

    cdef int decode_into(self, const unsigned char* p, Py_ssize_t n, list out) except -1
    cdef object _entry(self, Py_ssize_t index)
    cdef int _add(self, object entry) except -1
    cdef void _evict(self) noexcept


cdef class Encoder:
    cdef dict exact                    # (name, value) -> insertion number
    cdef dict by_name                  # name -> insertion number of its newest entry
    cdef object fifo                   # (insertion number, size, (name, value)), oldest first
    cdef long long inserted            # insertions so far: the newest entry is number inserted - 1
    cdef Py_ssize_t size
    cdef readonly Py_ssize_t max_size
    cdef Py_ssize_t limit              # the most we use, whatever the peer allows
    cdef Py_ssize_t pending_update     # 1: size updates go first in the next block; -1: none
    cdef Py_ssize_t smallest_update    # the smallest size since the last block
    cdef void _evict_to(self, Py_ssize_t limit)

    cdef int encode_into(self, object headers, outbuf_t* out) except -1
    cdef int _add(self, object header, Py_ssize_t entry_size) except -1
