# cython: language_level=3
"""Buffers the transport fills in place.

new_bytes(n) -> (bytes, writable memoryview of it): a bytes object of n
bytes, not yet seen by anyone, that a receive can land in directly, so a
large message reaches code that wants `bytes` (grpcio's API, protobuf)
without a copy. Write it fully before handing the bytes object out; never
write through the view afterwards (bytes are immutable once shared).

Large ones are recycled: a bytes object of ours that nobody references any
more (its only reference is our cache's) is handed out again as a new one.
Fresh memory for every large message costs more than the transfer: each
16 MiB buffer from the C allocator arrives as unmapped pages the kernel
must fault in and zero (measured: gRPC streams of 16 MiB over shared memory
moved 4.3 GB/s into fresh buffers, 8 GB/s into recycled ones).
FABRIC_RECV_CACHE (bytes, default 128 MiB; 0 turns recycling off) bounds
the idle memory the cache may keep."""
import os

from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.ref cimport PyObject


cdef extern from *:
    """
    /* A bytes object caches its hash; a recycled one must not keep the old one. */
    static inline void fabric_bytes_forget_hash(PyObject *b) {
    #if PY_VERSION_HEX < 0x030F0000
        _Py_COMP_DIAG_PUSH
        _Py_COMP_DIAG_IGNORE_DEPR_DECLS
        ((PyBytesObject *)b)->ob_shash = -1;
        _Py_COMP_DIAG_POP
    #endif
    }
    """
    void bytes_forget_hash "fabric_bytes_forget_hash"(PyObject* b)
    Py_ssize_t Py_REFCNT(PyObject* o)


RECYCLE_MIN = 1 << 20            # smaller buffers come back warm from the allocator anyway
CACHE_ENTRIES = 8


def _cache_limit():
    text = os.environ.get("FABRIC_RECV_CACHE", "")
    if not text:
        return 128 << 20
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"FABRIC_RECV_CACHE must be a number of bytes, not {text!r}") from None
    if value < 0:
        raise ValueError("FABRIC_RECV_CACHE must be >= 0")
    return value


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


cdef class _Recycler:
    """Large bytes objects handed out, most recently used last. Runs with the
    GIL held throughout, so a reference count read here cannot change under it."""
    cdef list entries
    cdef Py_ssize_t limit
    cdef readonly Py_ssize_t reused
    cdef readonly Py_ssize_t allocated

    def __init__(self, Py_ssize_t limit):
        self.entries = []
        self.limit = limit

    cdef object take(self, Py_ssize_t n):
        cdef Py_ssize_t i, count = PyList_GET_SIZE(self.entries)
        cdef PyObject* b
        for i in range(count - 1, -1, -1):
            b = <PyObject*>PyList_GET_ITEM(self.entries, i)
            # our list's reference is the only one: nobody can see it change
            if Py_REFCNT(b) == 1 and PyBytes_GET_SIZE(<object>b) == n:
                found = self.entries.pop(i)
                bytes_forget_hash(b)
                self.entries.append(found)
                self.reused += 1
                return found
        found = PyBytes_FromStringAndSize(NULL, n)
        self.allocated += 1
        if n <= self.limit:
            self.entries.append(found)
            self._bound()
        return found

    cdef void _bound(self):
        """Forget the least recently used entries beyond the limits (one still
        in use simply stays with its user)."""
        cdef Py_ssize_t total = 0
        for b in self.entries:
            total += PyBytes_GET_SIZE(b)
        while self.entries and (len(self.entries) > CACHE_ENTRIES or total > self.limit):
            total -= PyBytes_GET_SIZE(self.entries.pop(0))

    def idle_bytes(self):
        """Memory held only by the cache."""
        cdef Py_ssize_t total = 0
        for b in self.entries:
            if Py_REFCNT(<PyObject*>b) == 2:      # the list's and this loop's
                total += PyBytes_GET_SIZE(b)
        return total

    def clear(self):
        """Forget every entry and reset the counters."""
        self.entries = []
        self.reused = self.allocated = 0


cdef _Recycler _recycler = _Recycler(_cache_limit())


def recycler():
    """The process's cache of large receive buffers (stats, clear())."""
    return _recycler


def new_bytes(Py_ssize_t n):
    if n < 0:
        raise ValueError("size must be >= 0")
    cdef object b
    if n >= RECYCLE_MIN and _recycler.limit > 0:
        b = _recycler.take(n)
    else:
        b = PyBytes_FromStringAndSize(NULL, n)
    cdef _Fill f = _Fill.__new__(_Fill)
    f.owner = b
    f.data = PyBytes_AS_STRING(b)
    f.size = n
    return b, memoryview(f)
