# cython: language_level=3
"""The protocol engine: eager, coalescing, rendezvous with pipelined pulls,
credits and ordering, over any backend of fabric.backends.interface.

Everything below the Python classes at the end runs without the GIL under the
worker's mutex. The rules that keep that safe:
  * Engine code never takes the GIL while it holds the worker lock.
  * Python buffers of a send stay referenced by its sendop_t until the op is
    final; they are released (under the GIL, outside the lock) by whoever
    drops the last reference, or by the reap list.
  * A failed endpoint is only marked (ep_fail); its channel is closed and its
    operations failed at a safe point (ep_settle), never in the middle of
    parsing data that belongs to the channel.

Data path of one message (see frame.pxd for the wire format):
  size <= eager_limit  EAGER frame; sent straight from the caller's buffer
                       when the fabric is free and the backend accepts any
                       memory, else copied into a coalescing buffer (slab)
                       together with other small frames.
  size >  eager_limit  RNDV frames announce chunks of the caller's buffer
                       (registered chunk by chunk, chunks_in_flight ahead);
                       the receiver reads each chunk into the destination and
                       answers CHUNK_DONE, which releases the chunk.
"""
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, calloc, realloc, free
from libc.string cimport memcpy, memset, memcmp, strlen
from posix.uio cimport iovec
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE,
                             PyBUF_WRITABLE, PyBUF_ANY_CONTIGUOUS)
from cpython.exc cimport PyErr_CheckSignals
cimport cython

from fabric._posix cimport *
from fabric.backends.interface cimport *
from fabric.backends.sockets cimport local_and_peer_names
from fabric.protocol.frame cimport *

import errno as _errno
import logging as _logging
import sys as _sys
import time as _time
import warnings as _warnings
from fabric import errors as _errors

# One concept per file (each file's header says what it owns and its
# invariants); all are one C module, so calls between them stay direct.
include "core/defs.pxi"
include "core/recv_pool.pxi"
include "core/progress.pxi"
include "core/timers.pxi"
include "core/slabs.pxi"
include "core/credits.pxi"
include "core/protocols.pxi"
include "core/adapt.pxi"
include "core/send.pxi"
include "core/recv.pxi"
include "core/posted.pxi"
include "core/lifecycle.pxi"
include "core/auth.pxi"
include "core/faults.pxi"
include "core/py_worker.pxi"
include "core/py_message.pxi"
include "core/py_endpoint.pxi"
include "core/py_listener.pxi"
