# cython: language_level=3
"""Buffers the transport fills in place.

new_bytes(n) -> (bytes, writable memoryview of it): a bytes object of n
bytes, not yet seen by anyone, that a receive can land in directly, so a
large message reaches code that wants `bytes` (grpcio's API, protobuf)
without a copy. Write it fully before handing the bytes object out; never
write through the view afterwards (bytes are immutable once shared)."""
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.buffer cimport PyBUF_WRITABLE


cdef class _Fill:
    cdef object owner
    cdef char* data
    cdef Py_ssize_t size
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __getbuffer__(self, Py_buffer* view, int flags):
        self.shape[0] = self.size
        self.strides[0] = 1
        view.buf = self.data
        view.obj = self
        view.len = self.size
        view.readonly = 0
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = self.shape
        view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer* view):
        pass


def new_bytes(Py_ssize_t n):
    if n < 0:
        raise ValueError("size must be >= 0")
    cdef object b = PyBytes_FromStringAndSize(NULL, n)
    cdef _Fill f = _Fill.__new__(_Fill)
    f.owner = b
    f.data = PyBytes_AS_STRING(b)
    f.size = n
    return b, memoryview(f)
