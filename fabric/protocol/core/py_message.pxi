# Part of fabric.protocol.engine (included by engine.pyx).
#
# Python layer: Message (a received message owning its memory), send
# buffers taken from Python objects (op_from / op_release), and Request (a
# non-blocking receive into the caller's buffer).

def _warn_unclosed(what):
    """A ResourceWarning, as sockets give for what was never closed (silent
    while the interpreter shuts down)."""
    try:
        if not _sys.is_finalizing():
            _warnings.warn(f"unclosed {what}; close it (or use it as a context manager)", ResourceWarning, 2)
    except Exception:
        pass


cdef class Message:
    """A received message: a writable buffer owning its memory.

    Use it wherever a buffer is accepted (memoryview, numpy.frombuffer,
    bytes(m)); it compares equal to bytes with the same content."""
    cdef char* data
    cdef Py_ssize_t length
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __dealloc__(self):
        msg_free(self.data)

    def __len__(self):
        return self.length

    def __getbuffer__(self, Py_buffer* view, int flags):
        self.shape[0] = self.length
        self.strides[0] = 1
        view.buf = self.data
        view.obj = self
        view.len = self.length
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL
        if flags & 4:         # PyBUF_FORMAT
            view.format = BYTE_FORMAT
        view.ndim = 1
        view.shape = self.shape if (flags & 8) else NULL   # PyBUF_ND
        view.strides = self.strides if (flags & 16) == 16 else NULL
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __bytes__(self):
        return self.data[:self.length]

    def __getitem__(self, key):
        return memoryview(self)[key]

    def tobytes(self):
        return self.data[:self.length]

    def __eq__(self, other):
        try:
            return memoryview(self) == memoryview(other).cast("B")
        except TypeError:
            return NotImplemented

    def __hash__(self):
        raise TypeError("Message is mutable and unhashable")

    def __repr__(self):
        head = self.data[:min(self.length, 16)]
        return f"<fabric.Message {self.length} bytes {head!r}{'...' if self.length > 16 else ''}>"


cdef char* BYTE_FORMAT = "B"


cdef Message make_message(char* data, size_t length):
    cdef Message m = Message.__new__(Message)
    m.data = data
    m.length = <Py_ssize_t>length
    return m


def new_message(Py_ssize_t n):
    """A writable Message of n bytes from received-message memory (huge pages
    already faulted in when large): a buffer to receive into when the size is
    known ahead, such as the Dask comm's frames. Its content is undefined until
    written, like numpy.empty's."""
    cdef char* data
    if n < 0:
        raise ValueError("size must be >= 0")
    with nogil:
        data = msg_alloc(<size_t>n)
    if data == NULL:
        raise MemoryError()
    return make_message(data, <size_t>n)


cdef sendop_t* op_from(object obj) except NULL:
    """A send operation referencing obj's buffers (no copy): one buffer, or a
    list/tuple of buffers forming one message."""
    cdef list parts
    cdef int n, i
    cdef sendop_t* op
    cdef size_t size
    if isinstance(obj, (list, tuple)):
        parts = list(obj)
    else:
        parts = [obj]
    n = len(parts)
    size = sizeof(sendop_t) + n * (sizeof(seg_t) + sizeof(Py_buffer))
    op = <sendop_t*>calloc(1, size)
    if op == NULL:
        raise MemoryError()
    op.views = <Py_buffer*>(<char*>op + sizeof(sendop_t))
    op.segs = <seg_t*>(<char*>op.views + n * sizeof(Py_buffer))
    op.refs = 2           # the engine and the caller
    try:
        for i in range(n):
            part = parts[i]
            try:
                PyObject_GetBuffer(part, &op.views[i], PyBUF_SIMPLE)
            except (TypeError, BufferError):
                part = as_buffer(part)
                PyObject_GetBuffer(part, &op.views[i], PyBUF_SIMPLE)
            op.nviews += 1
            op.segs[i].ptr = <char*>op.views[i].buf
            op.segs[i].length = <size_t>op.views[i].len
            op.total += op.segs[i].length
        op.nseg = n
    except BaseException:
        for i in range(op.nviews):
            PyBuffer_Release(&op.views[i])
        free(op)
        raise
    return op


def as_buffer(obj):
    """Objects without the buffer protocol: DLPack producers (torch CPU
    tensors, JAX arrays) through numpy; a clear error otherwise."""
    if hasattr(obj, "__dlpack__"):
        import numpy
        arr = numpy.from_dlpack(obj)
        if not arr.flags.c_contiguous:
            raise BufferError("fabric sends only C-contiguous tensors; call .contiguous() first")
        return arr
    raise TypeError(f"fabric cannot send {type(obj).__name__}: it supports neither the "
                    "buffer protocol nor DLPack")


cdef int get_writable(object buf, Py_buffer* view) except -1:
    """A writable contiguous view of buf (buffer protocol, or DLPack for
    tensors such as torch CPU tensors, which share their memory)."""
    try:
        PyObject_GetBuffer(buf, view, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS)
    except (TypeError, BufferError):
        if not hasattr(buf, "__dlpack__"):
            raise
        PyObject_GetBuffer(as_buffer(buf), view, PyBUF_WRITABLE | PyBUF_ANY_CONTIGUOUS)
    return 0


cdef void op_release(Worker worker, sendop_t* op):
    """Drop the caller's reference (GIL held, lock not held)."""
    cdef int i, free_it = 0, views = 0
    cdef worker_t* w = worker.w
    if forked(w):
        return          # the parent's memory: leave it
    with nogil:
        alock(w)
        op.refs -= 1
        if op.state == OP_DONE or op.state == OP_FAILED:
            views = op.nviews
            op.nviews = 0
            free_it = op.refs == 0
        wunlock(w)
    for i in range(views):
        PyBuffer_Release(&op.views[i])
    if free_it:
        op_free(op)


@cython.no_gc_clear
cdef class Request:
    """An isend in progress; the buffer must stay untouched until done()."""
    cdef sendop_t* op
    cdef Endpoint ep
    cdef readonly size_t nbytes
    cdef object _error

    def __init__(self):
        raise TypeError("Requests come from Endpoint.isend()")

    def __dealloc__(self):
        if self.op != NULL and self.ep is not None:
            op_release(self.ep.worker, self.op)
            self.op = NULL

    def done(self):
        cdef int final
        cdef ep_t* ep
        if self.op == NULL:
            return True
        if forked(self.ep.w):
            raise forked_error()
        ep = self.ep.ep
        with nogil:
            alock(self.ep.w)
            if ep.state == EP_OPEN:
                progress_ep(ep)
            final = pred_op_final(self.op)
            notify_loop(self.ep.w)
            wunlock(self.ep.w)
        self.ep.worker.reap()
        if final:
            self._finish()
        return bool(final)

    cdef _finish(self):
        cdef int err = self.op.err
        op_release(self.ep.worker, self.op)
        self.op = NULL
        if err:
            self._error = make_error(err, "send failed", self.ep._detail(err))

    def wait(self, timeout=None):
        """Wait until the message has left obj (and raise if it failed)."""
        cdef double deadline = deadline_of(timeout)
        cdef int rc = 0
        cdef ep_t* ep
        cdef worker_t* w
        if self.op != NULL:
            w = self.ep.w
            if forked(w):
                raise forked_error()
            ep = self.ep.ep
            with nogil:
                alock(w)
                ep.send_waiters += 1
                rc = wait_sig(w, pred_op_final, self.op, ep, deadline)
                ep.send_waiters -= 1
                ep_settle(ep)
                wunlock(w)
            self.ep.worker.reap()
            if rc == SIGNALLED:
                raise_pending()
            if rc == ETIMEDOUT:
                raise _errors.Timeout("send did not complete in time (it continues)")
            if rc == ESHUTDOWN_ and not pred_op_final(self.op):
                raise _errors.ConnectionClosed("the Fabric was closed")
            self._finish()
        if self._error is not None:
            raise self._error

    @property
    def error(self):
        return self._error

    @property
    def endpoint(self):
        return self.ep

    async def await_done(self, timeout=None):
        """wait() for asyncio."""
        from fabric import aio
        if self.op == NULL:
            self.wait(0)
            return
        await aio.wait_request(self, timeout)

    def __await__(self):
        return self.await_done().__await__()

    def __repr__(self):
        state = "done" if self.op == NULL else "pending"
        return f"<fabric.Request {self.nbytes} bytes {state}>"
