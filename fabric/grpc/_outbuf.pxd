# A growable byte buffer in C memory, for the HTTP/2 core's output and its
# partial input frames (inline functions: nothing is compiled here).
from libc.stdlib cimport free, realloc
from libc.string cimport memcpy


cdef struct outbuf_t:
    unsigned char* data
    Py_ssize_t len
    Py_ssize_t cap


cdef inline int ob_reserve(outbuf_t* b, Py_ssize_t extra) except -1:
    """Room for extra more bytes."""
    cdef Py_ssize_t want = b.len + extra
    cdef Py_ssize_t cap
    cdef unsigned char* p
    if want <= b.cap:
        return 0
    cap = b.cap * 2 if b.cap else 512
    while cap < want:
        cap *= 2
    p = <unsigned char*>realloc(b.data, cap)
    if p == NULL:
        raise MemoryError()
    b.data = p
    b.cap = cap
    return 0


cdef inline int ob_put(outbuf_t* b, const void* src, Py_ssize_t n) except -1:
    if n <= 0:
        return 0
    ob_reserve(b, n)
    memcpy(b.data + b.len, src, n)
    b.len += n
    return 0


cdef inline int ob_byte(outbuf_t* b, unsigned char c) except -1:
    if b.len >= b.cap:
        ob_reserve(b, 1)
    b.data[b.len] = c
    b.len += 1
    return 0


cdef inline void ob_clear(outbuf_t* b) noexcept:
    """Empty; memory kept (a large one is given back)."""
    b.len = 0
    if b.cap > (1 << 20):
        free(b.data)
        b.data = NULL
        b.cap = 0


cdef inline void ob_free(outbuf_t* b) noexcept:
    free(b.data)
    b.data = NULL
    b.len = b.cap = 0
